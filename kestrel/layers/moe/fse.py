"""Fused shared experts (FSE): decided once per MoE layer, at construction; the model records the decisions and
the weight loader places shared-expert weights by them, never deciding again.

Fused, the shared expert (intermediate size S = n * I, I the routed experts' size) becomes n extra expert slots
E .. E+n-1 of the routed-expert tensors (a gated MLP split along its intermediate dim is the sum of its chunks),
selected for every token with weight 1 (DeepSeek, GLM) or the token's sigmoid gate (Qwen2-MoE). Unfused, it is a
separate MLP added to the routed output.
"""
from __future__ import annotations

from dataclasses import dataclass

from kestrel.kernels.moe import MoEKernel, MoESpec

FSE_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class SharedExperts:
    """A layer's shared experts as the model config describes them."""

    intermediate_size: int  # all shared experts together (DeepSeek: n_shared_experts * moe_intermediate_size)
    gated: bool = False  # Qwen2-MoE: scaled by sigmoid(shared_expert_gate(x))
    quant: object = None  # the shared MLP's quantization scheme (None: unquantized)


@dataclass(frozen=True)
class FseDecision:
    layer_name: str
    fused: bool
    slots: int  # expert slots the shared experts take when fused (0 when not)
    reason: str  # why not fused ("" when fused)


class FseError(ValueError):
    pass


def resolve_fused_shared_experts(spec: MoESpec, shared: SharedExperts | None, kernel_cls: type[MoEKernel],
                                 mode: str = "auto") -> FseDecision:
    """The one place that decides. `spec` is the routed experts' spec (no shared slots), `kernel_cls` the kernel
    selection chose for it. mode "on" raises naming the layer where fusion is impossible; "auto" falls back."""
    if mode not in FSE_MODES:
        raise FseError(f"fuse_shared_experts must be one of {', '.join(FSE_MODES)}, got {mode!r}")
    name = spec.layer_name

    def no(reason: str) -> FseDecision:
        if mode == "on":
            raise FseError(f"cannot fuse the shared experts of {name}: {reason}")
        return FseDecision(name, False, 0, reason)

    if shared is None:
        return FseDecision(name, False, 0, "no shared experts")
    if mode == "off":
        return FseDecision(name, False, 0, "disabled (fuse_shared_experts=off)")
    if not kernel_cls.supports_fused_shared_experts:
        return no(f"kernel {kernel_cls.name} does not run shared experts as extra experts")
    if shared.intermediate_size % spec.intermediate_size:
        return no(f"shared intermediate size {shared.intermediate_size} is not a multiple of the experts' "
                  f"{spec.intermediate_size}")
    # Quantization compatibility: only asked once fusion is otherwise possible.
    if shared.quant != spec.quant:
        q = lambda s: getattr(s, "name", None) or "unquantized"  # noqa: E731
        return no(f"shared experts are {q(shared.quant)} while the routed experts are {q(spec.quant)}")
    slots = shared.intermediate_size // spec.intermediate_size
    ok, why = kernel_cls.can_implement(spec.with_shared(slots))
    if not ok:
        return no(f"kernel {kernel_cls.name} cannot serve the fused layout: {why}")
    return FseDecision(name, True, slots, "")


def check_fse_consistency(decisions: list[FseDecision], kernels: list[type[MoEKernel]]) -> None:
    """Raise when layers with shared experts are partly fused and a kernel in use cannot mix the two."""
    relevant = [d for d in decisions if d.reason != "no shared experts"]
    fused = [d.layer_name for d in relevant if d.fused]
    unfused = [d for d in relevant if not d.fused]
    if not fused or not unfused:
        return
    strict = sorted({k.name for k in kernels if not k.supports_mixed_fused_shared_experts})
    if strict:
        raise FseError(
            f"mixed fused-shared-experts state ({', '.join(strict)} cannot mix): fused in {', '.join(fused)}; "
            f"not fused in " + "; ".join(f"{d.layer_name} ({d.reason})" for d in unfused)
            + ". Pass fuse_shared_experts='off' to run every layer's shared experts separately.")
