"""The fused KDA decode kernel against the unfused PyTorch chain (KDAImpl.forward_decode, itself checked against
transformers through tests/models/test_kimi_linear.py): outputs, the conv state (bit-exact), the recurrent state,
slots no request uses left untouched.

On the CPU it runs under the Triton interpreter (TRITON_INTERPRET=1: `make kernels-check`), tiny shapes, float32.
The `gpu` test runs Kimi-Linear-48B's head shape in bf16 after 1 to 32k tokens of state history: relative error
< 1e-2 at every step."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates  # noqa: E402

_ok, _why = triton_gates.triton_runnable()
pytestmark = pytest.mark.skipif(not _ok, reason=_why)

from kestrel.attention.kda import KDAImpl  # noqa: E402
from kestrel.kernels import kda_ref  # noqa: E402
from kestrel.kernels.triton_ops.kda_decode import kda_fused_decode  # noqa: E402
from kestrel.platform.testing import requires_kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def layer_weights(h, d, k, dtype, gen):
    hd = h * d
    return SimpleNamespace(conv_weight=(torch.randn(3 * hd, k, generator=gen) * 0.5).to(DEVICE, dtype),
                           A_log=torch.rand(h, generator=gen).mul(2.7).to(DEVICE),  # exp in [1, 15]
                           dt_bias=(torch.randn(hd, generator=gen) - 3).to(DEVICE),
                           o_norm_weight=(1 + 0.2 * torch.randn(d, generator=gen)).to(DEVICE, dtype), norm_eps=1e-5,
                           delta=kda_ref.DeltaOptions(h, d))


def step_inputs(b, h, d, dtype, gen):
    hd = h * d
    # q|k|v|beta in one row, as the layer's merged projection leaves them (strided views)
    proj = torch.randn(b, 3 * hd + h, generator=gen).to(DEVICE, dtype)
    f = torch.randn(b, hd, generator=gen).to(DEVICE, dtype)
    gate = torch.randn(b, hd, generator=gen).to(DEVICE, dtype)
    return proj[:, :3 * hd], f, proj[:, 3 * hd:], gate


def states(num_slots, h, d, k, dtype, gen):
    rec = (torch.randn(num_slots, h, d, d, generator=gen) * 0.1).to(DEVICE)
    conv = torch.randn(num_slots, 3 * h * d, k - 1, generator=gen).to(DEVICE, dtype)
    return rec, conv


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("h,d,k", [(2, 16, 4), (3, 32, 3)])
def test_fused_decode_matches_unfused_chain(h, d, k):
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float32
    w = layer_weights(h, d, k, dtype, gen)
    rec, conv = states(6, h, d, k, dtype, gen)
    slots = torch.tensor([3, 1, 5], dtype=torch.int32, device=DEVICE)
    ref_cache = (rec.clone(), conv.clone())
    for step in range(3):  # the state carries over steps; row 1 starts its request at step 0 (slot 1 is stale)
        qkv, f, beta, gate = step_inputs(3, h, d, dtype, gen)
        seq_lens = torch.tensor([7 + step, 1 + step, 30 + step], dtype=torch.int32, device=DEVICE)
        want = KDAImpl.forward_decode(None, w, qkv, f, beta, gate, ref_cache, slots, seq_lens)
        got = kda_fused_decode(qkv, f, beta, gate, w.conv_weight, w.A_log, w.dt_bias, w.o_norm_weight, w.norm_eps,
                               rec, conv, slots, seq_lens)
        assert rel_err(got, want) < 1e-5, step
        assert torch.equal(conv, ref_cache[1])  # conv state: the same inputs shifted, bit-exact
        assert rel_err(rec, ref_cache[0]) < 1e-5
    untouched = [0, 2, 4]
    assert torch.equal(rec[untouched], ref_cache[0][untouched])


def gdn_case(b, hk, h, dk, dv, k, dtype, gen, num_slots=6):
    """Gated DeltaNet's shapes (kda_ref.DeltaOptions): hk key heads repeated to h state heads, values of dv, one
    decay per head, a SiLU output gate; weights, one step's projections and slot caches."""
    o = kda_ref.DeltaOptions(h, dk, hk, dv, per_head_decay=True, gate_act="silu")
    c = o.conv_channels
    w = SimpleNamespace(conv_weight=(torch.randn(c, k, generator=gen) * 0.5).to(DEVICE, dtype),
                        A_log=torch.rand(h, generator=gen).mul(2.7).to(DEVICE),
                        dt_bias=(torch.randn(h, generator=gen) - 3).to(DEVICE),
                        o_norm_weight=(1 + 0.2 * torch.randn(dv, generator=gen)).to(DEVICE, dtype), norm_eps=1e-5,
                        delta=o)
    cache = ((torch.randn(num_slots, h, dk, dv, generator=gen) * 0.1).to(DEVICE),
             torch.randn(num_slots, c, k - 1, generator=gen).to(DEVICE, dtype))
    return w, cache


