"""Attention sinks in the Triton kernels at gpt-oss's shapes on the GPU (skipped without CUDA): head dim 64, 64
query heads over 8 KV heads, sliding window 128 and full layers, the default tile configs and split choice (the
CPU interpreter runs tests/attention/test_triton_sinks.py on tiny shapes with forced tiles)."""
import pytest
import torch

from tests.attention.paged_cases import paged_case

pytestmark = pytest.mark.gpu


def _rel(out, expect):
    return ((out.double() - expect.double()).norm() / expect.double().norm()).item()


@pytest.mark.parametrize("window", [None, 128])
def test_prefill_and_decode_with_sinks_match_the_reference(window):
    from kestrel.attention.ops import reference as ref
    from kestrel.attention.ops import triton_attention as ta

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(0)
    sinks = (2.0 * torch.randn(64, generator=gen)).cuda()
    scale = 64 ** -0.5
    # prefill: a fresh prompt, a chunk after a cached prefix, a one-token chunk
    q_lens, prefixes = [700, 512, 1], [0, 900, 2000]
    seq_lens = [p + n for p, n in zip(prefixes, q_lens)]
    q, kc, vc, bt, qsl, sl = paged_case(q_lens, seq_lens, 16, 64, 8, 64, torch.bfloat16, gen, "cuda")
    out = ta.prefill_attention(q, kc, vc, bt, qsl, sl, scale, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                               sliding_window=window, sinks=sinks)
    f = [t.float() for t in (q, kc, vc)]
    expect = ref.prefill_attention_ref(*f, bt, qsl, sl, scale, sliding_window=window, sinks=sinks)
    assert _rel(out, expect) < 1e-2
    # decode: batch 1 (split, merged in the launch) and batch 64 (unsplit), long and short contexts
    for lens in ([5000], [1, 130, 4097, 300] * 16):
        q, kc, vc, bt, _, sl = paged_case([1] * len(lens), lens, 16, 64, 8, 64, torch.bfloat16, gen, "cuda")
        out = ta.decode_attention(q, kc, vc, bt, sl, scale, max_seq_len=max(lens), sliding_window=window,
                                  sinks=sinks)
        f = [t.float() for t in (q, kc, vc)]
        expect = ref.decode_attention_ref(*f, bt, sl, scale, sliding_window=window, sinks=sinks)
        assert _rel(out, expect) < 1e-2, lens[:4]
