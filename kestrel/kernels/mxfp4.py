"""MXFP4 expert weights (the OCP microscaling format the released gpt-oss checkpoints use): each run of 32 weights
along the input dim shares one ue8m0 scale (a byte s: 2^(s - 127)), each weight an e2m1 code (4 bits: sign, 2
exponent bits, 1 mantissa bit), two codes a byte with the lower-indexed weight in the low nibble.

Checkpoint tensors of a projection [out, in] (all experts stacked): `*_blocks` [E, out, in / 32, 16] uint8 and
`*_scales` [E, out, in / 32] uint8. The first MoE kernels for them dequantise once after loading (exactly: every
e2m1 value times a power of two is a bf16 and a float32), then run the reference loop (anywhere) or the Triton
fused MoE (CUDA); a fused W4A16 kernel that reads the blocks is the next step."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from kestrel.kernels.moe import MOE_ACTIVATIONS, MoESpec, TorchMoE, TritonFusedMoE, _bias_weights
from kestrel.platform import Platform
from kestrel.platform.gates import kernel_gate

BLOCK = 32  # weights per scale
# the 16 e2m1 codes' values: code & 7 indexes the magnitude, code & 8 is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


@dataclass(frozen=True)
class Mxfp4Scheme:
    """MXFP4 weights with ue8m0 scales per 32 inputs; activations stay in the model's dtype."""

    block_size: int = BLOCK
    family: ClassVar[str] = "mxfp4"

    @property
    def name(self) -> str:
        return f"mxfp4[block={self.block_size}]"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected [..., G, {BLOCK // 2}] and [..., G])")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)[codes]
    exponents = scales.to(torch.int32).unsqueeze(-1) - SCALE_BIAS
    return torch.ldexp(values, exponents).flatten(-2).to(dtype)


class Mxfp4DequantMoE(TorchMoE):
    """MXFP4 experts anywhere: loaded in the checkpoint's layout, dequantised once to the model's dtype after
    loading, then the reference loop."""

    name = "mxfp4_dequant_moe"
    family = "mxfp4"
    checkpoint_params: ClassVar[dict[str, str]] = {"blocks": "_blocks", "scales": "_scales", "bias": "_bias"}

    @classmethod
    def can_implement(cls, spec: MoESpec) -> tuple[bool, str]:
        if not isinstance(spec.quant, Mxfp4Scheme):
            return False, "expert weights are not MXFP4"
        if spec.params_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return False, f"dtype {spec.params_dtype} is not a float type"
        if spec.activation not in MOE_ACTIVATIONS:
            return False, f"activation {spec.activation!r} is not one of {', '.join(MOE_ACTIVATIONS)}"
        for what, size in (("hidden", spec.hidden_size), ("intermediate", spec.intermediate_size)):
            if size % BLOCK:
                return False, f"{what} size {size} is not a multiple of the MXFP4 block {BLOCK}"
        return True, ""

    def create_weights(self, layer: nn.Module) -> None:
        s = self.spec
        e, h, i = s.total_experts, s.hidden_size, s.intermediate_size
        for name, shape in (("w13", (e, 2 * i, h)), ("w2", (e, h, i))):
            groups = shape[2] // BLOCK
            setattr(layer, f"{name}_blocks", nn.Parameter(torch.zeros(*shape[:2], groups, BLOCK // 2,
                                                                      dtype=torch.uint8), requires_grad=False))
            setattr(layer, f"{name}_scales", nn.Parameter(torch.zeros(*shape[:2], groups, dtype=torch.uint8),
                                                          requires_grad=False))
        _bias_weights(layer, s)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for name in ("w13", "w2"):
            blocks, scales = getattr(layer, f"{name}_blocks"), getattr(layer, f"{name}_scales")
            # expert by expert: the integer codes of a whole layer would take 8 bytes a weight
            w = torch.stack([dequantize_mxfp4(blocks[j], scales[j], self.spec.params_dtype)
                             for j in range(blocks.shape[0])])
            setattr(layer, name, nn.Parameter(w, requires_grad=False))
            delattr(layer, f"{name}_blocks")
            delattr(layer, f"{name}_scales")


class TritonMxfp4DequantMoE(Mxfp4DequantMoE):
    """MXFP4 experts on CUDA: dequantised once after loading (bf16/fp16 weights in memory), then the Triton fused
    MoE, which serves the dequantised experts as it serves dense ones."""

    name = "triton_mxfp4_dequant_moe"

    @classmethod
    def is_supported(cls, platform: Platform) -> tuple[bool, str]:
        return kernel_gate(cls.name, platform)

    @classmethod
    def can_implement(cls, spec: MoESpec) -> tuple[bool, str]:
        ok, why = super().can_implement(spec)
        return TritonFusedMoE.can_implement(replace(spec, quant=None)) if ok else (ok, why)

    def __init__(self, spec: MoESpec, platform: Platform | None = None):
        super().__init__(spec, platform)
        self.dense = TritonFusedMoE(replace(spec, quant=None), self.platform)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        self.dense.process_weights_after_loading(layer)

    def apply(self, layer, x, topk_weights, topk_ids):
        return self.dense.apply(layer, x, topk_weights, topk_ids)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (blocks [..., K / 32, 16], scales [..., K / 32]), both uint8: each run of
    32 scaled by the smallest power of two that brings its largest magnitude to <= 6, each value rounded to the
    nearest e2m1 (checkpoints in the real format from float weights: tests, random-weight benchmarks)."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"the last dim ({w.shape[-1]}) is not a multiple of {BLOCK}")
    g = w.float().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = g.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -SCALE_BIAS))
    exp = exp.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = g / torch.exp2(exp).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=w.device)
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
    codes = (codes | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + SCALE_BIAS).to(torch.uint8)
