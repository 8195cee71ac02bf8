"""RMSNorm (with the residual add) followed by a linear layer, and optionally SiLU-and-mul on its output, as one
call. The decision to run the norm (and the activation) inside the GEMM lives here, not in model code: where the
linear's kernel fuses them (small batches on CUDA) it is one launch, elsewhere norm, linear and activation run in
turn. A linear layer wrapped by something that must see its input (LoRA, tensor parallelism) sets
`fusable = False` and keeps its one entry point, `forward`."""
from __future__ import annotations

import torch

from kestrel.layers.activation import SiluAndMul
from kestrel.layers.norm import RMSNorm


class NormLinear:
    """(act(linear(norm(x + residual))), x + residual); residual None means x is the residual stream's start.
    Holds references to modules registered elsewhere (their checkpoint names stay where they are)."""

    def __init__(self, norm, linear, act=None):
        self.norm, self.linear, self.act = norm, linear, act

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None):
        linear = self.linear
        if (getattr(linear, "fusable", False) and isinstance(self.norm, RMSNorm)  # not a ResidualAdd
                and self.norm.fusable):  # the kernels round as Llama's RMSNorm does
            kernel = linear.kernel
            if self.act is None:
                fused = kernel.apply_rms_norm(linear, x, self.norm.weight, self.norm.eps, residual)
            elif isinstance(self.act, SiluAndMul):
                fused = kernel.apply_rms_norm_silu(linear, x, self.norm.weight, self.norm.eps, residual)
            else:
                fused = None
            if fused is not None:
                return fused
        if residual is None:
            h, residual = self.norm(x), x
        else:
            h, residual = self.norm(x, residual)
        y = linear(h)
        return (self.act(y) if self.act is not None else y), residual
