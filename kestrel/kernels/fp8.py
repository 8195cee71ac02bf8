"""FP8 (W8A8) linear kernels. Priority on GPUs: torch_scaled_mm, triton_fp8_block, fp8_dequant_fallback.

All three share the checkpoint-facing half (`Fp8LinearBase`): which parameters a scheme registers and how
per-shard tensors of merged layers are loaded. They differ in what `process_weights_after_loading` turns those
tensors into and in `apply`.

Loaded layout, per scheme (N = sum of shard sizes, K = input size):
* `weight`: float8_e4m3fn [N, K] (serialized) or params_dtype [N, K] (quantize-on-load).
* block: `<weight_scale_name>` fp32 [sum_i ceil(N_i / bn), ceil(K / bk)]: the shards' block grids stacked in shard
  order (for shards that are multiples of bn this is exactly the merged matrix's grid).
* channel: `weight_scale` fp32 [N, 1]. tensor: `weight_scale` fp32 [num_shards] (one per shard).
* static activations: `input_scale` fp32 [num_shards].
"""
from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.kernels.base import LinearKernel, LinearSpec
from kestrel.kernels.base import frozen_param as _param
from kestrel.kernels.fp8_quant import (
    FP8_DTYPES,
    e4m3fn_to_e4m3fnuz,
    quantize_per_tensor_dynamic,
    quantize_per_tensor_static,
    quantize_per_token,
    quantize_weight_per_channel,
)
from kestrel.kernels.fp8_scheme import Fp8Scheme
from kestrel.platform import Platform
from kestrel.platform.capabilities import check_fp8_rowwise_scaled_mm, fp8_dtype
from kestrel.platform.gates import kernel_gate

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CHECKPOINT_FP8 = torch.float8_e4m3fn




