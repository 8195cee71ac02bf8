"""Attention sinks (gpt-oss: a learned logit per query head in every row's softmax denominator) in the Triton
prefill and decode kernels vs the PyTorch reference, with and without a sliding window, across decode splits.

Runs on CUDA, or on the CPU under the Triton interpreter (TRITON_INTERPRET=1); skips otherwise. The reference
itself is held to transformers' formula (the sink column appended to the logits, dropped after the softmax)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.attention.ops import reference as ref  # noqa: E402
from kestrel.platform import triton_gates as gates  # noqa: E402
from tests.attention.paged_cases import paged_case, poison_outside_window  # noqa: E402

_ok, _why = gates.triton_runnable()
needs_triton = pytest.mark.skipif(not _ok, reason=_why)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = 64 if torch.cuda.is_available() else 32
TOL = 1e-2  # bf16 inputs against a float32 reference


def rel_err(out, expect):
    out, expect = out.double(), expect.double()
    assert torch.isfinite(out).all(), "non-finite values in output"
    return ((out - expect).norm() / expect.norm().clamp_min(1e-30)).item()


def sinks_for(hq, gen):
    # large enough that a sink takes a real share of the softmax (logits of scaled random q.k are ~N(0, 1))
    return (2.0 * torch.randn(hq, generator=gen)).to(DEVICE)


def test_reference_sinks_follow_transformers():
    """gpt-oss's eager attention: softmax over [logits | sink], the sink column dropped."""
    gen = torch.Generator().manual_seed(3)
    q, kc, vc, bt, qsl, sl = paged_case([7], [7], 16, 4, 2, 16, torch.float32, gen)
    sinks = torch.randn(4, generator=gen)
    out = ref.paged_attention_ref(q, kc, vc, bt, qsl, sl, 0.25, sinks=sinks)
    k = kc[bt[0, 0]][:7].repeat_interleave(2, dim=1).transpose(0, 1)
    v = vc[bt[0, 0]][:7].repeat_interleave(2, dim=1).transpose(0, 1)
    logits = q.transpose(0, 1) @ k.transpose(1, 2) * 0.25
    logits = logits.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    combined = torch.cat([logits, sinks[:, None, None].expand(4, 7, 1)], dim=-1)
    probs = (combined - combined.max(-1, keepdim=True).values).softmax(-1)[..., :-1]
    torch.testing.assert_close(out, (probs @ v).transpose(0, 1))
    plain = ref.paged_attention_ref(q, kc, vc, bt, qsl, sl, 0.25)
    assert not torch.allclose(plain, out, atol=1e-3)


@needs_triton
@pytest.mark.parametrize("window", [None, 5, 24])
@pytest.mark.parametrize("page,block_n", [(32, 16), (16, 32)])
def test_prefill_sinks(window, page, block_n):
    """Fresh prompts, chunks after cached prefixes and a one-token chunk (gpt-oss's sliding layers under chunked
    prefill), 16-row query tiles; with a window nothing below it is loaded (NaN-poisoned copy, same output)."""
    from kestrel.attention.ops import triton_attention as ta

    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(11)
    q_lens, prefixes = [33, 9, 1, 20], [0, 40, 57, 18]
    seq_lens = [p + n for p, n in zip(prefixes, q_lens)]
    q, kc, vc, bt, qsl, sl = paged_case(q_lens, seq_lens, page, 4, 2, D, dtype, gen, DEVICE)
    sinks = sinks_for(4, gen)
    scale = D ** -0.5

    def run(k, v, table):
        out = torch.full_like(q, float("nan"))
        return ta.prefill_attention(q, k, v, table, qsl, sl, scale, out=out, max_query_len=max(q_lens),
                                    sliding_window=window, sinks=sinks,
                                    _config={"BLOCK_M": 16, "BLOCK_N": block_n})

    f = [t.float() for t in (q, kc, vc)]
    expect = ref.prefill_attention_ref(*f, bt, qsl, sl, scale, sliding_window=window, sinks=sinks)
    clean = run(kc, vc, bt)
    assert rel_err(clean, expect) < TOL
    assert rel_err(ref.prefill_attention_ref(*f, bt, qsl, sl, scale, sliding_window=window), expect) > 10 * TOL
    if window:
        poisoned = run(*poison_outside_window(kc, vc, bt, q_lens, seq_lens, window))
        assert torch.equal(poisoned, clean)


@needs_triton
@pytest.mark.parametrize("window", [None, 16, 50])
@pytest.mark.parametrize("splits", [1, 4, "4-separate-reduce", "8-min-split-32"])
def test_decode_sinks(window, splits):
    """The sink joins one split's partial softmax only (split 0), whichever way the splits merge; a padding row
    (seq_len 0) gives zeros."""
    from kestrel.attention.ops import triton_attention as ta

    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(12)
    seq_lens = [300, 0, 1, 37, 129]
    q, kc, vc, bt, _, sl = paged_case([1] * len(seq_lens), seq_lens, 16, 8, 2, D, dtype, gen, DEVICE)
    sinks = sinks_for(8, gen)
    scale = D ** -0.5
    cfg = {"BLOCK_N": 16, "MIN_SPLIT": 16}
    if splits == "4-separate-reduce":
        splits, cfg = 4, {**cfg, "FUSED_REDUCE": False}
    elif splits == "8-min-split-32":
        splits, cfg = 8, {**cfg, "MIN_SPLIT": 32}
    out = torch.full_like(q, float("nan"))
    ta.decode_attention(q, kc, vc, bt, sl, scale, out=out, num_splits=splits, sliding_window=window, sinks=sinks,
                        _config=cfg)
    f = [t.float() for t in (q, kc, vc)]
    expect = ref.decode_attention_ref(*f, bt, sl, scale, sliding_window=window, sinks=sinks)
    assert rel_err(out, expect) < TOL
    assert torch.all(out[1] == 0)
    assert rel_err(ref.decode_attention_ref(*f, bt, sl, scale, sliding_window=window), expect) > 10 * TOL


@needs_triton
def test_sinks_are_checked():
    from kestrel.attention.ops import triton_attention as ta

    q, kc, vc, bt, qsl, sl = paged_case([1], [5], 16, 4, 2, D, torch.bfloat16, torch.Generator(), DEVICE)
    with pytest.raises(ValueError, match="sinks must be"):
        ta.decode_attention(q, kc, vc, bt, sl, 0.1, sinks=torch.zeros(4, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="sinks must be"):
        ta.prefill_attention(q, kc, vc, bt, qsl, sl, 0.1, sinks=torch.zeros(2, device=DEVICE))
