"""Mixture-of-experts kernels. The layer (kestrel/layers/moe/) routes tokens, then calls
`kernel.apply(layer, x, topk_weights, topk_ids)`; the kernel owns the expert weights' layout.

Weights (registered by `create_weights`), E = routed experts + fused shared-expert slots, hidden H, intermediate I:
  w13: [E, 2*I, H]  gate rows first, then up rows (so a gate/up checkpoint pair loads as shards 0 and 1)
  w2:  [E, H, I]
FP8 block-quantized kernels add w13_scale [E, 2I/bn, H/bk] and w2_scale [E, H/bn, I/bk] (fp32 block scales).
Activation: by name, MOE_ACTIVATIONS: silu(gate) * up ("silu"), gelu(gate, tanh) * up ("gelu": Gemma 4), or
gpt-oss's clamped SwiGLU ("swigluoai": gate clamped above at 7, up to [-7, 7], gate * sigmoid(1.702 gate) *
(up + 1)); the Triton kernels' epilogue implements TRITON_MOE_ACTIVATIONS of them (triton_ops/fused_moe.py
EPILOGUES).
Expert biases (`MoESpec.bias`, gpt-oss): w13_bias [E, 2I] (gate, then up) added before the activation, w2_bias
[E, H] added to each expert's output before its routing weight.

Fused shared experts: slots E_routed .. E-1 hold the shared expert(s), split into chunks of I; the layer appends
their ids to every token's top-k (weight 1, or the Qwen2-MoE sigmoid gate). A kernel declares whether it can
serve that (`supports_fused_shared_experts`) and whether a model may mix fused and unfused layers on it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.kernels.base import KernelCandidate
from kestrel.kernels.fp8_scheme import Fp8Scheme
from kestrel.platform import Platform
from kestrel.platform.gates import kernel_gate

SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


def _swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.clamp(max=SWIGLU_OAI_LIMIT), up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA) * (up + 1)


# the experts' gated activation by name: (gate, up) -> hidden
MOE_ACTIVATIONS = {
    "silu": lambda gate, up: F.silu(gate) * up,
    "gelu": lambda gate, up: F.gelu(gate, approximate="tanh") * up,
    "swigluoai": _swiglu_oai,
}
TRITON_MOE_ACTIVATIONS = ("silu", "swigluoai", "gelu")  # the Triton fused MoE's epilogues (triton_ops/fused_moe.py)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class MoESpec:
    layer_name: str
    num_experts: int  # routed experts
    top_k: int  # routed experts per token
    hidden_size: int
    intermediate_size: int  # per expert
    params_dtype: torch.dtype
    activation: str = "silu"
    quant: Any = None  # None: dense expert weights; an Fp8Scheme for FP8 experts
    num_shared_experts: int = 0  # fused shared-expert slots appended after the routed experts (0: not fused)
    bias: bool = False  # expert biases w13_bias / w2_bias
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def family(self) -> str:
        return "dense" if self.quant is None else self.quant.family

    @property
    def total_experts(self) -> int:
        return self.num_experts + self.num_shared_experts

    def with_shared(self, n: int) -> "MoESpec":
        return replace(self, num_shared_experts=n)


class MoEKernel(KernelCandidate):
    kind: ClassVar[str] = "moe"
    supports_fused_shared_experts: ClassVar[bool] = False
    supports_mixed_fused_shared_experts: ClassVar[bool] = False  # fused and unfused layers in one model
    supports_tensor_parallel: ClassVar[bool] = True  # loads a rank's slice of each expert (layers/moe/layer.py)
    # an expert tensor's checkpoint name -> the suffix of its parameter (w13 + "_scale"): the block scales
    checkpoint_params: ClassVar[dict[str, str]] = {"weight": "", "weight_scale_inv": "_scale", "weight_scale": "_scale",
                                                   "bias": "_bias"}

    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def load_expert(self, layer: nn.Module, param: str, slot: int, shard: int | None, loaded: torch.Tensor) -> None:
        """Copy one expert's checkpoint tensor into `param` (w13 / w2 / w13_scale / w2_scale) at expert `slot`;
        shard 0 (gate) / 1 (up) select w13's half. Scales follow their weight's rows in block units."""
        p = getattr(layer, param, None)
        if not isinstance(p, torch.Tensor):
            have = ", ".join(n for n, _ in layer.named_parameters(recurse=False))
            raise KeyError(f"{self.spec.layer_name} ({self.name}) has no parameter {param!r}; it expects: {have}")
        target = p.data[slot]
        if shard is not None:
            half = target.shape[0] // 2
            target = target.narrow(0, shard * half, half)
        if target.shape != loaded.shape:
            raise ValueError(f"{self.spec.layer_name}.{param}[expert {slot}, shard {shard}]: checkpoint shape "
                             f"{tuple(loaded.shape)} != {tuple(target.shape)}")
        target.copy_(loaded)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_weights [T, k] (already normalized as the model wants); topk_ids [T, k] int -> [T, H]."""
        raise NotImplementedError


