"""The paged-attention reference (kestrel/attention/ops/reference.py, the torch_ref backend's attention and the
Triton kernels' yardstick) against transformers' own dense attention: Gemma 3's eager attention (soft-capping)
under the masks of transformers.masking_utils (causal, sliding window), on the CPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function
from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

from kestrel.attention.backend import AttentionMetadata
from kestrel.attention.backends.torch_ref import TorchRefImpl
from kestrel.attention.ops import reference as ref
from tests.attention.paged_cases import paged_case, poison_outside_window

# (prefix, new tokens) per sequence: a fresh prompt, chunks after cached prefixes, a decode step
Q_LENS = [13, 6, 1, 9]
PREFIXES = [0, 19, 40, 5]


def hf_dense(q, k, v, prefix, window, softcap, scale):
    """transformers: q [L, Hq, D] at positions prefix.., k/v [S, Hkv, D] at 0..S-1 -> [L, Hq, D]."""
    fn = sliding_window_causal_mask_function(window) if window else causal_mask_function
    mask = sdpa_mask(batch_size=1, q_length=q.shape[0], kv_length=k.shape[0], q_offset=prefix, mask_function=fn,
                     allow_is_causal_skip=False)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False, head_dim=q.shape[2])
    out, _ = eager_attention_forward(module, q[None].transpose(1, 2), k[None].transpose(1, 2),
                                     v[None].transpose(1, 2), additive, scaling=scale, softcap=softcap)
    return out[0]


def expected(q, kc, vc, bt, q_lens, seq_lens, window, softcap, scale):
    outs, start = [], 0
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        k = ref.gather_kv(kc, bt[b], 0, seq_len)
        v = ref.gather_kv(vc, bt[b], 0, seq_len)
        outs.append(hf_dense(q[start : start + q_len], k, v, seq_len - q_len, window, softcap, scale))
        start += q_len
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 1, 3, 8, 20, 1000])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("page,group", [(4, 1), (8, 3)])
def test_reference_matches_transformers(window, softcap, page, group):
    gen = torch.Generator().manual_seed(0)
    seq_lens = [p + n for p, n in zip(PREFIXES, Q_LENS)]
    q, kc, vc, bt, qsl, sl = paged_case(Q_LENS, seq_lens, page, 2 * group, 2, 16, torch.float32, gen)
    q = 3 * q  # logits well beyond the cap, so that soft-capping matters
    scale = 16 ** -0.5
    out = ref.paged_attention_ref(q, kc, vc, bt, qsl, sl, scale, sliding_window=window, softcap=softcap or 0.0)
    expect = expected(q, kc, vc, bt, Q_LENS, seq_lens, window, softcap, scale)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    # the options really change the result (or the comparison above proves little)
    plain = ref.paged_attention_ref(q, kc, vc, bt, qsl, sl, scale)
    if softcap or (window and window < max(seq_lens)):
        assert (out - plain).abs().max() > 1e-2


@pytest.mark.parametrize("window", [1, 7, 16])
def test_reference_never_reads_outside_the_window(window):
    gen = torch.Generator().manual_seed(1)
    seq_lens = [p + n for p, n in zip(PREFIXES, Q_LENS)]
    q, kc, vc, bt, qsl, sl = paged_case(Q_LENS, seq_lens, 4, 4, 2, 16, torch.float32, gen)
    clean = ref.paged_attention_ref(q, kc, vc, bt, qsl, sl, 0.25, sliding_window=window)
    pkc, pvc, pbt = poison_outside_window(kc, vc, bt, Q_LENS, seq_lens, window)
    assert torch.isnan(pkc).any() and not torch.equal(pbt, bt)
    out = ref.paged_attention_ref(q, pkc, pvc, pbt, qsl, sl, 0.25, sliding_window=window)
    assert torch.isfinite(out).all()
    assert torch.equal(out, clean)


def test_decode_reference_is_the_one_query_case():
    gen = torch.Generator().manual_seed(2)
    seq_lens = [9, 0, 30]  # 0: a padding row -> zeros
    q, kc, vc, bt, _, sl = paged_case([1, 1, 1], seq_lens, 8, 4, 2, 16, torch.float32, gen)
    out = ref.decode_attention_ref(q, kc, vc, bt, sl, 0.25, sliding_window=5, softcap=1.5)
    assert torch.all(out[1] == 0)
    for b in (0, 2):
        k = ref.gather_kv(kc, bt[b], 0, seq_lens[b])
        v = ref.gather_kv(vc, bt[b], 0, seq_lens[b])
        torch.testing.assert_close(out[b], hf_dense(q[b : b + 1], k, v, seq_lens[b] - 1, 5, 1.5, 0.25)[0])


@pytest.mark.parametrize("window,softcap", [(None, None), (4, None), (6, 1.5)])
def test_torch_ref_backend_writes_the_cache_and_attends(window, softcap):
    """TorchRefImpl: new tokens' K/V go to their slots, then attention with the layer's window and cap
    (padded rows beyond num_tokens come back as zeros)."""
    gen = torch.Generator().manual_seed(3)
    q_lens, seq_lens = [5, 3], [5, 11]
    q, kc, vc, bt, qsl, sl = paged_case(q_lens, seq_lens, 4, 4, 2, 16, torch.float32, gen)
    expect_kc, expect_vc = kc.clone(), vc.clone()
    slots, new_k, new_v = [], [], []
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(seq_len - q_len, seq_len):
            blk, off = int(bt[b, pos // 4]), pos % 4
            slots.append(blk * 4 + off)
            new_k.append(torch.randn(2, 16, generator=gen))
            new_v.append(torch.randn(2, 16, generator=gen))
            expect_kc[blk, off], expect_vc[blk, off] = new_k[-1], new_v[-1]
    pad = 2  # CUDA-graph style padding rows
    k = torch.cat([torch.stack(new_k), torch.zeros(pad, 2, 16)])
    v = torch.cat([torch.stack(new_v), torch.zeros(pad, 2, 16)])
    qp = torch.cat([q, torch.randn(pad, 4, 16, generator=gen)])
    meta = AttentionMetadata(num_tokens=q.shape[0], num_reqs=2, num_decodes=0, max_query_len=5, max_seq_len=11,
                             query_start_loc=qsl, seq_lens=sl, block_tables=bt,
                             slot_mapping=torch.tensor(slots, dtype=torch.int64))
    impl = TorchRefImpl(4, 16, 0.25, 2, sliding_window=window, logits_soft_cap=softcap)
    out = impl.forward(qp, k, v, (kc, vc), meta)
    assert torch.equal(kc, expect_kc) and torch.equal(vc, expect_vc)
    torch.testing.assert_close(out[: q.shape[0]], expected(q, kc, vc, bt, q_lens, seq_lens, window, softcap, 0.25))
    assert torch.all(out[q.shape[0]:] == 0)


@pytest.mark.parametrize("kwargs", [{"sliding_window": -1}, {"sliding_window": 2.5}, {"logits_soft_cap": -1.0}])
def test_attention_impl_rejects_bad_options(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        TorchRefImpl(4, 16, 0.25, 2, **kwargs)
