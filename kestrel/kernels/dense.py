"""Unquantized linear: plain torch matmul, available everywhere."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.kernels.base import LinearKernel, LinearSpec
from kestrel.platform import Platform


class TorchDenseLinear(LinearKernel):
    name = "torch_dense"

    @classmethod
    def is_supported(cls, platform: Platform) -> tuple[bool, str]:
        return True, ""

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        if spec.quant is not None:
            return False, f"weights are quantized ({type(spec.quant).__name__})"
        if spec.params_dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            return False, f"dtype {spec.params_dtype} is not a float type"
        return True, ""

    def create_weights(self, layer: nn.Module) -> None:
        s = self.spec
        layer.weight = nn.Parameter(torch.empty(s.output_size, s.input_size, dtype=s.params_dtype), requires_grad=False)
        layer.weight.shard_dim = 0  # merged shards are stacked along the output dim
        if s.bias:
            layer.bias = nn.Parameter(torch.zeros(s.output_size, dtype=s.params_dtype), requires_grad=False)
            layer.bias.shard_dim = 0
        else:
            layer.bias = None

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)
