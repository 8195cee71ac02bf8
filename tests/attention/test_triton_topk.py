"""The radix-select top-k (kestrel/attention/ops/triton_topk.py) against torch.topk: rows of random scores, with
negative values, a -inf tail (positions a query does not see), ties at the k-th value and k equal to the row; the
split kernels (P programs a row) give exactly the one-program kernel's output, ties to the lowest positions, also
with per-row lengths (`last`) and widths that are no multiple of the block, and both given the first pass's
histogram (hist); then DSA's select_topk with topk_impl="radix" against the reference selection, and with the
first pass made by the scores kernel (first_pass_in_scores) against without. On CUDA, or on the CPU under the
Triton interpreter (TRITON_INTERPRET=1)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402

_ok, _why = gates.triton_runnable()
pytestmark = pytest.mark.skipif(not _ok, reason=_why)

from kestrel.attention.ops.triton_topk import radix_histogram, radix_plan, radix_topk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_is_topk(scores: torch.Tensor, got: torch.Tensor, k: int) -> None:
    """got [R, k] is a valid top-k of each row: every value above the k-th is in, the rest equal the k-th, no
    position twice, and -1 exactly for the selected -inf entries."""
    for row, sel in zip(scores, got):
        kth = row.topk(k).values[-1]
        finite = sel[sel >= 0]
        assert len(set(finite.tolist())) == len(finite)
        assert (sel == -1).sum() == (min(k, len(row)) - (row > float("-inf")).sum()).clamp(min=0)
        assert set(torch.nonzero(row > kth).flatten().tolist()) <= set(finite.tolist())
        assert (row[finite.long()] >= kth).all()


def assert_lowest_ties(scores: torch.Tensor, got: torch.Tensor, k: int) -> None:
    """got [R, k] is each row's values above its k-th, then the lowest positions equal to it (-1 for -inf)."""
    for row, sel in zip(scores, got):
        kth = row.topk(k).values[-1]
        above = torch.nonzero(row > kth).flatten()
        want = torch.cat([above, torch.nonzero(row == kth).flatten()[:k - len(above)]])
        want = torch.where(row[want] == float("-inf"), -1, want)
        assert sorted(sel.tolist()) == sorted(want.tolist())


