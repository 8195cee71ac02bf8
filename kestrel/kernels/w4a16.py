"""W4A16 linear kernels (GPTQ, AWQ, compressed-tensors pack-quantized): 4-bit weights, 16-bit activations.

Both kernels load the checkpoint's own tensors (`W4A16Base.create_weights`, per format: kestrel/kernels/
w4a16_scheme.py), turn them into the common layout after loading (`Int4Weights`), and then:

* `w4a16_dequant` (everywhere): dequantises once to the model's dtype (bit-equal to the format's own
  dequantisation), then a plain matmul.
* `triton_w4a16` (CUDA): keeps 4 bits a weight in one repacked layout shared by the three formats: int32 [K/8, N]
  packed along K (unsigned nibbles, the lowest first), scales and zeros [K/G, N]; act-order (GPTQ desc_act)
  becomes a permutation of the input columns made at load time (columns sorted by group, so groups are
  contiguous; the activations are gathered in that order). The GEMM unpacks the nibbles in the kernel
  (kestrel/kernels/triton_ops/w4a16_gemm.py). A layer whose act-order groups are not contiguous after sorting
  (unequal group sizes) or whose merged shards carry different g_idx is served dequantised, with a log line.

Merged layers (q/k/v, gate/up) load shard by shard along N: rows of `weight_packed` / `weight_scale`
(compressed-tensors), columns of `qweight` / `qzeros` / `scales` (GPTQ, AWQ; packed-along-N tensors by N/8)."""
from __future__ import annotations

import logging
from typing import ClassVar

import torch
from torch import nn

from kestrel.kernels.base import DequantFallback, DequantisedLinear, LinearKernel, LinearSpec
from kestrel.kernels.base import frozen_param as _param
from kestrel.kernels.w4a16_scheme import (PACK, Int4Weights, W4A16Scheme, from_awq, from_compressed_tensors,
                                          from_gptq, pack_rows)
from kestrel.platform import Platform
from kestrel.platform.gates import act_dtype_gate, kernel_gate

logger = logging.getLogger(__name__)


