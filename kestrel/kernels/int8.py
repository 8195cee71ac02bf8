"""W8A8 INT8 linear kernels (compressed-tensors `int-quantized`: int8 weights with one scale per output row,
activations quantised dynamically per token, symmetric).

Checkpoint tensors: `weight` int8 [N, K], `weight_scale` [N, 1] (the checkpoint's float dtype). The dequantised
weight is q * scale multiplied in the scale's dtype (as compressed-tensors does: the exact product rounded once).

* `torch_int8_mm` (CUDA): activations quantised per token (scale = amax / 127, round half to even), then
  torch._int_mm (int8 x int8 -> int32) and both scales applied in fp32. Rows are padded to 17 where the batch is
  16 or fewer (torch._int_mm's minimum). A layer whose K or N is not a multiple of 8 computes with dequantised
  weights.
* `int8_dequant_fallback` (anywhere): the weights dequantised once to the model's dtype, 16/32-bit activations (the
  dequantised model's own numbers: on the CPU the comparisons against it are exact)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from kestrel.kernels.base import DequantFallback, DequantisedLinear, LinearKernel, LinearSpec
from kestrel.kernels.base import frozen_param as _param
from kestrel.platform import Platform
from kestrel.platform.gates import act_dtype_gate, kernel_gate


@dataclass(frozen=True)
class Int8Scheme:
    """Per-channel symmetric int8 weights; activations int8 per token, dynamic (None: weight-only)."""

    activation: str | None = "token"

    family: ClassVar[str] = "int8"

    @property
    def name(self) -> str:
        return f"int8[w=channel,a={self.activation or 'none'}]"


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], fp32 scales [M, 1]), symmetric: scale = amax / 127."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp(min=1e-10)
    return torch.round(xf / scale).clamp(-128, 127).to(torch.int8), scale


class Int8LinearBase(DequantisedLinear, LinearKernel):
    family: ClassVar[str] = "int8"
    checkpoint_tensors = ("weight", "weight_scale")

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        if not isinstance(spec.quant, Int8Scheme):
            return False, "weights are not INT8 (int-quantized)"
        if spec.params_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return False, f"activation dtype {spec.params_dtype} is not bf16/fp16/fp32"
        return True, ""

    def _shard(self, shard_id):
        sizes = self.spec.output_sizes
        if shard_id is None:
            return 0, sum(sizes)
        if not 0 <= shard_id < len(sizes):
            raise ValueError(f"{self.spec.layer_name}: shard_id {shard_id} out of range for {len(sizes)} shard(s)")
        return sum(sizes[:shard_id]), sizes[shard_id]

    def _load_weight(self, param, loaded, shard_id):
        if loaded.dtype != torch.int8:
            raise ValueError(f"{self.spec.layer_name}.weight: expected an int8 checkpoint tensor, got {loaded.dtype}")
        self._copy(param, loaded, shard_id, "weight")

    def _load_scale(self, param, loaded, shard_id):
        start, rows = self._shard(shard_id)
        if loaded.numel() != rows:
            raise ValueError(f"{self.spec.layer_name}.weight_scale: {loaded.numel()} entries, expected {rows} "
                             "(per-channel scales)")
        if self.scale_dtype not in (None, loaded.dtype):
            raise ValueError(f"{self.spec.layer_name}: scales in both {self.scale_dtype} and {loaded.dtype}")
        self.scale_dtype = loaded.dtype
        self._copy(param, loaded.reshape(rows, 1), shard_id, "weight_scale")

    def _copy(self, param, loaded, shard_id, what):
        start, rows = self._shard(shard_id)
        target = param.data.narrow(0, start, rows)
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"{self.spec.layer_name}.{what}[shard {shard_id}]: checkpoint shape "
                             f"{tuple(loaded.shape)} != expected {tuple(target.shape)}")
        target.copy_(loaded)

    def create_weights(self, layer: nn.Module) -> None:
        s = self.spec
        self.scale_dtype = None
        layer.weight = _param(torch.zeros(s.output_size, s.input_size, dtype=torch.int8), weight_loader=self._load_weight)
        layer.weight_scale = _param(torch.zeros(s.output_size, 1), weight_loader=self._load_scale)
        layer.bias = _param(torch.zeros(s.output_size, dtype=s.params_dtype), shard_dim=0) if s.bias else None

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
        sdtype = self.scale_dtype or torch.float32
        w = layer.weight.data.float() * layer.weight_scale.data.to(sdtype).float()  # exact in fp32
        return w.to(sdtype).to(dtype or self.spec.params_dtype)



class Int8DequantFallbackLinear(DequantFallback, Int8LinearBase):
    name = "int8_dequant_fallback"


INT_MM_MIN_ROWS = 17  # torch._int_mm needs more than 16 rows


def int8_mm(xq: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """torch._int_mm(xq [M, K], w_t [K, N] column-major) -> int32 [M, N]; rows padded to 17 for small M."""
    m = xq.shape[0]
    if m < INT_MM_MIN_ROWS:
        xq = torch.cat([xq, xq.new_zeros(INT_MM_MIN_ROWS - m, xq.shape[1])])
    return torch._int_mm(xq, w_t)[:m]


class TorchInt8MMLinear(Int8LinearBase):
    name = "torch_int8_mm"

    @classmethod
    def is_supported(cls, platform: Platform) -> tuple[bool, str]:
        return kernel_gate(cls.name, platform)

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        ok, why = super().can_implement(spec)
        if not ok:
            return ok, why
        if spec.quant.activation != "token":
            return False, "weight-only INT8 (the checkpoint does not quantize activations)"
        ok, why = act_dtype_gate(cls.name, spec.params_dtype)
        if not ok:
            return ok, why
        return True, ""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        s = self.spec
        self.dense = s.input_size % 8 != 0 or s.output_size % 8 != 0
        if self.dense:
            self.to_dense(layer)
            return
        scale = layer.weight_scale.data.to(self.scale_dtype or torch.float32).float().reshape(1, -1).contiguous()
        w_t = layer.weight.data.t()  # [K, N], column-major: what cuBLASLt wants for the second operand
        del layer._parameters["weight_scale"], layer._parameters["weight"]
        layer.weight = _param(w_t)
        layer.weight_scale = _param(scale)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.dense:
            return self.dense_apply(layer, x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, xs = quantize_per_token_int8(x2)
        y = (int8_mm(xq, layer.weight).float() * xs * layer.weight_scale).to(x.dtype)
        if layer.bias is not None:
            y = y + layer.bias.to(y.dtype)
        return y.reshape(*shape[:-1], y.shape[-1])


INT8_LINEAR_KERNELS = (TorchInt8MMLinear, Int8DequantFallbackLinear)
__all__ = ["Int8DequantFallbackLinear", "Int8LinearBase", "Int8Scheme", "TorchInt8MMLinear",
           "quantize_per_token_int8"]
