"""The token bitmask: int32 [rows, ceil(vocab / 32)], bit j of word w set = token 32 * w + j allowed
(xgrammar's layout). Filled on the host by the manager for the constrained rows of a step only, applied to the
logits on the device here (one Triton launch on CUDA)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from kestrel.core.device import to_device

_BITS: dict[torch.device, torch.Tensor] = {}


class StepBitmask(NamedTuple):
    """The masks of a step's constrained sampling rows: mask[i] constrains logits row rows[i]; the other rows
    are free. `mask` lives on the host (pinned on CUDA) and must stay untouched until the step has sampled."""
    mask: torch.Tensor  # int32 [len(rows), width]
    rows: list[int]


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def _bits(device: torch.device) -> torch.Tensor:
    if device not in _BITS:
        _BITS[device] = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(torch.int32).to(device)
    return _BITS[device]


def _use_triton(logits: torch.Tensor) -> bool:
    if logits.device.type != "cuda":
        return False
    from kestrel.platform.triton_gates import triton_importable

    return triton_importable()[0]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
    """Set the logits of refused tokens to -inf, in place. bitmask[i] constrains logits row rows[i] (rows None:
    row i, one bitmask row per logits row); the bitmask goes to the device without a host sync. Tokens beyond
    the bitmask's width (the model's vocabulary padding beyond the tokenizer's) are refused in every constrained
    row."""
    if rows is None:
        if bitmask.shape[0] != logits.shape[0]:
            raise ValueError(f"bitmask {tuple(bitmask.shape)} does not match logits {tuple(logits.shape)}")
        rows = list(range(bitmask.shape[0]))
    elif len(rows) != bitmask.shape[0]:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} for {len(rows)} rows")
    if not rows:
        return logits
    mask = bitmask.to(logits.device, non_blocking=True)
    if _use_triton(logits) and logits.stride(1) == 1:
        from kestrel.kernels.triton_ops.token_bitmask import apply_token_bitmask_triton

        apply_token_bitmask_triton(logits, mask, to_device(rows, torch.int32, logits.device))
        return logits
    index = to_device(rows, torch.int64, logits.device)
    vocab = logits.shape[1]
    cover = min(vocab, mask.shape[1] * 32)
    allowed = (mask.unsqueeze(-1) & _bits(logits.device)).ne(0).view(len(rows), -1)[:, :cover]
    sub = logits.index_select(0, index)
    sub[:, :cover].masked_fill_(~allowed, float("-inf"))
    sub[:, cover:] = float("-inf")
    logits.index_copy_(0, index, sub)
    return logits


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids one bitmask row allows (tests and debugging)."""
    bits = (bitmask_row.unsqueeze(-1) & _bits(bitmask_row.device)).ne(0).view(-1)[:vocab_size]
    return bits.nonzero().flatten().tolist()
