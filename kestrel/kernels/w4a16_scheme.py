"""4-bit weight-only (W4A16) linear layers from three checkpoint formats, and the one layout every W4A16 linear
kernel computes from.

Checkpoint layouts (N output rows, K input columns, G the group size along K; "packed along K" means int32 word
i holds columns 8i..8i+7, the first in the lowest 4 bits):

* compressed-tensors `pack-quantized`: `weight_packed` int32 [N, K/8] packed along K, values q + 8 (q in -8..7);
  `weight_scale` [N, K/G] (strategy group) or [N, 1] (strategy channel); `weight_shape` [2]. w = q * scale;
  asymmetric: `weight_zero_point` int32 [N/8, K/G], zero + 8 packed along N, and w = (q - zero) * scale;
  actorder "group": `weight_g_idx` int32 [K], as GPTQ's g_idx.
* GPTQ (AutoGPTQ / GPTQModel / optimum, `checkpoint_format` gptq, i.e. v1; 4-bit, or 8-bit with four values a
  word, read the same way and served dequantised): `qweight` int32 [K/8, N] packed along
  K; `qzeros` int32 [K/G, N/8] packed along N (word c holds columns 8c..8c+7, the first lowest), each holding
  zero - 1 (v1's offset; `gptq_v2` stores the zero itself); `scales` fp16 [K/G, N]; `g_idx` int32 [K], the group
  of every input column (k // G without act-order; a permutation's groups with desc_act). w = (u - zero) * scale.
* AWQ GEMM (AutoAWQ `version: gemm`): `qweight` int32 [K, N/8] and `qzeros` int32 [K/G, N/8], both packed along N
  in AWQ's interleaved order: nibble i of word c holds column 8c + AWQ_ORDER[i]; `scales` fp16 [K/G, N].
  w = (u - zero) * scale.

The common layout (`Int4Weights`, made at load time from any of them): u uint8 [N, K] (0..15), zeros uint8
[N, K/G], scales [N, K/G] (the checkpoint's dtype), g_idx [K] (None: column k is in group k // G). The dequantised
weight is (u - zero) * scale, multiplied in the scale's dtype as the formats' own libraries do (the exact product
rounded once to that dtype), then cast to the model's dtype. The Triton kernel's layout is made from it
(kestrel/kernels/w4a16.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

PACK = 8  # 4-bit values per int32 word
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
FORMATS = ("compressed-tensors", "gptq", "gptq_v2", "awq")


@dataclass(frozen=True)
class W4A16Scheme:
    """A linear layer's 4-bit weights: checkpoint format, group size (-1: one group per output row = channel),
    act-order (GPTQ desc_act: a g_idx), zero points stored or symmetric."""

    format: str
    group_size: int = 128
    act_order: bool = False
    symmetric: bool = True
    bits: int = 4  # 8: GPTQ's 8-bit weights (four a word), served dequantised

    @property
    def pack(self) -> int:
        """Values per int32 word."""
        return 32 // self.bits

    family: ClassVar[str] = "w4a16"

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"unknown W4A16 format {self.format!r}")
        if self.bits not in (4, 8) or (self.bits == 8 and not self.format.startswith("gptq")):
            raise ValueError(f"{self.format}: {self.bits}-bit weights are not a layout read here")
        if self.group_size != -1 and (self.group_size <= 0 or self.group_size % PACK):
            raise ValueError(f"W4A16 group size must be -1 (channel) or a positive multiple of 8, not {self.group_size}")

    def groups(self, k: int) -> int:
        return 1 if self.group_size == -1 else -(-k // self.group_size)

    def group(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size

    @property
    def name(self) -> str:
        g = "channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"w{self.bits}a16[{self.format},{g}{',act_order' if self.act_order else ''}]"


# ------------------------------------------------------------------------------------------------ bit unpacking
def _shifts(device, bits: int = 4) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


CHUNK_ROWS = 1024  # rows converted at a time: the int32 / int64 transients of a large layer stay small


def _by_rows(fn, t: torch.Tensor) -> torch.Tensor:
    if t.dim() != 2 or t.shape[0] <= CHUNK_ROWS:
        return fn(t)
    return torch.cat([fn(part) for part in t.split(CHUNK_ROWS)])


def unpack_rows(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [..., C] -> uint8 [..., (32 / bits) C]: each word's values along the last dim, the lowest first."""
    def unpack(p):
        return ((p.unsqueeze(-1) >> _shifts(p.device, bits)) & ((1 << bits) - 1)).flatten(-2).to(torch.uint8)
    return _by_rows(unpack, packed)


