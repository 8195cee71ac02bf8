"""Group-wise symmetric INT4 weights as compressed-tensors packs them (`pack-quantized`): the description the
INT4 kernels consume and the unpacking they share. The quant config in kestrel/layers/quant/int4.py maps
checkpoints onto it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

PACK = 8  # 4-bit values per int32 word


@dataclass(frozen=True)
class Int4Scheme:
    """Symmetric group-wise INT4 weights, 16-bit activations."""

    group_size: int = 32

    family: ClassVar[str] = "int4"

    @property
    def name(self) -> str:
        return f"int4_w4a16_g{self.group_size}"


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 [..., ceil(cols / 8)] -> int8 [..., cols] in -8..7 (the word's low nibble first)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift: the mask keeps the nibble
    return (nibbles.flatten(-2)[..., :cols] - 8).to(torch.int8)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, cols: int, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The weights q * scale, multiplied in the scale's dtype (as compressed-tensors does), then cast to `dtype`."""
    q = unpack_int4(packed, cols).to(scale.dtype)
    return (q * scale.repeat_interleave(group_size, dim=-1)[..., :cols]).to(dtype)