def gdn_step(b, w, gen, dtype):
    o = w.delta
    # q|k|v | z | b | a in one row, as the GDN layer's merged projection leaves them (strided views)
    proj = torch.randn(b, o.conv_channels + o.num_heads * o.v_dim + 2 * o.num_heads, generator=gen).to(DEVICE, dtype)
    qkv, z, beta, a = proj.split([o.conv_channels, o.num_heads * o.v_dim, o.num_heads, o.num_heads], dim=-1)
    return qkv, a, beta, z


def fused(w, qkv, f, beta, gate, cache, slots, seq_lens):
    o = w.delta
    return kda_fused_decode(qkv, f, beta, gate, w.conv_weight, w.A_log, w.dt_bias, w.o_norm_weight, w.norm_eps,
                            *cache, slots, seq_lens, o.key_heads, o.per_head_decay, o.gate_act)


@pytest.mark.parametrize("hk,h,dk,dv,k", [(2, 4, 16, 32, 4), (1, 3, 32, 16, 3), (2, 2, 16, 16, 4)])
def test_fused_gdn_decode_matches_unfused_chain(hk, h, dk, dv, k):
    """Gated DeltaNet through the same kernel: each program convolves its key head's q and k once (the conv
    state shifted once, bit-exact) for the state heads that read them."""
    gen = torch.Generator().manual_seed(7)
    w, (rec, conv) = gdn_case(3, hk, h, dk, dv, k, torch.float32, gen)
    slots = torch.tensor([3, 1, 5], dtype=torch.int32, device=DEVICE)
    ref = (rec.clone(), conv.clone())
    for step in range(3):  # row 1 starts its request at step 0 (slot 1 is stale)
        qkv, f, beta, gate = gdn_step(3, w, gen, torch.float32)
        seq_lens = torch.tensor([7 + step, 1 + step, 30 + step], dtype=torch.int32, device=DEVICE)
        want = KDAImpl.forward_decode(None, w, qkv, f, beta, gate, ref, slots, seq_lens)
        got = fused(w, qkv, f, beta, gate, (rec, conv), slots, seq_lens)
        assert got.shape == (3, h * dv)
        assert rel_err(got, want) < 1e-5, step
        assert torch.equal(conv, ref[1])
        assert rel_err(rec, ref[0]) < 1e-5
    assert torch.equal(rec[[0, 2, 4]], gdn_case(3, hk, h, dk, dv, k, torch.float32,
                                                torch.Generator().manual_seed(7))[1][0][[0, 2, 4]])


def test_first_token_ignores_the_stale_slot():
    """A request's first token (seq_len 1: a one-token prompt or first chunk) gives the same output whatever its
    slot held before, in both paths."""
    gen = torch.Generator().manual_seed(4)
    h, d, k, dtype = 2, 16, 4, torch.float32
    w = layer_weights(h, d, k, dtype, gen)
    qkv, f, beta, gate = step_inputs(1, h, d, dtype, gen)
    slots, first = (torch.ones(1, dtype=torch.int32, device=DEVICE) for _ in range(2))
    outs = []
    for seed in (5, 6):
        rec, conv = states(2, h, d, k, dtype, torch.Generator().manual_seed(seed))
        for decode in (lambda c: KDAImpl.forward_decode(None, w, qkv, f, beta, gate, c, slots, first),
                       lambda c: kda_fused_decode(qkv, f, beta, gate, w.conv_weight, w.A_log, w.dt_bias,
                                                  w.o_norm_weight, w.norm_eps, *c, slots, first)):
            outs.append(decode((rec.clone(), conv.clone())))
    assert all(rel_err(o, outs[0]) < 1e-5 for o in outs[1:])


def test_strided_slots_and_null_slot_padding():
    """A captured graph's slots are a strided column of the block table; its padding rows share the null slot 0,
    which leaves every real slot alone."""
    gen = torch.Generator().manual_seed(1)
    h, d, k, dtype = 2, 16, 4, torch.float32
    w = layer_weights(h, d, k, dtype, gen)
    rec, conv = states(4, h, d, k, dtype, gen)
    table = torch.tensor([[2, 7], [0, 7], [0, 7]], dtype=torch.int32, device=DEVICE)  # 1 real row + 2 padding
    seq_lens = torch.tensor([9, 0, 0], dtype=torch.int32, device=DEVICE)  # padding: seq_len 0
    before = rec.clone(), conv.clone()
    qkv, f, beta, gate = step_inputs(3, h, d, dtype, gen)
    ref = (before[0].clone(), before[1].clone())
    want = KDAImpl.forward_decode(None, w, qkv[:1], f[:1], beta[:1], gate[:1], ref, table[:1, 0], seq_lens[:1])
    got = kda_fused_decode(qkv, f, beta, gate, w.conv_weight, w.A_log, w.dt_bias, w.o_norm_weight, w.norm_eps,
                           rec, conv, table[:, 0], seq_lens)
    assert rel_err(got[:1], want) < 1e-5
    assert rel_err(rec[2], ref[0][2]) < 1e-5 and torch.equal(conv[2], ref[1][2])
    for s in (1, 3):
        assert torch.equal(rec[s], before[0][s]) and torch.equal(conv[s], before[1][s])


