"""Structured outputs: a grammar's token bitmask applied to the logits in one launch.

mask[i] (int32 words, bit j of word w = token 32 * w + j allowed) constrains logits row rows[i]: every token it
does not allow becomes -inf, and so does every token beyond the mask's width (the model's vocabulary padding,
which no grammar allows). Only -inf is written (the logits are never read), and only where a token is refused."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # tokens per program


@triton.jit
def _apply_token_bitmask_kernel(LOGITS, MASK, ROWS, vocab, width, stride_logits, stride_mask,
                                BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(ROWS + i).to(tl.int64)
    word = cols // 32
    words = tl.load(MASK + i.to(tl.int64) * stride_mask + word, mask=(cols < vocab) & (word < width), other=0)
    refused = ((words >> (cols % 32)) & 1) == 0
    neg_inf = tl.full([BLOCK], float("-inf"), LOGITS.dtype.element_ty)
    tl.store(LOGITS + row * stride_logits + cols, neg_inf, mask=(cols < vocab) & refused)


def apply_token_bitmask_triton(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place; `mask` int32 [k, width] and `rows` int32 [k] on the logits' device."""
    k = mask.shape[0]
    if k == 0:
        return
    vocab = logits.shape[1]
    _apply_token_bitmask_kernel[(k, triton.cdiv(vocab, BLOCK))](
        logits, mask, rows, vocab, mask.shape[1], logits.stride(0), mask.stride(0), BLOCK=BLOCK)
