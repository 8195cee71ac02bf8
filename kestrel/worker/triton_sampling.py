"""One-pass sampling on the GPU for the common case (temperature only, no top-k/top-p/min-p, no penalties).

Gumbel-max: argmax_j(logit_j / T + G_j) with G_j = -log(-log(U_j)) draws j with probability softmax(logit / T)_j,
the same distribution as the exponential race of the PyTorch sampler. A greedy row takes argmax_j(logit_j).
The noise is Philox (tl.rand) keyed by a per-row seed and the token id, so a seeded request's draw depends only
on its own seed and position, never on the batch. The kernel works in base 2 (scaling every score by log2(e) and
dropping a constant keeps the argmax): log2(-log2(U)) instead of two natural logs, which map to the fast
hardware lg2. The torch path reads the logits about eight times (float
copy, scale, softmax, noise, divide, argmax); this reads them once, in their own dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_argmax_kernel(
    LOGITS, INV_TEMP, SEEDS, PART_VAL, PART_IDX,
    vocab, stride_l, chunk,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    inv_t = tl.load(INV_TEMP + row)  # 0 marks a greedy row
    seed = tl.load(SEEDS + row)
    start = part * chunk
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    base = LOGITS + row.to(tl.int64) * stride_l
    for off in range(0, chunk, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if inv_t > 0:
            # argmax(x / T - ln(-ln U)) == argmax(x * log2(e) / T - log2(-log2 U)): both sides times log2(e),
            # minus the constant log2(ln 2)
            u = tl.rand(seed, cols)
            x = x * (inv_t * 1.4426950408889634) - tl.log2(-tl.log2(tl.maximum(u, 1e-20)))
        better = x > best_val
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, cols, best_idx)
    m = tl.max(best_val, axis=0)
    # lowest index among the maxima (ties are broken like torch.argmax)
    idx = tl.min(tl.where(best_val == m, best_idx, 2147483647), axis=0)
    tl.store(PART_VAL + row * tl.num_programs(1) + part, m)
    tl.store(PART_IDX + row * tl.num_programs(1) + part, idx)


def gumbel_sample(logits: torch.Tensor, inv_temp: torch.Tensor, seeds: torch.Tensor,
                  num_sms: int = 132) -> torch.Tensor:
    """logits [N, V] (any float dtype, last dim contiguous), inv_temp [N] float32 (0 = greedy), seeds [N] int64
    -> sampled token ids [N] int64, on the device, without a host sync."""
    n, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block = 1024
    # about eight programs an SM, each a whole number of tiles: the noise (Philox and two logs an element) makes
    # this compute-heavy, and at 256 rows two programs a row left the chip half idle (132 us for 256 x 102k)
    parts = max(1, min(triton.cdiv(vocab, block), triton.cdiv(8 * num_sms, max(n, 1))))
    chunk = triton.cdiv(triton.cdiv(vocab, parts), block) * block
    parts = triton.cdiv(vocab, chunk)
    val = torch.empty((n, parts), dtype=torch.float32, device=logits.device)
    idx = torch.empty((n, parts), dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(n, parts)](logits, inv_temp, seeds, val, idx, vocab, logits.stride(0), chunk,
                                      BLOCK=block, num_warps=4)
    if parts == 1:
        return idx[:, 0].to(torch.int64)
    return idx.gather(1, val.argmax(dim=1, keepdim=True))[:, 0].to(torch.int64)