def test_refuses_a_head_dim_that_is_not_a_power_of_two():
    gen = torch.Generator().manual_seed(2)
    w = layer_weights(1, 24, 4, torch.float32, gen)
    rec, conv = states(2, 1, 24, 4, torch.float32, gen)
    qkv, f, beta, gate = step_inputs(1, 1, 24, torch.float32, gen)
    with pytest.raises(ValueError, match="head_dim 24 must be a power of two"):
        kda_fused_decode(qkv, f, beta, gate, w.conv_weight, w.A_log, w.dt_bias, w.o_norm_weight, w.norm_eps, rec,
                         conv, torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.ones(1, dtype=torch.int32))


@pytest.mark.gpu
@requires_kernel("triton_kda_fused_decode")
@pytest.mark.parametrize("history", [1, 1024, 32768])
def test_gpu_bf16_after_long_history(history):
    """Kimi-Linear-48B's heads (32 x 128, conv width 4), bf16, 8 requests whose states carry `history` tokens
    (built by the PyTorch recurrence), then 16 decode steps fused vs unfused: relative error < 1e-2 each step."""
    gen = torch.Generator().manual_seed(3)
    h, d, k, dtype, b = 32, 128, 4, torch.bfloat16, 8
    w = layer_weights(h, d, k, dtype, gen)
    rec, conv = states(b + 1, h, d, k, dtype, gen)
    hist = torch.randn(history, 3 * h * d, generator=gen).to(DEVICE, dtype)
    y, conv_1 = kda_ref.causal_conv(hist, None, w.conv_weight)
    q, kk, v = kda_ref.prepare_qkv(y, h, d)
    g = kda_ref.forget_gate(torch.randn(history, h * d, generator=gen).to(DEVICE), w.A_log, w.dt_bias, d)
    state = torch.zeros(h, d, d, device=DEVICE)
    kda_ref.delta_rule(q, kk, v, g, torch.rand(history, h, generator=gen).to(DEVICE), state)
    rec[1:] = state  # every request continues the same long history; conv states differ
    conv[1] = conv_1.to(dtype)
    slots = torch.arange(1, b + 1, dtype=torch.int32, device=DEVICE)
    ref = (rec.clone(), conv.clone())
    for step in range(16):
        qkv, f, beta, gate = step_inputs(b, h, d, dtype, gen)
        seq_lens = torch.full((b,), history + step + 1, dtype=torch.int32, device=DEVICE)
        want = KDAImpl.forward_decode(None, w, qkv, f, beta, gate, ref, slots, seq_lens)
        got = kda_fused_decode(qkv, f, beta, gate, w.conv_weight, w.A_log, w.dt_bias, w.o_norm_weight, w.norm_eps,
                               rec, conv, slots, seq_lens)
        assert rel_err(got, want) < 1e-2, step
        assert torch.equal(conv, ref[1]), step
        assert rel_err(rec, ref[0]) < 2e-3, step


@pytest.mark.gpu
@requires_kernel("triton_kda_fused_decode")
@pytest.mark.parametrize("history", [1, 4096])
def test_gpu_bf16_gdn_decode(history):
    """Qwen3.5 / 3.6's GDN heads (16 key heads read by 32 value heads, 128 x 128), bf16, 8 requests whose states
    carry `history` steps (the unfused chain), then 16 decode steps fused vs unfused: relative error < 1e-2."""
    gen = torch.Generator().manual_seed(5)
    b, dtype = 8, torch.bfloat16
    w, cache = gdn_case(b, 16, 32, 128, 128, 4, dtype, gen, num_slots=b + 1)
    slots = torch.arange(1, b + 1, dtype=torch.int32, device=DEVICE)
    cache[0].mul_(0.1 if history > 1 else 0.0)  # a history's state: small random, or none
    ref = tuple(c.clone() for c in cache)
    for step in range(16):
        qkv, f, beta, gate = gdn_step(b, w, gen, dtype)
        seq_lens = torch.full((b,), history + step + 1, dtype=torch.int32, device=DEVICE)
        want = KDAImpl.forward_decode(None, w, qkv, f, beta, gate, ref, slots, seq_lens)
        got = fused(w, qkv, f, beta, gate, cache, slots, seq_lens)
        assert rel_err(got, want) < 1e-2, step
        assert torch.equal(cache[1], ref[1]), step
        assert rel_err(cache[0], ref[0]) < 2e-3, step
