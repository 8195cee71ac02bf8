"""Unquantized linear: plain torch matmul (everywhere), and the Triton skinny GEMM for small batches on CUDA."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.kernels.base import LinearKernel, LinearSpec
from kestrel.platform import Platform
from kestrel.platform.gates import act_dtype_gate, kernel_gate


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


class TritonSkinnyDenseLinear(TorchDenseLinear):
    """Same weights as torch_dense. Layers with few output columns (N <= 2048) at <= 8 rows (decode at small
    batch) go through the Triton split-K skinny GEMM (kestrel/kernels/triton_ops/skinny_gemm.py): there cuBLAS
    cannot fill the GPU (H200, N 1024 x K 2048 at batch 1: 4.7 us vs 12.7). Wider layers and larger batches
    take torch matmul, which measured as fast or faster there."""

    name = "triton_skinny_dense"
    MAX_ROWS = 8
    MAX_COLUMNS = 2048
    # The fused norm has every program read the whole input row (+ residual, norm weight): a win at K <= 2048
    # (0.6B qkv 4.7 us vs norm + cuBLAS 5.6), a loss at K = 4096 (8B qkv 22.2 vs 18.4: 3x the weight tile's bytes
    # re-read from L2 per program). Wider layers run the norm kernel, then the GEMV.
    NORM_MAX_K = 2048

    @classmethod
    def is_supported(cls, platform: Platform) -> tuple[bool, str]:
        return kernel_gate(cls.name, platform)

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        ok, why = super().can_implement(spec)
        if not ok:
            return ok, why
        ok, why = act_dtype_gate(cls.name, spec.params_dtype)
        if not ok:
            return ok, why
        return True, ""

    def _skinny(self, layer: nn.Module, x: torch.Tensor, max_columns: int) -> bool:
        return x.is_cuda and x.dim() == 2 and x.shape[0] <= self.MAX_ROWS and layer.weight.shape[0] <= max_columns

    @staticmethod
    def _gemv(x: torch.Tensor) -> bool:
        return x.is_cuda and x.dim() == 2 and x.shape[0] == 1

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self._gemv(x2):
            from kestrel.kernels.triton_ops.gemv import gemv

            return gemv(x2, layer.weight, layer.bias).view(*x.shape[:-1], layer.weight.shape[0])
        if not self._skinny(layer, x2, self.MAX_COLUMNS):
            return F.linear(x, layer.weight, layer.bias)
        from kestrel.kernels.triton_ops.skinny_gemm import skinny_gemm

        return skinny_gemm(x2, layer.weight, layer.bias).view(*x.shape[:-1], layer.weight.shape[0])

    def apply_rms_norm(self, layer, x, norm_weight, eps, residual):
        if not self._gemv(x) or x.shape[1] > self.NORM_MAX_K:
            return None
        from kestrel.kernels.triton_ops.gemv import gemv

        return gemv(x, layer.weight, layer.bias, norm_weight=norm_weight, eps=eps, residual=residual)

    def apply_rms_norm_silu(self, layer, x, norm_weight, eps, residual):
        if not self._gemv(x) or layer.bias is not None:
            return None
        from kestrel.kernels.triton_ops.gemv import gemv

        if x.shape[1] <= self.NORM_MAX_K:
            return gemv(x, layer.weight, norm_weight=norm_weight, eps=eps, residual=residual, silu_out=True)
        from kestrel.kernels.triton_ops.fused_ops import rms_norm

        h, residual = rms_norm(x, norm_weight, eps, residual) if residual is not None else (
            rms_norm(x, norm_weight, eps), x)
        return gemv(h, layer.weight, silu_out=True), residual