def pack_rows(u: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """uint8/int [..., (32 / bits) C] -> int32 [..., C] (the inverse of unpack_rows)."""
    def pack(x):
        shifts = _shifts(x.device, bits).to(torch.int64)
        word = (x.to(torch.int64).unflatten(-1, (-1, 32 // bits)) << shifts).sum(-1)
        return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    return _by_rows(pack, u)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """An AWQ int32 [R, N/8] -> uint8 [R, N] in column order (undoing AWQ_ORDER)."""
    nib = unpack_rows(packed).unflatten(-1, (-1, PACK))  # [R, N/8, 8]: nibble i
    out = torch.empty_like(nib)
    out[..., list(AWQ_ORDER)] = nib  # column AWQ_ORDER[i] <- nibble i
    return out.flatten(-2)


@dataclass
class Int4Weights:
    """The common layout: u uint8 [N, K], zeros uint8 [N, ngroups], scales [N, ngroups], g_idx int [K] or None."""

    u: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None
    group_size: int  # the group size along K (K for channel)

    def column_groups(self) -> torch.Tensor:
        k = self.u.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(k, device=self.u.device) // self.group_size

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        g = self.column_groups()
        out = torch.empty(self.u.shape, dtype=dtype, device=self.u.device)
        for r in range(0, self.u.shape[0], CHUNK_ROWS):  # rows at a time: small transients
            rows = slice(r, r + CHUNK_ROWS)
            z = self.zeros[rows].to(torch.int16)[:, g]
            s = self.scales[rows][:, g].float()
            w = (self.u[rows].to(torch.int16) - z).to(torch.float32) * s  # exact: |u - z| < 16, s 16-bit
            out[rows] = w.to(self.scales.dtype).to(dtype)
        return out


def from_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor, k: int,
                            group_size: int, zero_point: torch.Tensor | None = None,
                            g_idx: torch.Tensor | None = None) -> Int4Weights:
    """`zero_point` (asymmetric): int32 [N/8, groups], zero + 8 packed along N (compressed-tensors' packed_dim 0).
    `g_idx` (actorder "group"): int [K], each column's group."""
    u = unpack_rows(weight_packed)[:, :k]
    if zero_point is None:
        zeros = torch.full(weight_scale.shape, 8, dtype=torch.uint8, device=u.device)
    else:
        zeros = unpack_rows(zero_point.t().contiguous()).t()[:weight_scale.shape[0]].contiguous()
    gs = k if group_size == -1 else group_size
    if g_idx is not None and torch.equal(g_idx.long(), torch.arange(k, device=g_idx.device) // gs):
        g_idx = None  # the trivial order
    return Int4Weights(u, zeros, weight_scale, g_idx, gs)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              group_size: int, v2: bool = False, bits: int = 4) -> Int4Weights:
    k = qweight.shape[0] * (32 // bits)
    u = unpack_rows(qweight.t(), bits).contiguous()  # [N, K]
    z = unpack_rows(qzeros, bits)[:, :scales.shape[1]].t()  # [N, groups]
    if not v2:
        z = ((z.to(torch.int16) + 1) & ((1 << bits) - 1)).to(torch.uint8)  # v1 stores zero - 1 (in `bits` bits)
    gs = k if group_size == -1 else group_size
    if g_idx is not None and torch.equal(g_idx.long(), torch.arange(k, device=g_idx.device) // gs):
        g_idx = None  # the trivial order
    return Int4Weights(u, z.contiguous(), scales.t().contiguous(), g_idx, gs)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Weights:
    k = qweight.shape[0]
    u = awq_unpack(qweight).t().contiguous()
    z = awq_unpack(qzeros).t().contiguous()
    return Int4Weights(u, z, scales.t().contiguous(), None, k if group_size == -1 else group_size)