class W4A16Base(DequantisedLinear, LinearKernel):
    family: ClassVar[str] = "w4a16"
    checkpoint_tensors = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx",
                          "qweight", "qzeros", "scales", "g_idx")

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        q = spec.quant
        if not isinstance(q, W4A16Scheme):
            return False, "weights are not 4-bit (GPTQ / AWQ / pack-quantized)"
        if spec.params_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return False, f"activation dtype {spec.params_dtype} is not bf16/fp16/fp32"
        k = spec.input_size
        if k % q.pack:
            return False, f"input size {k} is not a multiple of {q.pack}"
        if q.group_size != -1 and k % q.group_size:
            return False, f"input size {k} is not a multiple of the group size {q.group_size}"
        if (q.format != "compressed-tensors" or not q.symmetric) and any(n % q.pack for n in spec.output_sizes):
            return False, f"output sizes {spec.output_sizes} are not multiples of {q.pack} ({q.format} packs along N)"
        return True, ""

    # ------------------------------------------------------------------------------------------- loading
    def _shard(self, shard_id: int | None, divisor: int = 1) -> tuple[int, int]:
        sizes = self.spec.output_sizes
        if shard_id is None:
            return 0, sum(sizes) // divisor
        if not 0 <= shard_id < len(sizes):
            raise ValueError(f"{self.spec.layer_name}: shard_id {shard_id} out of range for {len(sizes)} shard(s)")
        return sum(sizes[:shard_id]) // divisor, sizes[shard_id] // divisor

    def _loader(self, name: str, dim: int, divisor: int = 1, is_scale: bool = False):
        def load(param, loaded, shard_id):
            start, length = self._shard(shard_id, divisor)
            target = param.data.narrow(dim, start, length)
            if tuple(target.shape) != tuple(loaded.shape):
                raise ValueError(f"{self.spec.layer_name}.{name}[shard {shard_id}]: checkpoint shape "
                                 f"{tuple(loaded.shape)} != expected {tuple(target.shape)}")
            if is_scale:
                if self.scale_dtype not in (None, loaded.dtype):
                    raise ValueError(f"{self.spec.layer_name}: scales in both {self.scale_dtype} and {loaded.dtype}")
                self.scale_dtype = loaded.dtype
            elif loaded.dtype != torch.int32:
                raise ValueError(f"{self.spec.layer_name}.{name}: expected int32, got {loaded.dtype}")
            target.copy_(loaded)
        return load

    def _load_shape(self, param, loaded, shard_id):
        start, rows = self._shard(shard_id)
        want = [rows, self.spec.input_size]
        if loaded.tolist() != want:
            raise ValueError(f"{self.spec.layer_name}.weight_shape[shard {shard_id}]: {loaded.tolist()} != {want}")

    def _load_g_idx(self, param, loaded, shard_id):
        if loaded.shape != (self.spec.input_size,):
            raise ValueError(f"{self.spec.layer_name}.g_idx: shape {tuple(loaded.shape)} != ({self.spec.input_size},)")
        param.data[0 if shard_id is None else shard_id].copy_(loaded)

    def create_weights(self, layer: nn.Module) -> None:
        s, q = self.spec, self.spec.quant
        n, k, groups = s.output_size, s.input_size, q.groups(s.input_size)
        self.scale_dtype = None
        i32 = dict(dtype=torch.int32)
        if q.format == "compressed-tensors":
            layer.weight_packed = _param(torch.zeros(n, k // PACK, **i32), weight_loader=self._loader("weight_packed", 0))
            layer.weight_scale = _param(torch.zeros(n, groups), weight_loader=self._loader("weight_scale", 0, is_scale=True))
            layer.weight_shape = _param(torch.zeros(2, dtype=torch.int64), weight_loader=self._load_shape)
            if not q.symmetric:
                layer.weight_zero_point = _param(torch.zeros(n // PACK, groups, **i32),
                                                 weight_loader=self._loader("weight_zero_point", 0, PACK))
            if q.act_order:  # actorder "group": each column's group (per merged shard)
                gidx = (torch.arange(k) // q.group(k)).to(torch.int32).expand(len(s.output_sizes), k).clone()
                layer.weight_g_idx = _param(gidx, weight_loader=self._load_g_idx)
        elif q.format in ("gptq", "gptq_v2"):
            pf = q.pack
            layer.qweight = _param(torch.zeros(k // pf, n, **i32), weight_loader=self._loader("qweight", 1))
            layer.qzeros = _param(torch.zeros(groups, n // pf, **i32), weight_loader=self._loader("qzeros", 1, pf))
            layer.scales = _param(torch.zeros(groups, n), weight_loader=self._loader("scales", 1, is_scale=True))
            gidx = (torch.arange(k) // q.group(k)).to(torch.int32).expand(len(s.output_sizes), k).clone()
            layer.g_idx = _param(gidx, weight_loader=self._load_g_idx)
        else:  # awq
            layer.qweight = _param(torch.zeros(k, n // PACK, **i32), weight_loader=self._loader("qweight", 1, PACK))
            layer.qzeros = _param(torch.zeros(groups, n // PACK, **i32), weight_loader=self._loader("qzeros", 1, PACK))
            layer.scales = _param(torch.zeros(groups, n), weight_loader=self._loader("scales", 1, is_scale=True))
        layer.bias = _param(torch.zeros(n, dtype=s.params_dtype), shard_dim=0) if s.bias else None

    # ------------------------------------------------------------------------------------------- common layout
    def int4_weights(self, layer: nn.Module) -> list[tuple[int, int, Int4Weights]]:
        """The loaded tensors in the common layout, as (row start, rows, weights) parts: one part, or one per
        shard where merged shards carry different act-order g_idx."""
        q, k = self.spec.quant, self.spec.input_size
        # the checkpoint's scale dtype; without a checkpoint (dummy weights) the formats' usual one
        sdtype = self.scale_dtype or (self.spec.params_dtype if q.format == "compressed-tensors" else torch.float16)
        if q.format == "compressed-tensors":
            zp = None if q.symmetric else layer.weight_zero_point.data
            g_idx = layer.weight_g_idx.data if q.act_order else None
            same = g_idx is None or all(torch.equal(g_idx[0], g) for g in g_idx[1:])
            parts = []
            for i, (start, size) in enumerate([(0, self.spec.output_size)] if same else
                                              [self._shard(j) for j in range(len(self.spec.output_sizes))]):
                rows = slice(start, start + size)
                w = from_compressed_tensors(layer.weight_packed.data[rows], layer.weight_scale.data[rows].to(sdtype),
                                            k, q.group_size,
                                            None if zp is None else zp[start // PACK:(start + size) // PACK],
                                            None if g_idx is None else g_idx[i])
                parts.append((start, size, w))
            return parts
        if q.format == "awq":
            w = from_awq(layer.qweight.data, layer.qzeros.data, layer.scales.data.to(sdtype), q.group_size)
            return [(0, self.spec.output_size, w)]
        g_idx = layer.g_idx.data
        gs = k if q.group_size == -1 else q.group_size
        if all(torch.equal(g_idx[0], g) for g in g_idx[1:]):
            w = from_gptq(layer.qweight.data, layer.qzeros.data, layer.scales.data.to(sdtype), g_idx[0], gs,
                          q.format == "gptq_v2", q.bits)
            return [(0, self.spec.output_size, w)]
        parts = []
        for i, size in enumerate(self.spec.output_sizes):
            start = sum(self.spec.output_sizes[:i])
            cols = slice(start, start + size)
            zcols = slice(start // q.pack, (start + size) // q.pack)
            w = from_gptq(layer.qweight.data[:, cols], layer.qzeros.data[:, zcols],
                          layer.scales.data[:, cols].to(sdtype), g_idx[i], gs, q.format == "gptq_v2", q.bits)
            parts.append((start, size, w))
        return parts

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense [N, K] weight this layer computes with (from the loaded checkpoint tensors)."""
        dtype = dtype or self.spec.params_dtype
        return torch.cat([w.dequantize(dtype) for _, _, w in self.int4_weights(layer)])



class W4A16DequantLinear(DequantFallback, W4A16Base):
    """4-bit weights dequantised to the model's dtype once after loading, then a plain matmul (anywhere)."""

    name = "w4a16_dequant"


def triton_layout(w: Int4Weights) -> dict[str, torch.Tensor | None]:
    """The Triton kernel's tensors from the common layout, or None where act-order groups are not contiguous
    after sorting the input columns by group: qw int32 [K/8, N], scales / zeros [K/G, N], perm int32 [K] or None
    (input column j of the kernel is the layer's column perm[j])."""
    n, k = w.u.shape
    u, perm = w.u, None
    if w.g_idx is not None:
        order = torch.argsort(w.g_idx.long(), stable=True)
        if not torch.equal(w.g_idx.long()[order], torch.arange(k, device=u.device) // w.group_size):
            return None
        u, perm = u[:, order], order.to(torch.int32)
    return {"qw": pack_rows(u).t().contiguous(),
            "scales": w.scales.t().contiguous(), "zeros": w.zeros.t().contiguous(), "perm": perm}


class TritonW4A16Linear(W4A16Base):
    """The Triton W4A16 GEMM on the repacked layout (CUDA): nibbles unpacked in the kernel, group scales and zeros,
    fp32 accumulation. Any M (decode and prefill)."""

    name = "triton_w4a16"

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
        if spec.quant.bits != 4:
            return False, f"{spec.quant.bits}-bit weights (the kernel unpacks 4-bit words)"
        g = spec.quant.group_size
        if g != -1 and g % 16:
            return False, f"group size {g} is not a multiple of 16 (the kernel's K step)"
        return True, ""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts = self.int4_weights(layer)
        layout = triton_layout(parts[0][2]) if len(parts) == 1 else None
        if layout is None:
            why = ("merged shards carry different act-order g_idx" if len(parts) > 1
                   else "act-order groups are not contiguous after sorting")
            logger.info("%s: %s; served dequantised", self.spec.layer_name, why)
            self.dense = True
            self.to_dense(layer)
            return
        self.dense = False
        for name in self.checkpoint_tensors:
            layer._parameters.pop(name, None)
        self.group_size = parts[0][2].group_size
        layer.w4_qweight = _param(layout["qw"])
        layer.w4_scales = _param(layout["scales"])
        layer.w4_zeros = _param(layout["zeros"])
        layer.w4_perm = None if layout["perm"] is None else _param(layout["perm"])

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.dense:
            return self.dense_apply(layer, x)
        from kestrel.kernels.triton_ops.w4a16_gemm import w4a16_gemm

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if layer.w4_perm is not None:
            x2 = x2.index_select(1, layer.w4_perm)
        y = w4a16_gemm(x2, layer.w4_qweight, layer.w4_scales, layer.w4_zeros, self.group_size, layer.bias)
        return y.reshape(*shape[:-1], y.shape[-1])


W4A16_LINEAR_KERNELS = (TritonW4A16Linear, W4A16DequantLinear)
__all__ = ["TritonW4A16Linear", "W4A16Base", "W4A16DequantLinear", "triton_layout"]