def _check_dense(spec: MoESpec, dtypes=_FLOATS) -> tuple[bool, str]:
    if spec.quant is not None:
        return False, f"expert weights are quantized ({getattr(spec.quant, 'name', type(spec.quant).__name__)})"
    if spec.params_dtype not in dtypes:
        return False, f"dtype {spec.params_dtype} is not one of {', '.join(str(d) for d in dtypes)}"
    if not 1 <= spec.top_k <= spec.num_experts:
        return False, f"top_k {spec.top_k} must be in 1..{spec.num_experts}"
    return True, ""


def _dense_weights(layer: nn.Module, spec: MoESpec, dtype: torch.dtype) -> None:
    e, h, i = spec.total_experts, spec.hidden_size, spec.intermediate_size
    layer.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)
    layer.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)
    _bias_weights(layer, spec)


def _bias_weights(layer: nn.Module, spec: MoESpec) -> None:
    if spec.bias:
        e, h, i = spec.total_experts, spec.hidden_size, spec.intermediate_size
        layer.w13_bias = nn.Parameter(torch.zeros(e, 2 * i, dtype=spec.params_dtype), requires_grad=False)
        layer.w2_bias = nn.Parameter(torch.zeros(e, h, dtype=spec.params_dtype), requires_grad=False)


def _activate(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    return MOE_ACTIVATIONS[activation](*gate_up.chunk(2, dim=-1))


def _expert(layer: nn.Module, e: int, x: torch.Tensor, activation: str) -> torch.Tensor:
    """Expert e on the rows x (before its routing weight), with its biases where the layer has them."""
    b13, b2 = getattr(layer, "w13_bias", None), getattr(layer, "w2_bias", None)
    hidden = _activate(F.linear(x, layer.w13[e], None if b13 is None else b13[e]), activation)
    return F.linear(hidden, layer.w2[e], None if b2 is None else b2[e])


class TorchMoE(MoEKernel):
    """Reference MoE: a loop over the experts that received tokens. Runs everywhere; slow but exact."""

    name = "torch_moe"
    supports_fused_shared_experts = True

    @classmethod
    def is_supported(cls, platform: Platform) -> tuple[bool, str]:
        return True, ""

    @classmethod
    def can_implement(cls, spec: MoESpec) -> tuple[bool, str]:
        if spec.activation not in MOE_ACTIVATIONS:
            return False, f"activation {spec.activation!r} is not one of {', '.join(MOE_ACTIVATIONS)}"
        return _check_dense(spec)

    def create_weights(self, layer: nn.Module) -> None:
        _dense_weights(layer, self.spec, self.spec.params_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self.apply_dense(layer, x, topk_weights, topk_ids)
        t, h = x.shape
        out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
        flat_ids = topk_ids.reshape(-1)
        flat_w = topk_weights.reshape(-1).float()
        token_of = torch.arange(t, device=x.device).repeat_interleave(topk_ids.shape[1])
        for e in torch.unique(flat_ids).tolist():
            sel = (flat_ids == e).nonzero(as_tuple=True)[0]
            tokens = token_of[sel]
            y = _expert(layer, e, x[tokens], self.spec.activation).float() * flat_w[sel, None]
            out.index_add_(0, tokens, y)
        return out.to(x.dtype)

    def apply_dense(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by its routing weight (zero where not chosen): no host
        synchronisation, so a CUDA graph can capture it (the GPU fallback; E times the FLOPs)."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(layer.w13.shape[0]):
            w = (topk_weights.float() * (topk_ids == e)).sum(dim=1, keepdim=True)
            out += _expert(layer, e, x, self.spec.activation).float() * w
        return out.to(x.dtype)


# Buckets are compiled once per expert shape and process: (kernel name, E, slots per token, H, I, dtype).
_WARMED: set[tuple] = set()


class TritonFusedMoE(MoEKernel):
    """Triton fused MoE (kestrel/kernels/triton_ops/fused_moe.py): tokens sorted and padded by expert, one
    grouped-GEMM launch for gate_up with SiLU-and-mul, one for down with the routing weights in the epilogue."""

    name = "triton_fused_moe"
    supports_fused_shared_experts = True

    @classmethod
    def is_supported(cls, platform: Platform) -> tuple[bool, str]:
        return kernel_gate(cls.name, platform)

    @classmethod
    def can_implement(cls, spec: MoESpec) -> tuple[bool, str]:
        if spec.activation not in TRITON_MOE_ACTIVATIONS:
            return False, f"activation {spec.activation!r}: the epilogue implements {', '.join(TRITON_MOE_ACTIVATIONS)}"
        return _check_dense(spec, (torch.bfloat16, torch.float16))

    def create_weights(self, layer: nn.Module) -> None:
        _dense_weights(layer, self.spec, self.spec.params_dtype)

    def _kernel_args(self, layer):
        """The kernel's keyword arguments besides the weights: scales (FP8), biases and the activation."""
        if not self.spec.bias and self.spec.activation == "silu":
            return {}
        return dict(w13_bias=getattr(layer, "w13_bias", None), w2_bias=getattr(layer, "w2_bias", None),
                    activation=self.spec.activation)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Compile every batch bucket's variant now, in parallel, so no request waits for a compilation."""
        s = self.spec
        k = s.top_k + s.num_shared_experts  # a constexpr of the gate_up GEMM
        key = (self.name, s.total_experts, k, s.hidden_size, s.intermediate_size, s.params_dtype, s.activation,
               s.bias)
        if layer.w13.device.type != "cuda" or key in _WARMED:
            return
        _WARMED.add(key)
        from kestrel.kernels.triton_ops import fused_moe
        from kestrel.kernels.triton_ops.precompile import precompile

        precompile(lambda: fused_moe.warm_up(s.params_dtype, layer.w13, layer.w2, k, 16384,
                                             **self._kernel_args(layer)), f"fused MoE {s.layer_name} buckets")

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        from kestrel.kernels.triton_ops.fused_moe import fused_moe

        return fused_moe(x, layer.w13, layer.w2, topk_weights, topk_ids, **self._kernel_args(layer))


class TritonFp8BlockMoE(TritonFusedMoE):
    """The Triton fused MoE on block-quantized FP8 experts (DeepSeek-V3 style 128x128 weight blocks, activations
    quantized per token and per group of 128 columns)."""

    name = "triton_fp8_block_moe"
    family = "fp8"

    @classmethod
    def can_implement(cls, spec: MoESpec) -> tuple[bool, str]:
        if spec.activation not in TRITON_MOE_ACTIVATIONS:
            return False, f"activation {spec.activation!r}: the epilogue implements {', '.join(TRITON_MOE_ACTIVATIONS)}"
        if spec.bias:
            return False, "expert biases: the epilogues add none"
        if spec.params_dtype not in (torch.bfloat16, torch.float16):
            return False, f"activations in {spec.params_dtype}; needs bf16 or fp16"
        return _check_fp8_block(spec)

    @classmethod
    def can_implement_on(cls, spec: MoESpec, platform: Platform) -> tuple[bool, str]:
        from kestrel.platform.capabilities import is_fp8_fnuz

        if is_fp8_fnuz(platform):
            return False, "FNUZ FP8 (gfx942): checkpoint e4m3fn experts are not converted for this kernel yet"
        return True, ""

    def create_weights(self, layer: nn.Module) -> None:
        _fp8_block_weights(layer, self.spec)

    def _kernel_args(self, layer):
        return dict(w13_scale=layer.w13_scale, w2_scale=layer.w2_scale, block_shape=tuple(self.spec.quant.block_size),
                    activation=self.spec.activation)


def _check_fp8_block(spec: MoESpec) -> tuple[bool, str]:
    q = spec.quant
    if not isinstance(q, Fp8Scheme):
        return False, "expert weights are not FP8-quantized"
    if q.weight != "block" or q.activation != "group" or not q.activation_dynamic:
        return False, f"needs block weights with dynamic per-token-group activations (got {q.name})"
    bn, bk = q.block_size
    if bk != 128 or q.group_size != bk:
        return False, f"needs weight block K = activation group = 128 (got {bk}, group {q.group_size})"
    for what, size, block in (("intermediate", spec.intermediate_size, bn), ("intermediate", spec.intermediate_size, bk),
                              ("hidden", spec.hidden_size, bn), ("hidden", spec.hidden_size, bk)):
        if size % block:
            return False, f"{what} size {size} is not a multiple of the weight block {block}"
    return True, ""


def _fp8_block_weights(layer: nn.Module, s: MoESpec) -> None:
    """Checkpoint layout of block-quantized experts: fp8 weights and fp32 block scales (multiples of the block)."""
    bn, bk = s.quant.block_size
    e, h, i = s.total_experts, s.hidden_size, s.intermediate_size
    fp8 = torch.float8_e4m3fn
    layer.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=fp8), requires_grad=False)
    layer.w2 = nn.Parameter(torch.empty(e, h, i, dtype=fp8), requires_grad=False)
    layer.w13_scale = nn.Parameter(torch.ones(e, 2 * i // bn, h // bk), requires_grad=False)
    layer.w2_scale = nn.Parameter(torch.ones(e, h // bn, i // bk), requires_grad=False)
    _bias_weights(layer, s)


class Fp8DequantMoE(TorchMoE):
    """FP8 block-quantized experts anywhere: loaded in the checkpoint's layout, dequantized once after loading,
    then the reference loop (the CPU path for DeepSeek-style FP8 checkpoints)."""

    name = "fp8_dequant_moe"
    family = "fp8"

    @classmethod
    def can_implement(cls, spec: MoESpec) -> tuple[bool, str]:
        if spec.params_dtype not in _FLOATS:
            return False, f"dtype {spec.params_dtype} is not a float type"
        if spec.activation not in MOE_ACTIVATIONS:
            return False, f"activation {spec.activation!r} is not one of {', '.join(MOE_ACTIVATIONS)}"
        return _check_fp8_block(spec)

    def create_weights(self, layer: nn.Module) -> None:
        _fp8_block_weights(layer, self.spec)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        bn, bk = self.spec.quant.block_size

        def dequant(w, s):
            scale = s.float().repeat_interleave(bn, 1).repeat_interleave(bk, 2)
            return nn.Parameter((w.float() * scale).to(self.spec.params_dtype), requires_grad=False)

        layer.w13, layer.w2 = dequant(layer.w13, layer.w13_scale), dequant(layer.w2, layer.w2_scale)
        del layer.w13_scale, layer.w2_scale


__all__ = ["MOE_ACTIVATIONS", "TRITON_MOE_ACTIVATIONS", "Fp8DequantMoE", "MoEKernel", "MoESpec", "TorchMoE", "TritonFp8BlockMoE", "TritonFusedMoE"]