class Fp8LinearBase(LinearKernel):
    family: ClassVar[str] = "fp8"

    @classmethod
    def is_supported(cls, platform: Platform) -> tuple[bool, str]:
        """A gated FP8 kernel answers from its own row of the gate table (platform/gates.py), by name."""
        return kernel_gate(cls.name, platform)

    @classmethod
    def _check_common(cls, spec: LinearSpec) -> tuple[bool, str]:
        if not isinstance(spec.quant, Fp8Scheme):
            if spec.quant is None:
                return False, "weights are not quantized"
            return False, f"not an FP8 scheme ({type(spec.quant).__name__})"
        if spec.params_dtype not in _FLOAT_DTYPES:
            return False, f"activation dtype {spec.params_dtype} is not bf16/fp16/fp32"
        return True, ""

    # ------------------------------------------------------------------------------------------- shard geometry
    def _shard_rows(self, shard_id: int | None) -> tuple[int, int]:
        sizes = self.spec.output_sizes
        if shard_id is None:
            return 0, sum(sizes)
        return sum(sizes[:shard_id]), sizes[shard_id]

    def _shard_block_rows(self, shard_id: int | None) -> tuple[int, int]:
        bn = self.spec.quant.block_size[0]
        counts = [math.ceil(n / bn) for n in self.spec.output_sizes]
        if shard_id is None:
            return 0, sum(counts)
        return sum(counts[:shard_id]), counts[shard_id]

    def _check_shard_id(self, shard_id: int | None) -> None:
        n = len(self.spec.output_sizes)
        if shard_id is not None and not 0 <= shard_id < n:
            raise ValueError(f"{self.spec.layer_name}: shard_id {shard_id} out of range for {n} shard(s)")

    def _copy_rows(self, param, loaded, start, length, what):
        target = param.data.narrow(0, start, length)
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(
                f"{self.spec.layer_name}.{what}: checkpoint shape {tuple(loaded.shape)} != expected {tuple(target.shape)}"
            )
        target.copy_(loaded)

    # ------------------------------------------------------------------------------------------- loaders
    def _load_fp8_weight(self, param, loaded, shard_id):
        self._check_shard_id(shard_id)
        if loaded.dtype != _CHECKPOINT_FP8:
            raise ValueError(
                f"{self.spec.layer_name}.weight: expected a float8_e4m3fn checkpoint tensor, got {loaded.dtype}"
            )
        self._copy_rows(param, loaded, *self._shard_rows(shard_id), f"weight[shard {shard_id}]")

    def _load_block_scale(self, param, loaded, shard_id):
        self._check_shard_id(shard_id)
        self._copy_rows(param, loaded.float(), *self._shard_block_rows(shard_id), self.spec.quant.weight_scale_name)

    def _load_channel_scale(self, param, loaded, shard_id):
        self._check_shard_id(shard_id)
        start, length = self._shard_rows(shard_id)
        if loaded.numel() != length:
            raise ValueError(
                f"{self.spec.layer_name}.weight_scale: per-channel scale has {loaded.numel()} entries, expected {length}"
            )
        self._copy_rows(param, loaded.float().reshape(length, 1), start, length, "weight_scale")

    def _load_shard_scalar(self, param, loaded, shard_id):
        self._check_shard_id(shard_id)
        if loaded.numel() != 1:
            raise ValueError(f"{self.spec.layer_name}: expected a per-tensor scale (1 element), got {tuple(loaded.shape)}")
        if shard_id is None:
            param.data.fill_(loaded.float().reshape(()).item())
        else:
            param.data[shard_id] = loaded.float().reshape(())

    # ------------------------------------------------------------------------------------------- weights
    def create_weights(self, layer: nn.Module) -> None:
        s, q = self.spec, self.spec.quant
        n, k, shards = s.output_size, s.input_size, len(s.output_sizes)
        if q.serialized:
            layer.weight = _param(torch.empty(n, k, dtype=_CHECKPOINT_FP8), shard_dim=0, weight_loader=self._load_fp8_weight)
            if q.weight == "block":
                rows, cols = self._shard_block_rows(None)[1], math.ceil(k / q.block_size[1])
                scale = _param(torch.empty(rows, cols, dtype=torch.float32), weight_loader=self._load_block_scale)
                setattr(layer, q.weight_scale_name, scale)
            elif q.weight == "channel":
                layer.weight_scale = _param(torch.empty(n, 1, dtype=torch.float32), weight_loader=self._load_channel_scale)
            else:
                layer.weight_scale = _param(
                    torch.full((shards,), float("nan"), dtype=torch.float32), weight_loader=self._load_shard_scalar
                )
        else:  # quantize on load: the checkpoint's dense weight lands here first
            layer.weight = _param(torch.empty(n, k, dtype=s.params_dtype), shard_dim=0)
        if q.has_input_scale:
            layer.input_scale = _param(
                torch.full((shards,), float("nan"), dtype=torch.float32), weight_loader=self._load_shard_scalar
            )
        else:
            layer.input_scale = None
        if s.bias:
            layer.bias = _param(torch.zeros(n, dtype=s.params_dtype), shard_dim=0)
        else:
            layer.bias = None

    def _check_loaded_scalars(self, layer) -> None:
        for name in ("weight_scale", "input_scale"):
            t = getattr(layer, name, None)
            if t is not None and t.dim() == 1 and torch.isnan(t).any():
                missing = [i for i, v in enumerate(t.tolist()) if math.isnan(v)]
                raise ValueError(f"{self.spec.layer_name}.{name}: no value was loaded for shard(s) {missing}")

    def _row_block_index(self, device) -> torch.Tensor:
        """For every output row, the row of the stacked block-scale grid that scales it."""
        bn = self.spec.quant.block_size[0]
        parts, offset = [], 0
        for size in self.spec.output_sizes:
            parts.append(torch.arange(size, device=device) // bn + offset)
            offset += math.ceil(size / bn)
        return torch.cat(parts)

    def _blocks_aligned(self) -> bool:
        """True when the stacked per-shard grids equal the merged matrix's own block grid."""
        bn = self.spec.quant.block_size[0]
        return all(size % bn == 0 for size in self.spec.output_sizes[:-1])

    def _per_row_tensor_scale(self, layer) -> torch.Tensor:
        """Per-tensor shard scales expanded to one scale per output row: [N]."""
        sizes = torch.tensor(self.spec.output_sizes, device=layer.weight_scale.device)
        return torch.repeat_interleave(layer.weight_scale.data.float(), sizes)

    def dequantized_weight(self, layer, dtype=torch.float32) -> torch.Tensor:
        """The weight this layer computes with, as a dense [N, K] tensor (checkpoint tensors, before processing)."""
        q = self.spec.quant
        w = layer.weight.data
        if not q.serialized:
            wq, s = quantize_weight_per_channel(w, _CHECKPOINT_FP8)
            return (wq.float() * s).to(dtype)
        wf = w.float()
        if q.weight == "block":
            grid = getattr(layer, q.weight_scale_name).data.float()
            per_row = grid[self._row_block_index(grid.device)]  # [N, ceil(K/bk)]
            per_elem = per_row.repeat_interleave(q.block_size[1], dim=1)[:, : wf.shape[1]]
            return (wf * per_elem).to(dtype)
        if q.weight == "channel":
            return (wf * layer.weight_scale.data.float()).to(dtype)
        return (wf * self._per_row_tensor_scale(layer)[:, None]).to(dtype)

    @staticmethod
    def _replace(layer, name, value):
        if value is None:
            if hasattr(layer, name):
                delattr(layer, name)
            setattr(layer, name, None)
            return
        if name in layer._parameters:
            del layer._parameters[name]
        setattr(layer, name, _param(value))

    def _add_bias(self, layer, y):
        return y if layer.bias is None else y + layer.bias.to(y.dtype)


# ================================================================================================ fallback
class Fp8DequantFallbackLinear(Fp8LinearBase):
    """Weight-only: dequantize FP8 weights to the activation dtype once after loading, then a plain matmul.

    Runs everywhere (CPU, pre-Ada GPUs, RDNA3, ...). Activations are not quantized, so outputs differ from a true
    W8A8 kernel only by the activation rounding. Quantize-on-load weights are quantized and dequantized, so the
    fallback computes with the same FP8-rounded weights a W8A8 kernel would.
    """

    name = "fp8_dequant_fallback"

    @classmethod
    def is_supported(cls, platform: Platform) -> tuple[bool, str]:
        return True, ""

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        return cls._check_common(spec)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self._check_loaded_scalars(layer)
        w = self.dequantized_weight(layer, self.spec.params_dtype)
        self._replace(layer, "weight", w)
        for name in ("weight_scale", "weight_scale_inv", "input_scale"):
            if getattr(layer, name, None) is not None:
                self._replace(layer, name, None)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight.to(x.dtype), None if layer.bias is None else layer.bias.to(x.dtype))


