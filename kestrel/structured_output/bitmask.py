"""The token bitmask: int32 [rows, ceil(vocab / 32)], bit j of word w set = token 32 * w + j allowed
(xgrammar's layout). Filled on the host by the manager, applied to the logits on the device here."""
from __future__ import annotations

import torch

_BITS: dict[torch.device, torch.Tensor] = {}


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def _bits(device: torch.device) -> torch.Tensor:
    if device not in _BITS:
        _BITS[device] = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(torch.int32).to(device)
    return _BITS[device]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of disallowed tokens to -inf, in place. `bitmask` (host, ideally pinned) has one row per
    logits row; it goes to the device without a host sync. Where the model's vocabulary is padded beyond the
    tokenizer's, the bitmask may be narrower: the padding ids are then disallowed in every constrained row (a
    row that is all ones is unconstrained and keeps them)."""
    rows, vocab = logits.shape
    if bitmask.shape[0] != rows:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not match logits {tuple(logits.shape)}")
    mask = bitmask.to(logits.device, non_blocking=True)
    cover = min(vocab, mask.shape[1] * 32)
    allowed = (mask.unsqueeze(-1) & _bits(logits.device)).ne(0).view(rows, -1)[:, :cover]
    logits[:, :cover].masked_fill_(~allowed, float("-inf"))
    if cover < vocab:
        constrained = mask.ne(-1).any(dim=1, keepdim=True)
        logits[:, cover:].masked_fill_(constrained, float("-inf"))
    return logits


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids one bitmask row allows (tests and debugging)."""
    bits = (bitmask_row.unsqueeze(-1) & _bits(bitmask_row.device)).ne(0).view(-1)[:vocab_size]
    return bits.nonzero().flatten().tolist()
