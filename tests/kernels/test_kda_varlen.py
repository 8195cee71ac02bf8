"""The batched KDA prefill's logic on the CPU, without fla: the varlen short convolution against causal_conv per
request, the varlen delta rule (the contract fla's chunk_kda is called with) against delta_rule_chunked per
request, and a KDA layer's step through `forward_prefills` (one call for every prefill, initial states gathered
from the slots, final states written back) against the per-request path on the same mixed batch: decodes, fresh
prompts, continued chunks, a request whose slot holds a restored snapshot, and one shorter than the conv window.
The per-request path is the CPU's and fla's fallback; tests/gpu/test_gpu_kda_prefill.py runs fla itself."""
from types import SimpleNamespace

import pytest
import torch

from kestrel.attention.backend import CommonAttentionMetadata
from kestrel.attention.kda import KDAImpl, KDAMetadataBuilder
from kestrel.core.kv_spec import KDAStateSpec
from kestrel.kernels import kda_ref

H, D, K = 2, 16, 4
C = 3 * H * D


@pytest.mark.parametrize("lens", [[5, 1, 17, 2], [40], [3, 3]])
def test_varlen_conv_equals_causal_conv_per_request(lens):
    gen = torch.Generator().manual_seed(sum(lens))
    x = torch.randn(sum(lens), C, generator=gen)
    states = torch.randn(len(lens), C, K - 1, generator=gen)
    states[0] = 0  # a fresh request: zeros, as causal_conv's None
    weight = torch.randn(C, K, generator=gen)
    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    y, new_states = kda_ref.causal_conv_varlen(x, kda_ref.VarlenConvLayout.build(cu, K, 'cpu'), states, weight)
    assert y.dtype == torch.float32 and new_states.shape == states.shape
    for b, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        want_y, want_state = kda_ref.causal_conv(x[s:e], states[b] if b else None, weight)
        torch.testing.assert_close(y[s:e], want_y, rtol=1e-6, atol=1e-6)
        assert torch.equal(new_states[b], want_state)  # the inputs themselves: copied, not computed


def test_varlen_delta_rule_equals_chunked_per_request():
    gen = torch.Generator().manual_seed(3)
    lens, scale = [33, 1, 70], D ** -0.5
    t = sum(lens)
    q, k, v = (torch.randn(t, H, D, generator=gen) for _ in range(3))
    g = -torch.rand(t, H, D, generator=gen)
    beta = torch.rand(t, H, generator=gen)
    initial = torch.randn(len(lens), H, D, D, generator=gen)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    o, final = kda_ref.delta_rule_varlen(q, k, v, g, beta, initial, cu, cu, scale)
    assert torch.equal(initial[0], initial.clone()[0])  # the initial states are not written
    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        state = initial[b].clone()
        want = kda_ref.delta_rule(kda_ref.l2norm(q[s:e]) * scale, kda_ref.l2norm(k[s:e]), v[s:e], g[s:e], beta[s:e],
                                  state)
        torch.testing.assert_close(o[s:e], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[b], state, rtol=1e-5, atol=1e-5)


# (query tokens, seq_len) per request, decodes first as the scheduler orders them: two decodes; then a fresh prompt,
# a first chunk, a continued chunk (computed tokens before it), a restored snapshot continued (computed tokens from
# a prefix hit: to the layer, a state like any other), a fresh prompt of 2 tokens (shorter than the conv window) and
# a continued chunk of 2
BATCH = [(1, 9), (1, 30), (12, 12), (7, 7), (9, 25), (6, 22), (2, 2), (2, 40)]
SLOTS = [3, 5, 1, 2, 4, 6, 7, 8]


# Gated DeltaNet's form of a layer (kda_ref.DeltaOptions): 2 key heads read by 4 state heads, values of 32, one
# decay per head, a SiLU output gate
GDN = kda_ref.DeltaOptions(4, 16, 2, 32, per_head_decay=True, gate_act="silu")


