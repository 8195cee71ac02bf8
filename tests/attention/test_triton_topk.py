"""The radix-select top-k (kestrel/attention/ops/triton_topk.py) against torch.topk: rows of random scores, with
negative values, a -inf tail (positions a query does not see), ties at the k-th value and k equal to the row;
then DSA's select_topk with topk_impl="radix" against the reference selection. On CUDA, or on the CPU under the
Triton interpreter (TRITON_INTERPRET=1)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402

_ok, _why = gates.triton_runnable()
pytestmark = pytest.mark.skipif(not _ok, reason=_why)

from kestrel.attention.ops.triton_topk import radix_topk  # noqa: E402

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


@pytest.mark.parametrize("rows,width,k,block", [(3, 100, 7, 64), (2, 3000, 256, 1024), (4, 50, 50, 16),
                                                (5, 700, 64, 128)])
def test_radix_topk_matches_torch_topk(rows, width, k, block):
    gen = torch.Generator().manual_seed(width)
    scores = torch.randn(rows, width, generator=gen) * 10
    scores[0, width // 3:] = float("-inf")  # fewer visible than k in some cases
    if rows > 1:
        scores[1, : width // 2] = 0.5  # many ties around the k-th value
        scores[1, width // 2 :] -= 100  # and all negative below them
    got = radix_topk(scores.to(DEVICE), k, block=block).cpu()
    assert got.shape == (rows, k) and got.dtype == torch.int32
    assert_is_topk(scores, got, k)
    for r in range(2, rows):  # no ties: the very set torch.topk picks
        assert set(got[r].tolist()) == set(scores[r].topk(k).indices.tolist())


def test_radix_topk_writes_only_k_columns_of_a_wider_out():
    scores = torch.randn(2, 40, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = torch.full((2, 16), -7, dtype=torch.int32, device=DEVICE)
    radix_topk(scores, 5, out)
    assert (out[:, 5:] == -7).all()
    assert_is_topk(scores.cpu(), out[:, :5].cpu(), 5)


def test_radix_topk_refuses_bad_input():
    with pytest.raises(ValueError, match="k 9 must be in 1..8"):
        radix_topk(torch.zeros(1, 8, device=DEVICE), 9)
    with pytest.raises(ValueError, match="contiguous float32"):
        radix_topk(torch.zeros(1, 8, dtype=torch.float16, device=DEVICE), 2)


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
