"""Triton ops vs the plain PyTorch references in kestrel/attention/ops/reference.py.

Runs on CUDA, or on the CPU under the Triton interpreter (TRITON_INTERPRET=1) with tiny shapes; skips
otherwise. References run on float32 copies of the same inputs; the error measure is ||out-ref|| / ||ref||.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402

_ok, _why = gates.triton_runnable()
pytestmark = pytest.mark.skipif(not _ok, reason=_why)

if _ok:
    from kestrel.attention.ops import reference as ref
    from kestrel.attention.ops import triton_attention as ta

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16] + ([] if torch.cuda.is_available() else [torch.float32])
TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def rel_err(out, expect):
    out, expect = out.double(), expect.double()
    assert torch.isfinite(out).all(), "non-finite values in output"
    return ((out - expect).norm() / expect.norm().clamp_min(1e-30)).item()


def make_cache(num_blocks, page, hkv, d, dtype, gen):
    k = torch.randn(num_blocks, page, hkv, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(num_blocks, page, hkv, d, generator=gen).to(DEVICE, dtype)
    return k, v


def make_block_tables(seq_lens, page, gen):
    """Shuffled, disjoint block ids per sequence; one spare block so id 0 is not always the first."""
    need = [max(1, -(-s // page)) for s in seq_lens]
    width = max(need)
    total = sum(need) + 1
    perm = torch.randperm(total, generator=gen)
    bt = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i : i + n]
        i += n
    return bt.to(DEVICE), total


def f32(*ts):
    return [t.float() for t in ts]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [16, 32])
def test_reshape_and_cache(dtype, page):
    gen = torch.Generator().manual_seed(1)
    T, hkv, d, nb = 13, 2, 64, 4
    key = torch.randn(T, hkv, d, generator=gen).to(DEVICE, dtype)
    value = torch.randn(T, hkv, d, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(nb * page, generator=gen)[:T].to(torch.int64)
    slots[3] = -1
    slots[7] = -1
    slots = slots.to(DEVICE)
    kc, vc = make_cache(nb, page, hkv, d, dtype, gen)
    kr, vr = kc.clone(), vc.clone()
    ta.reshape_and_cache(key, value, kc, vc, slots)
    ref.reshape_and_cache_ref(key, value, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("prefix", [0, 17])
@pytest.mark.parametrize("page", [16, 32])
def test_prefill_attention(dtype, d, group, prefix, page):
    gen = torch.Generator().manual_seed(2)
    hkv = 2
    hq = hkv * group
    q_lens = [9, 1, 20]
    seq_lens = [n + prefix for n in q_lens]
    seq_lens[1] += 3  # a different prefix for one sequence
    bt, nb = make_block_tables(seq_lens, page, gen)
    kc, vc = make_cache(nb, page, hkv, d, dtype, gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(DEVICE, dtype)
    scale = d ** -0.5
    out = torch.full_like(q, float("nan"))
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16} if DEVICE == "cpu" else None
    ta.prefill_attention(q, kc, vc, bt, qsl, sl, scale, out=out, max_query_len=max(q_lens), _config=cfg)
    expect = ref.prefill_attention_ref(*f32(q, kc, vc), bt, qsl, sl, scale)
    assert rel_err(out, expect) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("splits", [1, 4, "4-separate-reduce", "64-min-split-256"])
def test_decode_attention(dtype, d, group, page, splits):
    gen = torch.Generator().manual_seed(3)
    hkv = 2
    hq = hkv * group
    seq_lens = [37, 0, 1, 70]  # 0 = a padding row
    if splits == "64-min-split-256":  # a graph-sized launch: 600 tokens use 3 of 64 splits, the rest 1
        seq_lens = [37, 0, 600, 1]
    bt, nb = make_block_tables(seq_lens, page, gen)
    kc, vc = make_cache(nb, page, hkv, d, dtype, gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(DEVICE, dtype)
    scale = d ** -0.5
    out = torch.full_like(q, float("nan"))
    cfg = {"BLOCK_N": 16} if DEVICE == "cpu" else {}
    cfg["MIN_SPLIT"] = 16  # short contexts here: let every launched split hold tokens
    if splits == "4-separate-reduce":  # the merge in a second kernel instead of the last split's program
        splits, cfg = 4, {**cfg, "FUSED_REDUCE": False}
    elif splits == "64-min-split-256":
        splits, cfg = 64, {**cfg, "MIN_SPLIT": 256}
    ta.decode_attention(q, kc, vc, bt, sl, scale, out=out, num_splits=splits, _config=cfg)
    expect = ref.decode_attention_ref(*f32(q, kc, vc), bt, sl, scale)
    assert torch.all(out[1] == 0)
    if DEVICE == "cuda" and splits > 1:
        assert int(ta.tile_counters(q.device).abs().sum()) == 0  # counters reset for the next launch
    assert rel_err(out, expect) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_no_dot_variant(dtype):
    gen = torch.Generator().manual_seed(4)
    seq_lens = [33, 5]
    bt, nb = make_block_tables(seq_lens, 16, gen)
    kc, vc = make_cache(nb, 16, 2, 64, dtype, gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, 64, generator=gen).to(DEVICE, dtype)
    out = ta.decode_attention(q, kc, vc, bt, sl, 0.125, num_splits=2,
                              _config={"USE_DOT": False, "BLOCK_N": 16, "MIN_SPLIT": 16})
    expect = ref.decode_attention_ref(*f32(q, kc, vc), bt, sl, 0.125)
    assert rel_err(out, expect) < TOL[dtype]


def test_choose_num_splits_depends_on_shapes_only():
    assert ta.choose_num_splits(256, 8, 32768, 132) == 1
    assert ta.choose_num_splits(1, 8, 32768, 132) == 64
    assert ta.choose_num_splits(1, 8, 300, 132) == 1
    assert ta.choose_num_splits(64, 8, 4096, 132) == 1
    assert ta.choose_num_splits(16, 8, 4096, 132) == 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 96, generator=gen).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(96, generator=gen)).to(DEVICE, dtype)
    r = torch.randn(5, 96, generator=gen).to(DEVICE, dtype) if with_residual else None
    got = ta.rms_norm(x, w, 1e-6, residual=r)
    expect = ref.rms_norm_ref(x, w, 1e-6, residual=r)
    if with_residual:
        # exact on the GPU; the CPU interpreter rounds fp32 -> bf16 toward zero, so allow one rounding there
        assert rel_err(got[1], expect[1]) < (1e-6 if DEVICE == "cuda" else TOL[dtype])
        got, expect = got[0], expect[0]
    assert rel_err(got, expect) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(7, 2 * 80, generator=gen).to(DEVICE, dtype)
    assert rel_err(ta.silu_and_mul(x), ref.silu_and_mul_ref(x)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [64, 32])
def test_rotary_embedding(dtype, is_neox, rot_dim):
    gen = torch.Generator().manual_seed(7)
    T, hq, hkv, d, max_pos = 6, 4, 2, 64, 50
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    ang = torch.arange(max_pos).float()[:, None] * inv[None, :]
    cache = torch.cat([ang.cos(), ang.sin()], dim=-1).to(DEVICE)
    pos = torch.randint(0, max_pos, (T,), generator=gen).to(DEVICE)
    # q and k as strided views of one fused qkv tensor, the way the model hands them over
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=gen).to(DEVICE, dtype)
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(T, hkv, d)
    qe, ke = ref.rotary_embedding_ref(pos, q, k, cache, rot_dim, is_neox)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    ta.rotary_embedding_(pos, q, k, cache, rot_dim, is_neox)
    assert rel_err(q, qe) < TOL[dtype] and rel_err(k, ke) < TOL[dtype]
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("d,hq,hkv", [(64, 4, 2), (128, 16, 8), (256, 8, 1)])
def test_qk_norm_rope_cache_equals_the_unfused_chain(dtype, with_norm, d, hq, hkv):
    """The fused prologue (q/k RMSNorm per head, rotary, cache write) against rms_norm -> rotary -> cache write."""
    from kestrel.kernels.triton_ops.fused_ops import qk_norm_rope_cache

    gen = torch.Generator().manual_seed(11)
    T, max_pos, page, blocks = 9, 300, 16, 8
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(max_pos).float()[:, None] * inv[None, :]
    cache = torch.cat([ang.cos(), ang.sin()], dim=-1).to(DEVICE)
    pos = torch.randint(0, max_pos, (T,), generator=gen).to(DEVICE)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=gen).to(DEVICE, dtype)
    qw = (1 + 0.1 * torch.randn(d, generator=gen)).to(DEVICE, dtype) if with_norm else None
    kw = (1 + 0.1 * torch.randn(d, generator=gen)).to(DEVICE, dtype) if with_norm else None
    slots = torch.randperm(blocks * page, generator=gen)[:T].to(DEVICE)
    slots[2] = -1  # padding: nothing written
    kc, vc = (torch.full((blocks, page, hkv, d), 7.0, dtype=dtype, device=DEVICE) for _ in range(2))
    kc_ref, vc_ref = kc.clone(), vc.clone()

    q_ref = qkv[:, : hq * d].reshape(T, hq, d).clone()
    k_ref = qkv[:, hq * d:(hq + hkv) * d].reshape(T, hkv, d).clone()
    v_ref = qkv[:, (hq + hkv) * d:].reshape(T, hkv, d).clone()
    if with_norm:
        q_ref, k_ref = ta.rms_norm(q_ref, qw, 1e-6), ta.rms_norm(k_ref, kw, 1e-6)
    ta.rotary_embedding_(pos, q_ref, k_ref, cache, d, True)
    ta.reshape_and_cache(k_ref, v_ref, kc_ref, vc_ref, slots)

    q = qk_norm_rope_cache(qkv, pos, cache, hq, hkv, d, kc, vc, slots, qw, kw, 1e-6)
    assert rel_err(q, q_ref) < 4e-3
    assert rel_err(kc, kc_ref) < 4e-3 and torch.equal(vc, vc_ref)
    assert (kc == 7.0).sum() == (kc_ref == 7.0).sum()  # the padding slot stayed untouched