def layer_case(dtype=torch.float32, h: int = H, d: int = D, batch=BATCH, slots=SLOTS, device="cpu",
               options: kda_ref.DeltaOptions | None = None):
    """A KDA layer's weights (or, with `options`, a delta-rule layer of that form: h and d are then its), a step's
    projections (`batch`: (query tokens, seq_len) per request, decodes first) in `dtype`, slot caches and the
    step's metadata, built by the KDA metadata builder."""
    o = options or kda_ref.DeltaOptions(h, d)
    h, d, dv = o.num_heads, o.head_dim, o.v_dim
    gen = torch.Generator().manual_seed(11)
    decay, c, t = h if o.per_head_decay else h * d, o.conv_channels, sum(n for n, _ in batch)
    w = dict(conv_weight=torch.randn(c, K, generator=gen) * 0.5, A_log=torch.rand(h, generator=gen),
             dt_bias=torch.randn(decay, generator=gen) - 2, o_norm_weight=1 + 0.2 * torch.randn(dv, generator=gen))
    w = SimpleNamespace(**{n: x.to(device) for n, x in w.items()}, norm_eps=1e-5, delta=o)
    inputs = [torch.randn(t, n, generator=gen).to(device, dtype) for n in (c, decay, h, h * dv)]
    num_slots = max(slots) + 2
    cache = (torch.randn(num_slots, h, d, dv, generator=gen).to(device) * 0.1,
             torch.randn(num_slots, c, K - 1, generator=gen).to(device, dtype))
    spec = KDAStateSpec(dtype, num_heads=h, head_dim=d, conv_width=K, num_slots=num_slots)
    qsl = [0] + torch.tensor([n for n, _ in batch]).cumsum(0).tolist()
    seq_lens = [s for _, s in batch]
    num_decodes = sum(1 for n, _ in batch if n == 1)
    common = CommonAttentionMetadata(t, len(batch), num_decodes, max(n for n, _ in batch), max(seq_lens),
                                     torch.tensor(qsl, dtype=torch.int32, device=device),
                                     torch.tensor(seq_lens, dtype=torch.int32, device=device), qsl, seq_lens)
    table = torch.tensor(slots, dtype=torch.int32, device=device).view(-1, 1)
    meta = KDAMetadataBuilder(spec, 1, torch.device(device)).build(common, table,
                                                                   torch.zeros(t, dtype=torch.long, device=device))
    return w, inputs, cache, meta


@pytest.mark.parametrize("options", [None, GDN], ids=["kda", "gdn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_prefill_equals_per_request(dtype, options):
    w, inputs, cache, meta = layer_case(dtype, options=options)
    assert meta.has_initial_state_cpu == [True, True, False, False, True, True, False, True]
    per_request, batched = KDAImpl(H, D, D ** -0.5, H), KDAImpl(H, D, D ** -0.5, H)
    per_request.varlen_delta_rule = None
    calls = []

    def delta_rule(*args):
        calls.append(args[7].tolist())  # cu_seqlens_cpu
        return kda_ref.delta_rule_varlen(*args)

    batched.varlen_delta_rule = delta_rule
    want_cache, got_cache = tuple(c.clone() for c in cache), tuple(c.clone() for c in cache)
    want = per_request.forward_kda(w, *inputs, want_cache, meta)
    got = batched.forward_kda(w, *inputs, got_cache, meta)
    assert calls == [[0, 12, 19, 28, 34, 36, 38]]  # one call for the six prefills and chunks, decodes apart
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache[0], want_cache[0], rtol=1e-5, atol=1e-5)  # float32 recurrent states
    assert torch.equal(got_cache[1], want_cache[1])  # conv states: copies of the inputs
    untouched = [s for s in range(10) if s not in SLOTS]
    assert torch.equal(got_cache[0][untouched], cache[0][untouched])  # null slot 0 and the spare slot 9


def test_prefill_choice_reads_the_gate_table():
    """On the CPU (this machine, or a fake sm_90 without fla-core) the gate row is closed: per request."""
    from kestrel.platform.testing import use_platform

    w, inputs, cache, meta = layer_case()
    with use_platform("cpu"):
        impl = KDAImpl(H, D, D ** -0.5, H)
        impl.forward_kda(w, *inputs, cache, meta)
        assert impl.varlen_delta_rule is None
