"""The one-pass Gumbel-max sampler (kestrel/worker/triton_sampling.py) on CUDA, or on the CPU under the Triton
interpreter (make kernels-check); skipped otherwise. Large-vocabulary cases are in tests/gpu."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402

_ok, _why = gates.triton_runnable()
pytestmark = pytest.mark.skipif(not _ok, reason=_why)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sample(logits, inv_temp, seeds):
    from kestrel.worker.triton_sampling import gumbel_sample
    return gumbel_sample(logits, inv_temp, seeds)


@pytest.mark.parametrize("n,vocab", [(1, 3000), (5, 2500), (300, 1100)])
def test_greedy_rows_are_argmax(n, vocab):
    logits = torch.randn(n, vocab, device=DEVICE).to(torch.bfloat16)
    assert torch.equal(sample(logits, torch.zeros(n, device=DEVICE), torch.arange(n, device=DEVICE)),
                      logits.argmax(dim=-1))


def test_draws_follow_softmax_over_temperature():
    # the interpreter runs one program a row in turn: fewer rows there, the bar following the binomial std
    n, vocab, temp = (4000 if DEVICE == "cuda" else 1500), 6, 0.7
    row = torch.tensor([0.3, -1.0, 1.2, 0.0, -0.5, 0.9])
    logits = row.expand(n, vocab).contiguous().to(DEVICE)
    tokens = sample(logits, torch.full((n,), 1 / temp, device=DEVICE), torch.arange(n, device=DEVICE) + 99)
    freq = torch.bincount(tokens.cpu(), minlength=vocab).double() / n
    expect = torch.softmax(row.double() / temp, dim=-1)
    assert (freq - expect).abs().max().item() < 5 * (0.25 / n) ** 0.5  # 5 binomial std (at most)


def test_a_seeded_row_does_not_depend_on_the_batch():
    vocab = 2048
    target = torch.randn(vocab, device=DEVICE)
    alone = sample(target[None], torch.ones(1, device=DEVICE), torch.tensor([4242], device=DEVICE))
    batch = torch.randn(40, vocab, device=DEVICE)  # another row count changes the vocabulary split
    batch[17] = target
    seeds = torch.arange(40, device=DEVICE) * 7
    seeds[17] = 4242
    assert sample(batch, torch.ones(40, device=DEVICE), seeds)[17].item() == alone.item()
