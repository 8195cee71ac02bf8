"""Top-k per row of float32 scores by radix select in Triton: the indices of each row's k largest values (as a
set, in no particular order), -1 where the value is -inf (positions a query does not see), for DSA's selection
(triton_sparse_mla.select_topk with topk_impl="radix"; torch.topk is the default until GPU timings decide).

Each float maps to an int32 key with the same order (negative floats get their magnitude bits flipped). Four
passes of a 256-bin histogram over the row pick the k-th largest key one byte at a time, from the top byte down,
counting only the keys that share the bytes picked so far. A last pass writes the positions whose key is above
that threshold, then the first (by position) of those equal to it until k are written, each group in position
order. So the row is read five times and nothing is sorted; no [rows, width] index buffer exists besides the
output. With `last` (per-row lengths on the device: the CUDA-graph decode path, whose score rows are as wide as
the graph's longest context) each row reads only its own candidates, and a row of at most k of them is written
without a pass.

Two kernels do this, chosen per shape by radix_plan:
- one program per row (_radix_topk_kernel): all five passes in one launch. A row then runs on one SM (H200: 54 us
  at 8k, 205 us at 32k, about 6 us per 1k scores, whatever the batch up to the SM count).
- P programs per row (_radix_pass_kernel x 4, _radix_compact_kernel), for few long rows: each program takes a
  contiguous chunk of its row (cut from the row's own length, read on the device), adds its histogram of each
  pass into the row's [4, 256] global histogram by atomics, and every program of the next launch picks the
  digits so far from it (256 ints a pass). The fourth pass also keeps each program's count of keys above the
  24-bit prefix and its suffix counts by last digit, so that the compaction knows, from the programs before it,
  where its keys above and equal to the threshold go: the output is exactly the one-program kernel's (same
  slots, ties to the lowest positions), deterministic, with no atomic counter. Six launches (a histogram memset,
  four passes, the compaction), each over rows x P programs: no host sync and a grid from the shapes only, so
  a CUDA graph captures it.
Either can start at the second pass (radix_topk's hist): the scores kernel, which visits every score anyway, adds
each row's first-pass histogram into a radix_histogram buffer as it writes the row (indexer_scores' hist;
select_topk's first_pass_in_scores), so the select reads the row four times, and the split one is five launches."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.attention.ops.triton_attention import _sms_for


@triton.jit
def _sortable(x):
    """float32 -> int32 whose signed order is the floats' order."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _top_byte_histogram(x, mask):
    """The first pass's histogram of float32 scores x: their keys' signed top byte, 0..255 in order. Also what a
    scores kernel adds into radix_histogram's [:, 0] so that radix_topk(hist=...) starts at the second pass."""
    return tl.histogram((_sortable(x) >> 24) + 128, 256, mask=mask)


@triton.jit
def _pick_digit(hist, remaining, bins):
    """The bin of a pass's histogram that holds the `remaining`-th largest key, and how many of its keys still
    belong to the top k."""
    at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys whose digit is >= each bin
    pick = tl.max(tl.where(at_or_above >= remaining, bins, -1), 0)
    above = tl.sum(tl.where(bins > pick, hist, 0), 0)
    return pick, remaining - above


@triton.jit
def _row_length(LAST, row, row_width, HAS_LAST: tl.constexpr):
    """How many candidates row `row` has: the width, or (HAS_LAST) up to its own last position (-1: none)."""
    width = row_width
    if HAS_LAST:
        width = tl.minimum(row_width, tl.maximum(tl.load(LAST + row), -1) + 1)
    return width


@triton.jit
def _extend_prefix(hi, pick, PASS: tl.constexpr):
    """The threshold key's bytes so far (arithmetic: threshold >> (24 - 8 * PASS)) once pass PASS picked `pick`."""
    if PASS == 0:
        hi = pick - 128
    else:
        hi = hi * 256 + pick
    return hi


