"""Top-k per row of float32 scores by radix select in Triton: the indices of each row's k largest values (as a
set, in no particular order), -1 where the value is -inf (positions a query does not see), for DSA's selection
(triton_sparse_mla.select_topk with topk_impl="radix"; torch.topk is the default until GPU timings decide).

One program per row. Each float maps to an int32 key with the same order (negative floats get their magnitude
bits flipped). Four passes of a 256-bin histogram over the row pick the k-th largest key one byte at a time, from
the top byte down, counting only the keys that share the bytes picked so far. A last pass writes the positions
whose key is above that threshold, then the first (by position) of those equal to it until k are written. So
the row is read five times and nothing is sorted; no [rows, width] index buffer exists besides the output.
Not split across programs yet: a single long row (batch 1 at 32k) runs on one program. With `last` (per-row
lengths on the device: the CUDA-graph decode path, whose score rows are as wide as the graph's longest context)
each row reads only its own candidates, and a row of at most k of them is written without a pass."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sortable(x):
    """float32 -> int32 whose signed order is the floats' order."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit(do_not_specialize=["row_width", "k"])
def _radix_topk_kernel(S, OUT, LAST, row_width, k, stride_s, stride_o, BLOCK: tl.constexpr, HAS_LAST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    width = row_width
    if HAS_LAST:  # this row's candidates end at its own last position (a padded row: -1, none)
        width = tl.minimum(row_width, tl.maximum(tl.load(LAST + row), -1) + 1)
    if width <= k:  # every candidate is selected: positions 0..width-1, then -1
        for n0 in range(0, k, BLOCK):
            offs = n0 + tl.arange(0, BLOCK)
            x = tl.load(S + row * stride_s + offs, mask=offs < width, other=float("-inf"))
            tl.store(OUT + row * stride_o + offs, tl.where(x == float("-inf"), -1, offs), mask=offs < k)
        return
    bins = tl.arange(0, 256)
    hi = 0  # the threshold key's bytes picked so far: (threshold >> shift), arithmetic
    remaining = k  # how many of the keys sharing `hi` still belong to the top k
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], tl.int32)
        for n0 in range(0, width, BLOCK):
            offs = n0 + tl.arange(0, BLOCK)
            in_row = offs < width
            key = _sortable(tl.load(S + row * stride_s + offs, mask=in_row, other=0.0))
            if p == 0:
                digit = (key >> 24) + 128  # the signed top byte, 0..255 in order
                match = in_row
            else:
                digit = (key >> shift) & 0xFF
                match = in_row & ((key >> (shift + 8)) == hi)
            hist += tl.histogram(digit, 256, mask=match)
        at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # keys whose digit is >= each bin
        pick = tl.max(tl.where(at_or_above >= remaining, bins, -1), 0)
        above = tl.sum(tl.where(bins > pick, hist, 0), 0)
        remaining = remaining - above
        if p == 0:
            hi = pick - 128
        else:
            hi = hi * 256 + pick
    # hi is the k-th largest key: every key above it, and the first `remaining` keys equal to it
    base_eq = k - remaining
    n_eq = 0
    n_gt = 0
    for n0 in range(0, width, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        in_row = offs < width
        x = tl.load(S + row * stride_s + offs, mask=in_row, other=0.0)
        key = _sortable(x)
        gt = in_row & (key > hi)
        eq = in_row & (key == hi)
        value = tl.where(x == float("-inf"), -1, offs)
        gt_slot = n_gt + tl.cumsum(gt.to(tl.int32), 0) - 1
        tl.store(OUT + row * stride_o + gt_slot, value, mask=gt)
        eq_rank = n_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
        take = eq & (eq_rank < remaining)
        tl.store(OUT + row * stride_o + base_eq + eq_rank, value, mask=take)
        n_gt += tl.sum(gt.to(tl.int32), 0)
        n_eq += tl.sum(eq.to(tl.int32), 0)


def radix_topk(scores: torch.Tensor, k: int, out: torch.Tensor | None = None, block: int = 1024,
               last: torch.Tensor | None = None) -> torch.Tensor:
    """scores [R, width] float32 -> [R, k] int32 (k <= width): each row's k largest positions as a set, -1 for
    the selected -inf entries. `out` may be wider than k (only its first k columns are written). `last` [R] int32
    (on the device): row r's candidates are positions 0..last[r] only (nothing after is read; a row with at most
    k of them selects them all, then -1), so the cost follows each row's own length, not the width."""
    r, width = scores.shape
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError("radix_topk needs contiguous float32 rows")
    if not 0 < k <= width:
        raise ValueError(f"k {k} must be in 1..{width}")
    if out is None:
        out = torch.empty(r, k, dtype=torch.int32, device=scores.device)
    if out.dtype != torch.int32 or out.stride(-1) != 1 or out.shape[0] != r or out.shape[1] < k:
        raise ValueError("radix_topk writes int32 rows of at least k entries")
    if last is not None and (last.dtype != torch.int32 or last.shape != (r,)):
        raise ValueError(f"last must be int32 [{r}]")
    if r:
        _radix_topk_kernel[(r,)](scores, out, out if last is None else last, width, k, scores.stride(0),
                                 out.stride(0), BLOCK=block, HAS_LAST=last is not None)
    return out
