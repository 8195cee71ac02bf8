"""Mixture-of-experts kernels. The layer (future kestrel/layers/moe/) routes tokens, then calls
`kernel.apply(layer, x, topk_weights, topk_ids)`; the kernel owns the expert weights' layout.

Weights (registered by `create_weights`), E experts, hidden H, intermediate I:
  w13: [E, 2*I, H]  gate rows first, then up rows (so a gate/up checkpoint pair loads as shards 0 and 1)
  w2:  [E, H, I]
Activation: silu(gate) * up ("silu") or gelu(gate, tanh) * up ("gelu").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.kernels.base import KernelCandidate
from kestrel.platform import Platform

MOE_ACTIVATIONS = ("silu", "gelu")


@dataclass(frozen=True)
class MoESpec:
    layer_name: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # per expert
    params_dtype: torch.dtype
    activation: str = "silu"
    quant: Any = None  # None: dense expert weights
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def family(self) -> str:
        return "dense" if self.quant is None else self.quant.family


class MoEKernel(KernelCandidate):
    kind: ClassVar[str] = "moe"

    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_weights [T, k] (already normalized as the model wants); topk_ids [T, k] int -> [T, H]."""
        raise NotImplementedError


def _activate(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


class TorchMoE(MoEKernel):
    """Reference MoE: a loop over the experts that received tokens. Runs everywhere; slow but exact."""

    name = "torch_moe"

    @classmethod
    def is_supported(cls, platform: Platform) -> tuple[bool, str]:
        return True, ""

    @classmethod
    def can_implement(cls, spec: MoESpec) -> tuple[bool, str]:
        if spec.quant is not None:
            return False, f"expert weights are quantized ({type(spec.quant).__name__})"
        if spec.activation not in MOE_ACTIVATIONS:
            return False, f"activation {spec.activation!r} is not one of {', '.join(MOE_ACTIVATIONS)}"
        if spec.params_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return False, f"dtype {spec.params_dtype} is not a float type"
        if not 1 <= spec.top_k <= spec.num_experts:
            return False, f"top_k {spec.top_k} must be in 1..{spec.num_experts}"
        return True, ""

    def create_weights(self, layer: nn.Module) -> None:
        s = self.spec
        e, h, i = s.num_experts, s.hidden_size, s.intermediate_size
        layer.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=s.params_dtype), requires_grad=False)
        layer.w2 = nn.Parameter(torch.empty(e, h, i, dtype=s.params_dtype), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
        flat_ids = topk_ids.reshape(-1)
        flat_w = topk_weights.reshape(-1).float()
        token_of = torch.arange(t, device=x.device).repeat_interleave(topk_ids.shape[1])
        for e in torch.unique(flat_ids).tolist():
            sel = (flat_ids == e).nonzero(as_tuple=True)[0]
            tokens = token_of[sel]
            hidden = _activate(F.linear(x[tokens], layer.w13[e]), self.spec.activation)
            y = F.linear(hidden, layer.w2[e]).float() * flat_w[sel, None]
            out.index_add_(0, tokens, y)
        return out.to(x.dtype)


__all__ = ["MOE_ACTIVATIONS", "MoEKernel", "MoESpec", "TorchMoE"]