@triton.jit
def _digit_histogram(S, row, start, end, hi, stride_s, PASS: tl.constexpr, BLOCK: tl.constexpr,
                     COUNT_ABOVE: tl.constexpr):
    """Pass PASS's 256-bin histogram over positions start..end-1 of a row: of the signed top byte (PASS 0), else
    of byte 3 - PASS of the keys whose higher bytes equal the prefix `hi` picked so far. COUNT_ABOVE (PASS 3):
    also how many keys lie above that 24-bit prefix (0 otherwise)."""
    shift: tl.constexpr = 24 - 8 * PASS
    hist = tl.zeros([256], tl.int32)
    above = tl.full([], 0, tl.int32)
    for n0 in range(start, end, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        in_range = offs < end
        x = tl.load(S + row * stride_s + offs, mask=in_range, other=0.0)
        if PASS == 0:
            hist += _top_byte_histogram(x, in_range)
        else:
            key = _sortable(x)
            match = in_range & ((key >> (shift + 8)) == hi)
            if COUNT_ABOVE:
                above += tl.sum((in_range & ((key >> 8) > hi)).to(tl.int32), 0)
            hist += tl.histogram((key >> shift) & 0xFF, 256, mask=match)
    return hist, above


@triton.jit
def _write_selected(S, OUT, row, start, end, hi, remaining, n_gt, n_eq, k, stride_s, stride_o, BLOCK: tl.constexpr):
    """The selection's writes for positions start..end-1 of a row whose k-th largest key is `hi`, with `remaining`
    of the keys equal to it selected: each key above hi at the slot after the n_gt such keys before `start`, each
    key equal to it ranked after the n_eq equal ones before `start` and, while that rank is under `remaining`,
    written at slot k - remaining + rank; -1 for a selected -inf. Slots in position order, ties to the lowest
    positions (both kernels' compaction: the one-program kernel over the whole row from 0, 0; the split one over
    its chunk from the earlier chunks' counts)."""
    base_eq = k - remaining
    for n0 in range(start, end, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        in_range = offs < end
        x = tl.load(S + row * stride_s + offs, mask=in_range, other=0.0)
        key = _sortable(x)
        gt = in_range & (key > hi)
        eq = in_range & (key == hi)
        value = tl.where(x == float("-inf"), -1, offs)
        gt_slot = n_gt + tl.cumsum(gt.to(tl.int32), 0) - 1
        tl.store(OUT + row * stride_o + gt_slot, value, mask=gt)
        eq_rank = n_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
        take = eq & (eq_rank < remaining)
        tl.store(OUT + row * stride_o + base_eq + eq_rank, value, mask=take)
        n_gt += tl.sum(gt.to(tl.int32), 0)
        n_eq += tl.sum(eq.to(tl.int32), 0)


@triton.jit(do_not_specialize=["row_width", "k"])
def _radix_topk_kernel(S, OUT, LAST, HIST, row_width, k, stride_s, stride_o, BLOCK: tl.constexpr,
                       HAS_LAST: tl.constexpr, FIRST_DONE: tl.constexpr):
    """FIRST_DONE: the first pass's histogram is HIST[row, 0] already (radix_topk's hist), not read off the row."""
    row = tl.program_id(0).to(tl.int64)
    width = _row_length(LAST, row, row_width, HAS_LAST)
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
        if FIRST_DONE and p == 0:
            hist = tl.load(HIST + row * 4 * 256 + bins)
        else:
            hist, _ = _digit_histogram(S, row, 0, width, hi, stride_s, p, BLOCK, False)
        pick, remaining = _pick_digit(hist, remaining, bins)
        hi = _extend_prefix(hi, pick, p)
    # hi is the k-th largest key: every key above it, and the first `remaining` keys equal to it
    none_before = tl.full([], 0, tl.int32)  # a tensor: the helper's loop carries it
    _write_selected(S, OUT, row, 0, width, hi, remaining, none_before, none_before, k, stride_s, stride_o, BLOCK)


@triton.jit
def _chunk(n, BLOCK: tl.constexpr):
    """This program's part [start, end) of 0..n-1: contiguous chunks of whole BLOCKs, in program order."""
    chunk = tl.cdiv(tl.cdiv(n, tl.num_programs(1)), BLOCK) * BLOCK
    start = tl.program_id(1) * chunk
    return start, tl.minimum(start + chunk, n)


@triton.jit
def _threshold_so_far(HIST, row, k, PASSES: tl.constexpr):
    """(hi, remaining) after the row's first PASSES digits, from its merged histograms HIST [rows, 4, 256]."""
    bins = tl.arange(0, 256)
    hi = 0
    remaining = k
    for p in tl.static_range(PASSES):
        pick, remaining = _pick_digit(tl.load(HIST + (row * 4 + p) * 256 + bins), remaining, bins)
        hi = _extend_prefix(hi, pick, p)
    return hi, remaining


@triton.jit(do_not_specialize=["row_width", "k"])
def _radix_pass_kernel(S, LAST, HIST, SUF, ABOVE, row_width, k, stride_s, PASS: tl.constexpr, BLOCK: tl.constexpr,
                       HAS_LAST: tl.constexpr):
    """Pass PASS of the split select: this chunk's histogram of digit PASS over the keys that share the digits
    picked so far, added into the row's HIST[PASS]. The last pass also stores the chunk's count of keys above the
    24-bit prefix (ABOVE) and its keys sharing the prefix at or above each last digit (SUF), for the compaction."""
    row = tl.program_id(0).to(tl.int64)
    n = _row_length(LAST, row, row_width, HAS_LAST)
    if n <= k:  # every candidate is selected: the compaction writes them, no pass needed
        return
    start, end = _chunk(n, BLOCK)
    hi, remaining = _threshold_so_far(HIST, row, k, PASS)
    bins = tl.arange(0, 256)
    hist, above = _digit_histogram(S, row, start, end, hi, stride_s, PASS, BLOCK, PASS == 3)
    tl.atomic_add(HIST + (row * 4 + PASS) * 256 + bins, hist, mask=hist > 0, sem="relaxed")
    if PASS == 3:  # every program stores, an empty chunk zeros
        prog = row * tl.num_programs(1) + tl.program_id(1)
        tl.store(SUF + prog * 256 + bins, tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist)
        tl.store(ABOVE + prog, above)


@triton.jit(do_not_specialize=["row_width", "k"])
def _radix_compact_kernel(S, OUT, LAST, HIST, SUF, ABOVE, row_width, k, stride_s, stride_o, BLOCK: tl.constexpr,
                          P_PAD: tl.constexpr, HAS_LAST: tl.constexpr):
    """The split select's output: this chunk's keys above the threshold and its first equal ones, at the slots
    that follow the chunks before it (their counts from the last pass), so exactly the one-program output."""
    row = tl.program_id(0).to(tl.int64)
    n = _row_length(LAST, row, row_width, HAS_LAST)
    if n <= k:  # slots 0..k-1: the positions themselves, -1 past the row or where -inf
        start, end = _chunk(k, BLOCK)
        for n0 in range(start, end, BLOCK):
            offs = n0 + tl.arange(0, BLOCK)
            x = tl.load(S + row * stride_s + offs, mask=offs < n, other=float("-inf"))
            tl.store(OUT + row * stride_o + offs, tl.where(x == float("-inf"), -1, offs), mask=offs < end)
        return
    hi, remaining = _threshold_so_far(HIST, row, k, 4)  # hi: the k-th largest key
    last_digit = hi & 0xFF
    progs = tl.arange(0, P_PAD)
    before = progs < tl.program_id(1)
    prog = row * tl.num_programs(1) + progs
    suf_eq = tl.load(SUF + prog * 256 + last_digit, mask=before, other=0)
    suf_gt = tl.load(SUF + prog * 256 + last_digit + 1, mask=before & (last_digit < 255), other=0)
    n_gt = tl.sum(tl.load(ABOVE + prog, mask=before, other=0) + suf_gt, 0)  # keys above, in earlier chunks
    n_eq = tl.sum(suf_eq - suf_gt, 0)  # keys equal to the threshold, in earlier chunks
    start, end = _chunk(n, BLOCK)
    _write_selected(S, OUT, row, start, end, hi, remaining, n_gt, n_eq, k, stride_s, stride_o, BLOCK)


ONE_PROGRAM_BLOCK = 1024
SPLIT_MIN_WIDTH = 4096  # below: the one-program kernel (about 6 us per 1k scores) beats six short launches
MAX_PROGRAMS_PER_ROW = 256


def radix_plan(rows: int, width: int, num_sms: int = 132, lengths_vary: bool = False) -> tuple[int, int]:
    """(programs per row, BLOCK) for rows of `width` scores, from the shapes only (a graph replays the plan).

    One program a row (BLOCK 1024) once the rows alone fill the chip twice (rows >= 2 x SMs: every SM already
    has two rows; splitting adds five launches and atomics for nothing), or for rows under SPLIT_MIN_WIDTH (one
    program's few blocks cost about what six launches do). Otherwise about 4 programs per SM, as the decode's
    split rule wants (choose_num_splits): P = ceil(4 x SMs / rows) (at most MAX_PROGRAMS_PER_ROW), each chunk of
    whole BLOCKs: 1024 where the row has a 1024-block for each program, else down to 256 so that batch 1 still
    gets many programs (8k: 32 programs of 256; 32k: 128). Batch 64 x 8k: 8 programs of one 1024-block a row
    (512 programs); 64 x 32k: 9 of 4 blocks. lengths_vary (`last`: the CUDA-graph path, planned on the graph's
    width): BLOCK 256, since each row's chunks are cut from its own, often far shorter, length on the device and
    a short row should still spread over many programs."""
    if rows >= 2 * num_sms or width < SPLIT_MIN_WIDTH:
        return 1, ONE_PROGRAM_BLOCK
    want = -(-4 * num_sms // rows)
    block = 256 if lengths_vary else _split_block(width, want)
    programs = min(want, -(-width // block), MAX_PROGRAMS_PER_ROW)
    return (programs, block) if programs > 1 else (1, ONE_PROGRAM_BLOCK)


def _split_block(width: int, programs: int) -> int:
    """1024 where each of the programs gets a whole 1024-block of the row, else smaller, down to 256."""
    if width >= ONE_PROGRAM_BLOCK * programs:
        return ONE_PROGRAM_BLOCK
    return max(256, triton.next_power_of_2(-(-width // programs)))


def radix_histogram(rows: int, device) -> torch.Tensor:
    """The select's zeroed [rows, 4, 256] int32 histograms, for a scores kernel to add each row's first pass into
    (indexer_scores' hist) before radix_topk(hist=...) reads it."""
    return torch.zeros(rows, 4, 256, dtype=torch.int32, device=device)


def radix_topk(scores: torch.Tensor, k: int, out: torch.Tensor | None = None, block: int | None = None,
               last: torch.Tensor | None = None, programs_per_row: int | None = None,
               hist: torch.Tensor | None = None) -> torch.Tensor:
    """scores [R, width] float32 -> [R, k] int32 (k <= width): each row's k largest positions as a set, -1 for
    the selected -inf entries. `out` may be wider than k (only its first k columns are written). `last` [R] int32
    (on the device): row r's candidates are positions 0..last[r] only (nothing after is read; a row with at most
    k of them selects them all, then -1), so the cost follows each row's own length, not the width.
    programs_per_row: 1 (the one-program kernel), P > 1 (the split kernels), None (radix_plan); block: the
    kernels' BLOCK (the plan's unless given). Both give the same output.
    hist: a radix_histogram(R) whose [:, 0] already holds each row's first-pass histogram (_top_byte_histogram
    over exactly the candidates read here: all `width`, or 0..last[r]), the rest zero: the first pass is skipped
    (one read of the row and, split, one launch less; the same output). It is used up (the passes add into it)."""
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
    if hist is not None and (hist.dtype != torch.int32 or hist.shape != (r, 4, 256) or not hist.is_contiguous()):
        raise ValueError(f"hist must be a contiguous int32 [{r}, 4, 256] (radix_histogram)")
    if programs_per_row is not None and not 0 < programs_per_row <= MAX_PROGRAMS_PER_ROW:
        raise ValueError(f"programs_per_row {programs_per_row} must be in 1..{MAX_PROGRAMS_PER_ROW}")
    if not r:
        return out
    if programs_per_row is None:
        programs, planned_block = radix_plan(r, width, _sms_for(scores), lengths_vary=last is not None)
    else:
        programs = programs_per_row
        planned_block = ONE_PROGRAM_BLOCK if programs == 1 else _split_block(width, programs)
    block = planned_block if block is None else block
    lengths = out if last is None else last  # unread without last
    first_done = hist is not None
    if programs == 1:
        _radix_topk_kernel[(r,)](scores, out, lengths, hist if first_done else out, width, k, scores.stride(0),
                                 out.stride(0), BLOCK=block, HAS_LAST=last is not None, FIRST_DONE=first_done)
        return out
    if not first_done:
        hist = radix_histogram(r, scores.device)
    suffix = torch.empty(r, programs, 256, dtype=torch.int32, device=scores.device)
    above = torch.empty(r, programs, dtype=torch.int32, device=scores.device)
    grid = (r, programs)
    for p in range(1 if first_done else 0, 4):
        _radix_pass_kernel[grid](scores, lengths, hist, suffix, above, width, k, scores.stride(0), PASS=p,
                                 BLOCK=block, HAS_LAST=last is not None)
    _radix_compact_kernel[grid](scores, out, lengths, hist, suffix, above, width, k, scores.stride(0),
                                out.stride(0), BLOCK=block, P_PAD=triton.next_power_of_2(programs),
                                HAS_LAST=last is not None)
    return out
