"""FP8 quantization helpers in plain torch: activations (per-tensor, per-token, per-token-group) and weights.

Convention (the same as HF/DeepSeek `weight_scale_inv` and compressed-tensors `weight_scale`): a scale multiplies,
`x ~= q.float() * scale`, and `q = clamp(x / scale, -max, max)` rounded to the FP8 dtype. Dynamic scales are
`max(amax, eps) / fp8_max`. All arithmetic is float32.
"""
from __future__ import annotations

import math

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
_EPS = 1e-10


def fp8_max(dtype: torch.dtype = torch.float8_e4m3fn) -> float:
    return float(torch.finfo(dtype).max)


def _cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m = fp8_max(dtype)
    return (x.float() / scale).clamp_(-m, m).to(dtype)


# ------------------------------------------------------------------------------------------------ activations
def quantize_per_tensor_static(x: torch.Tensor, scale: torch.Tensor, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """Static (calibrated) per-tensor scale: a 1-element fp32 tensor."""
    return _cast(x, scale.reshape(()).float(), dtype)


def quantize_per_tensor_dynamic(x: torch.Tensor, dtype=torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor, from its amax. Returns (q, scale with shape [1])."""
    amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    scale = (amax.clamp(min=_EPS) / fp8_max(dtype)).reshape(1)
    return _cast(x, scale, dtype), scale


def quantize_per_token(x: torch.Tensor, dtype=torch.float8_e4m3fn,
                       power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row of a [..., K] tensor. Returns (q [..., K], scale [..., 1] contiguous fp32).
    power_of_two: each scale rounded up to a power of two (DeepSeek's ue8m0 scale format)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = amax.clamp(min=_EPS) / fp8_max(dtype)
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = scale.contiguous()
    return _cast(x, scale, dtype), scale


def quantize_per_token_group(
    x: torch.Tensor, group_size: int = 128, dtype=torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per (row, group of `group_size` columns); the last group may be partial.

    Returns (q [M, K], scale [M, ceil(K / group_size)] row-major fp32).
    """
    m, k = x.shape
    groups = math.ceil(k / group_size) if k else 0
    pad = groups * group_size - k
    xf = x.float()
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    xg = xf.view(m, groups, group_size)
    scale = xg.abs().amax(dim=-1).clamp(min=_EPS) / fp8_max(dtype)
    q = (xg / scale.unsqueeze(-1)).clamp_(-fp8_max(dtype), fp8_max(dtype)).to(dtype)
    q = q.view(m, groups * group_size)[:, :k].contiguous()
    return q, scale.contiguous()


def dequantize_per_token_group(q: torch.Tensor, scale: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    k = q.shape[-1]
    return q.float() * scale.repeat_interleave(group_size, dim=-1)[..., :k]


# ------------------------------------------------------------------------------------------------ weights
def quantize_weight_per_tensor(w: torch.Tensor, dtype=torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_per_tensor_dynamic(w, dtype)


def quantize_weight_per_channel(w: torch.Tensor, dtype=torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per output row (amax / fp8_max). Returns (q [N, K], scale [N, 1])."""
    return quantize_per_token(w, dtype)


def block_grid(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(n / block[0]), math.ceil(k / block[1])


def expand_block_scale(scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """[ceil(n/bn), ceil(k/bk)] block scales -> one scale per weight element [n, k]."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def quantize_weight_block(
    w: torch.Tensor, block: tuple[int, int] = (128, 128), dtype=torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise weight quantization (DeepSeek/HF style). Returns (q [N, K], scale_inv [ceil(N/bn), ceil(K/bk)])."""
    n, k = w.shape
    bn, bk = block
    gn, gk = block_grid(n, k, block)
    wf = torch.nn.functional.pad(w.float(), (0, gk * bk - k, 0, gn * bn - n))
    blocks = wf.view(gn, bn, gk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=_EPS) / fp8_max(dtype)
    q = (blocks / scale[:, None, :, None]).clamp_(-fp8_max(dtype), fp8_max(dtype)).to(dtype)
    return q.view(gn * bn, gk * bk)[:n, :k].contiguous(), scale.contiguous()


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    return q.float() * expand_block_scale(scale.float(), n, k, block)


# ------------------------------------------------------------------------------------------------ ROCm FNUZ
def e4m3fn_to_e4m3fnuz(
    q: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reinterpret OCP e4m3fn data as e4m3fnuz (gfx94x). The same bits mean half the value in FNUZ (exponent bias 8
    instead of 7), so the scale doubles; the bit pattern 0x80 (-0 in e4m3fn, NaN in FNUZ) becomes 0."""
    bits = q.view(torch.int8).clone()
    bits[bits == -128] = 0
    out = bits.view(torch.float8_e4m3fnuz)
    return out, (None if scale is None else scale * 2.0)