def _rows(rows, width, seed):
    """Random rows (some negative) with, in row 0, a -inf tail (fewer visible than k in some cases) and, in row 1,
    many ties around the k-th value and all negative below them."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, width, generator=gen) * 10
    scores[0, width // 3:] = float("-inf")
    if rows > 1:
        scores[1, : width // 2] = 0.5
        scores[1, width // 2 :] -= 100
    return scores


@pytest.mark.parametrize("programs", [1, 3, None])  # None: radix_plan's choice (split from 4096 wide)
@pytest.mark.parametrize("rows,width,k,block", [(3, 100, 7, 64), (2, 3000, 256, 1024), (4, 50, 50, 16),
                                                (5, 700, 64, 128), (3, 5001, 300, None)])
def test_radix_topk_matches_torch_topk(rows, width, k, block, programs):
    scores = _rows(rows, width, width)
    got = radix_topk(scores.to(DEVICE), k, block=block, programs_per_row=programs).cpu()
    assert got.shape == (rows, k) and got.dtype == torch.int32
    assert_is_topk(scores, got, k)
    assert_lowest_ties(scores, got, k)
    for r in range(2, rows):  # no ties: the very set torch.topk picks
        assert set(got[r].tolist()) == set(scores[r].topk(k).indices.tolist())


@pytest.mark.parametrize("width,k,programs,block", [(1000, 37, 5, 64), (2500, 2500, 4, 256), (777, 100, 16, 32),
                                                    (4097, 2048, 3, None), (300, 299, 24, 16)])
def test_split_radix_topk_equals_one_program(width, k, programs, block):
    """Random rows, rows of few distinct values (ties everywhere), a constant row, a -inf tail, k == width,
    widths no multiple of the block, more programs than the row has blocks: the split kernels write the
    one-program kernel's very output (same slots), ties to the lowest positions."""
    gen = torch.Generator().manual_seed(width + k)
    scores = torch.randn(5, width, generator=gen)
    scores[1] = torch.randint(0, 4, (width,), generator=gen).float() - 1.5  # few distinct values
    scores[2] = 0.25  # one value
    scores[3, width // 2:] = float("-inf")
    scores[4, : width // 4] = float("-inf")  # -inf head, values after
    one = radix_topk(scores.to(DEVICE), k, programs_per_row=1).cpu()
    split = radix_topk(scores.to(DEVICE), k, block=block, programs_per_row=programs).cpu()
    assert torch.equal(split, one)
    assert_is_topk(scores, split, k)
    assert_lowest_ties(scores, split, k)


@pytest.mark.parametrize("programs", [1, 6])
def test_split_radix_topk_reads_each_rows_own_length(programs):
    """last shorter than the width (garbage past it never read: NaN, huge values), rows of at most k candidates
    (all selected, then -1), a padded row (-1: nothing), a row of exactly k + 1, ties; chunks cut from each row's
    own length."""
    width, k = 3000, 200
    gen = torch.Generator().manual_seed(9)
    scores = torch.randn(7, width, generator=gen)
    scores[5] = torch.randint(0, 3, (width,), generator=gen).float()
    last = torch.tensor([width - 1, k - 1, k // 2, -1, k, 2000, 1500], dtype=torch.int32)
    for r in range(7):
        scores[r, last[r] + 1:] = float("nan") if r % 2 else 1e30
    got = radix_topk(scores.to(DEVICE), k, last=last.to(DEVICE), programs_per_row=programs, block=128).cpu()
    one = radix_topk(scores.to(DEVICE), k, last=last.to(DEVICE), programs_per_row=1).cpu()
    assert torch.equal(got, one)
    for r in range(7):
        n = int(last[r]) + 1
        if n <= k:
            assert got[r, :n].tolist() == list(range(n)) and (got[r, n:] == -1).all()
        else:
            assert_is_topk(scores[r:r + 1, :n], got[r:r + 1], k)
            assert_lowest_ties(scores[r:r + 1, :n], got[r:r + 1], k)


def first_pass_histogram_ref(scores: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
    """radix_histogram's buffer with [:, 0] the histogram of each row's keys' signed top byte over its candidates
    (the whole row, or positions 0..last[r]), as a scores kernel fills it."""
    bits = scores.contiguous().view(torch.int32)
    digit = (torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) >> 24) + 128
    hist = torch.zeros(scores.shape[0], 4, 256, dtype=torch.int32)
    for r in range(scores.shape[0]):
        n = scores.shape[1] if last is None else min(scores.shape[1], max(int(last[r]), -1) + 1)
        hist[r, 0] = torch.bincount(digit[r, :n].long(), minlength=256)
    return hist


@pytest.mark.parametrize("programs", [1, 5])
def test_radix_topk_given_the_first_pass_writes_the_same(programs):
    """hist (the first pass's histogram made elsewhere, as the scores kernel does): the passes start at the
    second, and the output is the very one of the select that makes all four, with and without `last` (garbage
    past it: NaN)."""
    width, k = 1000, 37
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(4, width, generator=gen)
    scores[1] = torch.randint(0, 3, (width,), generator=gen).float() - 1  # ties at the k-th
    scores[2, width // 3:] = float("-inf")
    last = torch.tensor([width - 1, 500, k - 1, 300], dtype=torch.int32)
    for lengths in (None, last):
        rows = scores.clone()
        if lengths is not None:
            for r in range(4):
                rows[r, lengths[r] + 1:] = float("nan")
        lengths_dev = None if lengths is None else lengths.to(DEVICE)
        want = radix_topk(rows.to(DEVICE), k, last=lengths_dev, programs_per_row=1, block=64).cpu()
        hist = first_pass_histogram_ref(rows, lengths).to(DEVICE)
        got = radix_topk(rows.to(DEVICE), k, last=lengths_dev, programs_per_row=programs, block=64, hist=hist).cpu()
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="hist must be"):
        radix_topk(scores.to(DEVICE), k, hist=radix_histogram(3, DEVICE))


def test_radix_plan():
    """One program a row for many rows or short rows; else about 4 programs an SM, chunks of whole blocks."""
    assert radix_plan(1, 8192) == (32, 256)
    assert radix_plan(1, 32768) == (128, 256)
    assert radix_plan(64, 8192) == (8, 1024)
    assert radix_plan(64, 32768) == (9, 1024)
    assert radix_plan(1, 131072) == (256, 256)  # capped
    assert radix_plan(8, 131072) == (66, 1024)
    assert radix_plan(8, 131072, lengths_vary=True) == (66, 256)  # a decode graph's width: rows may be far shorter
    assert radix_plan(264, 32768) == (1, 1024)  # twice the SMs in rows
    assert radix_plan(4, 3000) == (1, 1024)  # short rows
    assert radix_plan(200, 8192) == (3, 1024)


@pytest.mark.parametrize("programs", [1, 4])
def test_radix_topk_writes_only_k_columns_of_a_wider_out(programs):
    scores = torch.randn(2, 40, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = torch.full((2, 16), -7, dtype=torch.int32, device=DEVICE)
    radix_topk(scores, 5, out, block=16, programs_per_row=programs)
    assert (out[:, 5:] == -7).all()
    assert_is_topk(scores.cpu(), out[:, :5].cpu(), 5)
    few = torch.full((2, 16), -7, dtype=torch.int32, device=DEVICE)
    radix_topk(scores[:, :4].contiguous(), 4, few, programs_per_row=programs)  # k == width: written directly
    assert (few[:, 4:] == -7).all() and few[:, :4].tolist() == [[0, 1, 2, 3]] * 2


def test_radix_topk_refuses_bad_input():
    with pytest.raises(ValueError, match="k 9 must be in 1..8"):
        radix_topk(torch.zeros(1, 8, device=DEVICE), 9)
    with pytest.raises(ValueError, match="contiguous float32"):
        radix_topk(torch.zeros(1, 8, dtype=torch.float16, device=DEVICE), 2)
    with pytest.raises(ValueError, match="programs_per_row 0"):
        radix_topk(torch.zeros(1, 8, device=DEVICE), 2, programs_per_row=0)


@pytest.mark.parametrize("topk,budget", [(8, 1), (64, 1 << 20), (2048, 1 << 20)])
def test_select_topk_radix_matches_reference(topk, budget):
    from kestrel.attention.backends.torch_sparse_mla import select_topk_ref
    from kestrel.attention.ops.triton_sparse_mla import select_topk
    from tests.attention.test_triton_sparse_mla import DTYPE, SEQ, _dev, _scores_case, assert_same_selection

    cache, bt, qsl, req, pos, q, w = _scores_case(2)
    got = select_topk(*_dev(q.to(DTYPE), w, cache.to(DTYPE), bt, req.int(), pos.int()), max(SEQ), topk,
                      budget_bytes=budget, topk_impl="radix").cpu()
    want = select_topk_ref(q.to(DTYPE), w, cache.to(DTYPE), bt, qsl, SEQ, topk)
    assert got.shape == (qsl[-1], topk)
    assert_same_selection(got, want, pos, topk)


@pytest.mark.parametrize("static_width", [False, True])  # True: the CUDA-graph path (visible scores, `last`)
def test_select_topk_first_pass_in_scores_selects_the_same(static_width):
    """The scores kernel making the radix select's first pass (first_pass_in_scores): the very same selection,
    in row chunks (a 1-byte budget: one row a chunk) and whole."""
    from kestrel.attention.ops.triton_sparse_mla import select_topk
    from tests.attention.test_triton_sparse_mla import DTYPE, SEQ, _dev, _scores_case

    cache, bt, qsl, req, pos, q, w = _scores_case(4)
    args = _dev(q.to(DTYPE), w, cache.to(DTYPE), bt, req.int(), pos.int())
    width = 2 * max(SEQ) if static_width else max(SEQ)
    for budget in (1, 1 << 20):
        base, first = (select_topk(*args, width, 16, budget_bytes=budget, topk_impl="radix", static_width=static_width,
                                   first_pass_in_scores=f).cpu() for f in (False, True))
        assert torch.equal(first, base)
