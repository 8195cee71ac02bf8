"""MoE kernels for INT4 experts in compressed-tensors' pack-quantized format (Kimi K2-Thinking, K2.5, K2.6): a first
version that loads the experts in the checkpoint's layout and dequantises them once after loading (bit-equal to
compressed-tensors' own decompression, then cast to the model's dtype), then runs a 16-bit kernel: the Triton fused
MoE on CUDA, the reference loop anywhere. Checkpoint layout per expert projection (kestrel/kernels/int4_scheme.py):

  w13_packed int32 [E, 2I, H / 8], w13_scale [E, 2I, H / group]   (gate rows, then up rows)
  w2_packed  int32 [E, H, I / 8],  w2_scale  [E, H, I / group]
  weight_shape: checked against the expected shape, not kept."""
from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch
from torch import nn

from kestrel.kernels.int4_scheme import PACK, Int4Scheme, dequantize_int4
from kestrel.kernels.moe import MoESpec, TorchMoE, TritonFusedMoE
from kestrel.platform import Platform
from kestrel.platform.gates import kernel_gate


class _PackedInt4Experts:
    """What both INT4 kernels share: the gates, the checkpoint-layout parameters, the dequantisation."""

    family = "int4"
    supports_tensor_parallel = False  # a rank's slice of the packed columns and group scales: not yet
    checkpoint_params: ClassVar[dict[str, str]] = {"weight_packed": "_packed", "weight_scale": "_scale",
                                                   "weight_shape": "_shape"}

    @classmethod
    def can_implement(cls, spec: MoESpec) -> tuple[bool, str]:
        q = spec.quant
        if not isinstance(q, Int4Scheme):
            return False, "expert weights are not INT4 (pack-quantized)"
        for what, size in (("hidden", spec.hidden_size), ("intermediate", spec.intermediate_size)):
            if size % q.group_size or size % PACK:
                return False, f"{what} size {size} is not a multiple of the INT4 group {q.group_size}"
        return super().can_implement(replace(spec, quant=None))  # the 16-bit kernel it runs after dequantising

    def create_weights(self, layer: nn.Module) -> None:
        s, g = self.spec, self.spec.quant.group_size
        e, h, i = s.total_experts, s.hidden_size, s.intermediate_size
        for name, rows, cols in (("w13", 2 * i, h), ("w2", h, i)):
            setattr(layer, f"{name}_packed", nn.Parameter(torch.zeros(e, rows, cols // PACK, dtype=torch.int32),
                                                          requires_grad=False))
            # float32 holds any 16-bit scale exactly; the checkpoint's dtype is kept for the dequantisation
            setattr(layer, f"{name}_scale", nn.Parameter(torch.zeros(e, rows, cols // g), requires_grad=False))
        layer.int4_scale_dtype = None

    def load_expert(self, layer: nn.Module, param: str, slot: int, shard: int | None, loaded: torch.Tensor) -> None:
        if param.endswith("_shape"):
            rows, cols = getattr(layer, param[:-len("_shape")] + "_packed").shape[1:]
            want = [rows // 2 if shard is not None else rows, cols * PACK]
            if loaded.tolist() != want:
                raise ValueError(f"{self.spec.layer_name}.{param}[expert {slot}, shard {shard}]: weight_shape "
                                 f"{loaded.tolist()} != {want}")
            return
        if param.endswith("_scale"):
            if layer.int4_scale_dtype not in (None, loaded.dtype):
                raise ValueError(f"{self.spec.layer_name}: INT4 scales in both {layer.int4_scale_dtype} and "
                                 f"{loaded.dtype}")
            layer.int4_scale_dtype = loaded.dtype
        super().load_expert(layer, param, slot, shard, loaded)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        s, g = self.spec, self.spec.quant.group_size
        scale_dtype = layer.int4_scale_dtype or torch.float32
        for name, cols in (("w13", s.hidden_size), ("w2", s.intermediate_size)):
            packed, scale = getattr(layer, f"{name}_packed").data, getattr(layer, f"{name}_scale").data
            weight = torch.empty(*packed.shape[:2], cols, dtype=s.params_dtype, device=packed.device)
            for j in range(packed.shape[0]):  # one expert at a time: a small transient
                weight[j] = dequantize_int4(packed[j], scale[j].to(scale_dtype), cols, g, s.params_dtype)
            delattr(layer, f"{name}_packed")
            delattr(layer, f"{name}_scale")
            setattr(layer, name, nn.Parameter(weight, requires_grad=False))
        super().process_weights_after_loading(layer)


class TritonInt4DequantMoE(_PackedInt4Experts, TritonFusedMoE):
    """INT4 experts dequantised to 16 bits on load, then the Triton fused MoE (CUDA)."""

    name = "triton_int4_dequant_moe"

    @classmethod
    def is_supported(cls, platform: Platform) -> tuple[bool, str]:
        return kernel_gate(TritonFusedMoE.name, platform)  # the same Triton kernel runs the dequantised experts


class Int4DequantMoE(_PackedInt4Experts, TorchMoE):
    """INT4 experts dequantised on load, then the reference loop (anywhere; the CPU path for Kimi checkpoints)."""

    name = "int4_dequant_moe"


__all__ = ["Int4DequantMoE", "TritonInt4DequantMoE"]