# ================================================================================================ torch._scaled_mm
def scaled_mm(
    a: torch.Tensor, b_t: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """torch._scaled_mm(a [M,K] row-major, b_t [K,N] column-major) with fp32 scales; works across torch versions
    that returned (out, amax) tuples."""
    out = torch._scaled_mm(a, b_t, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out[0] if isinstance(out, tuple) else out


class TorchScaledMMLinear(Fp8LinearBase):
    """torch._scaled_mm: per-tensor scales everywhere FP8 scaled-MM exists; row-wise (per-token activations and/or
    per-channel weights) where `supports_fp8_rowwise_scaled_mm`. Block-wise weights are not served here."""

    name = "torch_scaled_mm"

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        ok, why = cls._check_common(spec)
        if not ok:
            return ok, why
        q: Fp8Scheme = spec.quant
        if q.weight == "block":
            return False, "block-wise weight scales need a block-scaled GEMM"
        if q.activation is None:
            return False, "weight-only FP8 (the checkpoint does not quantize activations)"
        if q.activation == "group":
            return False, "per-token-group activation scales are not a torch._scaled_mm layout"
        if spec.input_size % 16 or spec.output_size % 16:
            return False, f"torch._scaled_mm needs K and N divisible by 16 (K={spec.input_size}, N={spec.output_size})"
        return True, ""

    @classmethod
    def can_implement_on(cls, spec: LinearSpec, platform: Platform) -> tuple[bool, str]:
        if spec.quant.needs_rowwise:
            return check_fp8_rowwise_scaled_mm(platform)
        return True, ""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self._check_loaded_scalars(layer)
        q: Fp8Scheme = self.spec.quant
        dtype = fp8_dtype(self.platform)
        self.rowwise = q.needs_rowwise
        if q.serialized and q.weight == "tensor" and not self.rowwise:
            # merged shards with different per-tensor scales: expand them per row (exact) where row-wise exists,
            # otherwise requantize every shard to the largest scale below
            shard_scales = layer.weight_scale.data.float()
            if not torch.all(shard_scales == shard_scales.max()):
                self.rowwise = check_fp8_rowwise_scaled_mm(self.platform)[0]
        if not q.serialized:
            w, scale = quantize_weight_per_channel(layer.weight.data, dtype)  # already in the device's FP8 dtype
            scale_row = scale.reshape(1, -1)
        else:
            w = layer.weight.data
            if q.weight == "channel":
                scale_row = layer.weight_scale.data.float().reshape(1, -1)
            elif self.rowwise:  # per-tensor weights, row-wise GEMM: expand each shard's scale over its rows (exact)
                scale_row = self._per_row_tensor_scale(layer).reshape(1, -1)
            else:  # per-tensor x per-tensor: one scale for the merged weight, the max over shards (requantize)
                shard_scales = layer.weight_scale.data.float()
                smax = shard_scales.max()
                if not torch.all(shard_scales == smax):
                    ratio = (self._per_row_tensor_scale(layer) / smax)[:, None]
                    w = (w.float() * ratio).to(_CHECKPOINT_FP8)  # values only shrink: no clamping needed
                scale_row = smax.reshape(1, 1)
            if dtype == torch.float8_e4m3fnuz:
                w, scale_row = e4m3fn_to_e4m3fnuz(w, scale_row)
        input_scale = None
        if q.has_input_scale:
            input_scale = layer.input_scale.data.float().max().reshape(())
            if dtype == torch.float8_e4m3fnuz and q.serialized:
                input_scale = input_scale * 2.0  # calibrated for e4m3fn's range (448); FNUZ tops out at 240
        self.fp8 = dtype
        self._replace(layer, "weight", w.contiguous())
        # rowwise: [1, N] contiguous; per-tensor: a 0-d scalar
        self._replace(layer, "weight_scale", scale_row.contiguous() if self.rowwise else scale_row.reshape(()))
        self._replace(layer, "input_scale", input_scale)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        q: Fp8Scheme = self.spec.quant
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if q.has_input_scale:
            xq, sa = quantize_per_tensor_static(x2, layer.input_scale, self.fp8), layer.input_scale
        elif q.activation == "token":
            xq, sa = quantize_per_token(x2, self.fp8)
        else:
            xq, sa = quantize_per_tensor_dynamic(x2, self.fp8)
        if self.rowwise:
            if sa.numel() == 1:
                sa = sa.reshape(1, 1).expand(x2.shape[0], 1).contiguous()
            y = scaled_mm(xq, layer.weight.t(), sa, layer.weight_scale, torch.bfloat16)
        else:
            out_dtype = x.dtype if x.dtype in _FLOAT_DTYPES else torch.bfloat16
            y = scaled_mm(xq, layer.weight.t(), sa.reshape(()), layer.weight_scale, out_dtype)
        y = self._add_bias(layer, y.to(x.dtype))
        return y.reshape(*shape[:-1], y.shape[-1])


# ================================================================================================ Triton block
class TritonFp8BlockLinear(Fp8LinearBase):
    """Triton block-scaled FP8 GEMM (DeepSeek layout): weights with one scale per (bn x bk) block, activations
    quantized per token and per group of bk columns. The Triton code is imported on first use."""

    name = "triton_fp8_block"

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        ok, why = cls._check_common(spec)
        if not ok:
            return ok, why
        q: Fp8Scheme = spec.quant
        if q.weight != "block":
            return False, f"needs block-wise weight scales (layer has {q.weight} scales)"
        if q.activation != "group" or not q.activation_dynamic:
            return False, "needs dynamic per-token-group activation quantization"
        bn, bk = q.block_size
        if q.group_size != bk:
            return False, f"activation group {q.group_size} != weight block K {bk}"
        if bk < 16 or bk & (bk - 1):
            return False, f"weight block K {bk} must be a power of two >= 16"
        if bn < 1:
            return False, f"invalid weight block N {bn}"
        return True, ""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q: Fp8Scheme = self.spec.quant
        dtype = fp8_dtype(self.platform)
        w = layer.weight.data
        grid = getattr(layer, q.weight_scale_name).data.float()
        if self._blocks_aligned():
            self.group_n = q.block_size[0]
        else:  # shards that end mid-block: one scale row per output row
            grid = grid[self._row_block_index(grid.device)]
            self.group_n = 1
        if dtype == torch.float8_e4m3fnuz:
            w, grid = e4m3fn_to_e4m3fnuz(w, grid)
        self.fp8 = dtype
        self._replace(layer, "weight", w.contiguous())
        self._replace(layer, q.weight_scale_name, grid.contiguous())

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from kestrel.kernels.triton_ops import fp8_block as ops

        q: Fp8Scheme = self.spec.quant
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, xs = ops.per_token_group_quant_fp8(x2, q.block_size[1], self.fp8)
        out_dtype = x.dtype if x.dtype in _FLOAT_DTYPES else torch.bfloat16
        y = ops.fp8_block_gemm(xq, xs, layer.weight, getattr(layer, q.weight_scale_name), self.group_n, q.block_size[1], out_dtype)
        y = self._add_bias(layer, y.to(x.dtype))
        return y.reshape(*shape[:-1], y.shape[-1])


FP8_LINEAR_KERNELS = (TorchScaledMMLinear, TritonFp8BlockLinear, Fp8DequantFallbackLinear)
__all__ = [
    "FP8_DTYPES",
    "FP8_LINEAR_KERNELS",
    "Fp8DequantFallbackLinear",
    "Fp8LinearBase",
    "TorchScaledMMLinear",
    "TritonFp8BlockLinear",
    "scaled_mm",
]
