"""The one-pass Gumbel-max sampler (kestrel/worker/triton_sampling.py) on the GPU (skipped without CUDA)."""
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gumbel_sample():
    pytest.importorskip("triton")
    from kestrel.worker.triton_sampling import gumbel_sample
    return gumbel_sample


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,vocab", [(1, 151936), (7, 1000), (256, 151936), (300, 32000)])
def test_greedy_rows_are_argmax(gumbel_sample, dtype, n, vocab):
    logits = torch.randn(n, vocab, device="cuda").to(dtype)
    tokens = gumbel_sample(logits, torch.zeros(n, device="cuda"), torch.arange(n, device="cuda"))
    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize("vocab,hot", [(8, list(range(8))), (151936, [5, 1023, 70000, 151935])])
def test_draws_follow_softmax_over_temperature(gumbel_sample, vocab, hot):
    n, temp = 40000, 0.7
    row = torch.full((vocab,), -1e4, device="cuda")
    row[hot] = torch.linspace(-1.0, 1.5, len(hot), device="cuda")
    logits = row.expand(n, vocab).contiguous().to(torch.bfloat16)
    tokens = gumbel_sample(logits, torch.full((n,), 1 / temp, device="cuda"), torch.arange(n, device="cuda") + 12345)
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    expect = torch.softmax(logits[0].double() / temp, dim=-1)
    # binomial std of a frequency is <= 0.5 / sqrt(n) = 0.0025: 6 sigma
    assert (freq - expect).abs().max().item() < 0.015, (freq[hot], expect[hot])
    assert freq[hot].sum().item() == 1.0


def test_seeded_rows_do_not_depend_on_the_batch(gumbel_sample):
    vocab = 151936
    target = torch.randn(vocab, device="cuda")
    seed = 987654321
    alone = gumbel_sample(target[None].to(torch.bfloat16), torch.ones(1, device="cuda"),
                          torch.tensor([seed], device="cuda"))
    for n, at in [(5, 3), (256, 200)]:  # other batch sizes change the vocab split
        batch = torch.randn(n, vocab, device="cuda")
        batch[at] = target
        seeds = torch.randint(0, 2**40, (n,), device="cuda")
        seeds[at] = seed
        out = gumbel_sample(batch.to(torch.bfloat16), torch.ones(n, device="cuda"), seeds)
        assert out[at].item() == alone.item()


def test_sampler_takes_the_fused_path_only_for_plain_rows(monkeypatch):
    pytest.importorskip("triton")
    from kestrel import SamplingParams
    from kestrel.worker import triton_sampling
    from kestrel.worker.sampler import Sampler, SamplingRow

    calls = []
    real = triton_sampling.gumbel_sample
    monkeypatch.setattr(triton_sampling, "gumbel_sample", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits = torch.randn(3, 5000, device="cuda", dtype=torch.bfloat16)

    def rows(**kw):
        return [SamplingRow(SamplingParams(temperature=0.8, **kw), [1], [], []) for _ in range(3)]

    s = Sampler(0)
    t = s(logits, rows()).tokens
    assert calls == [1] and t.shape == (3,) and t.dtype == torch.int64
    s(logits, rows(top_k=5))  # filters: the torch path
    s(logits, rows(repetition_penalty=1.2))
    assert calls == [1]
