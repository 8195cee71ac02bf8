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

from tests.attention.paged_cases import paged_case, poison_outside_window, rope_cos_sin, unfused_prologue  # noqa: E402

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
@pytest.mark.parametrize("splits", [1, 4])
def test_head_dim_512_prefill_and_decode(dtype, splits):
    """Heads of 512 (Gemma 4's global layers, 8 query heads a KV head): on the GPU the default tiles of that size
    (prefill 32 x 32 on 8 warps, decode 32-token tiles), the same kernels as every head size."""
    gen = torch.Generator().manual_seed(7)
    d, hkv, hq, page = 512, 1, 8, 16
    q_lens, seq_lens = [9, 20], [30, 20]
    bt, nb = make_block_tables(seq_lens, page, gen)
    kc, vc = make_cache(nb, page, hkv, d, dtype, gen)
    qsl = torch.tensor([0, 9, 29], dtype=torch.int32, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(29, hq, d, generator=gen).to(DEVICE, dtype)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16} if DEVICE == "cpu" else None
    out = ta.prefill_attention(q, kc, vc, bt, qsl, sl, 1.0 / d, max_query_len=20, _config=cfg)
    assert rel_err(out, ref.prefill_attention_ref(*f32(q, kc, vc), bt, qsl, sl, 1.0 / d)) < TOL[dtype]
    qd = q[[8, 28]]  # each sequence's last token, as a decode step
    dcfg = {"BLOCK_N": 16, "MIN_SPLIT": 16} if DEVICE == "cpu" else {"MIN_SPLIT": 16}
    out = ta.decode_attention(qd, kc, vc, bt, sl, 1.0 / d, num_splits=splits, _config=dcfg)
    assert rel_err(out, ref.decode_attention_ref(*f32(qd, kc, vc), bt, sl, 1.0 / d)) < TOL[dtype]


def test_prefill_attention_narrow_query_and_output():
    """MLA's dense prefill: a query narrower than K/V (a view whose following lanes hold NaN: none may be read)
    and an output of the first lanes only (a view of a NaN buffer: nothing else written) equal the padded run.
    As expand_kv leaves them: the keys' pad lanes zero; NaN in the values' pad lanes and in the rows past each
    context's end (unwritten memory) reaches no stored output."""
    gen = torch.Generator().manual_seed(5)
    d, dq, do, page, q_lens, seq_lens = 64, 48, 24, 16, [9, 20], [30, 20]
    bt, nb = make_block_tables(seq_lens, page, gen)
    kc, vc = make_cache(nb, page, 2, d, torch.float32, gen)
    kc[..., dq:] = 0
    vc[..., do:] = float("nan")
    for b, s in enumerate(seq_lens):
        for p in range(s, -(-s // page) * page):
            kc[bt[b, p // page], p % page] = vc[bt[b, p // page], p % page] = float("nan")
    qsl = torch.tensor([0, 9, 29], dtype=torch.int32, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(29, 2, d, generator=gen).to(DEVICE)
    q[..., dq:] = float("nan")
    out = torch.full((29, 2, d), float("nan"), device=DEVICE)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16} if DEVICE == "cpu" else None
    ta.prefill_attention(q[..., :dq], kc, vc, bt, qsl, sl, 0.1, out=out[..., :do], max_query_len=20, _config=cfg)
    padded = ta.prefill_attention(torch.nn.functional.pad(q[..., :dq], (0, d - dq)), kc, vc, bt, qsl, sl, 0.1,
                                  max_query_len=20, _config=cfg)
    assert torch.equal(out[..., :do], padded[..., :do]) and out[..., do:].isnan().all()


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


# ---- sliding window and soft-capping (Gemma 2/3, Mistral) ------------------------------------------------
WINDOW_DTYPES = [torch.bfloat16] + ([torch.float16] if torch.cuda.is_available() else [])
WD = 64 if torch.cuda.is_available() else 32  # head dim (small under the interpreter)
# (page, BLOCK_N): a tile inside a page, not at its start; a tile over two pages (the lower one may be freed)
PAGE_TILES = [(32, 16), (16, 32)]


def _poisoned_equal_and_close(run, q, kc, vc, bt, q_lens, seq_lens, window, expect, dtype, chunk=0):
    """run(kc, vc, bt) -> out. The kernel on clean inputs matches the reference; with everything below each
    request's window turned into NaN (and some table entries pointing at a NaN null block) the output is finite
    and bit-identical: nothing outside the window is loaded."""
    clean = run(kc, vc, bt)
    assert rel_err(clean, expect) < TOL[dtype]
    pkc, pvc, pbt = poison_outside_window(kc, vc, bt, q_lens, seq_lens, window, chunk)
    poisoned = run(pkc, pvc, pbt)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)


@pytest.mark.parametrize("dtype", WINDOW_DTYPES)
@pytest.mark.parametrize("window", [1, 5, 24, 40, 1000])  # 1000: wider than every context
@pytest.mark.parametrize("page,block_n", PAGE_TILES)
def test_prefill_sliding_window(dtype, window, page, block_n):
    """A fresh prompt, chunks after cached prefixes and a one-token chunk; 16-row query tiles, so that windows
    of 24 and 40 give window-edge tiles, fully visible middle tiles and diagonal tiles in one query block."""
    gen = torch.Generator().manual_seed(8)
    q_lens, prefixes = [33, 9, 1, 20], [0, 40, 57, 18]
    seq_lens = [p + n for p, n in zip(prefixes, q_lens)]
    q, kc, vc, bt, qsl, sl = paged_case(q_lens, seq_lens, page, 4, 2, WD, dtype, gen, DEVICE)
    scale = WD ** -0.5
    cfg = {"BLOCK_M": 16, "BLOCK_N": block_n}

    def run(k, v, table):
        out = torch.full_like(q, float("nan"))
        return ta.prefill_attention(q, k, v, table, qsl, sl, scale, out=out, max_query_len=max(q_lens),
                                    sliding_window=window, _config=cfg)

    expect = ref.prefill_attention_ref(*f32(q, kc, vc), bt, qsl, sl, scale, sliding_window=window)
    _poisoned_equal_and_close(run, q, kc, vc, bt, q_lens, seq_lens, window, expect, dtype)


@pytest.mark.parametrize("dtype", WINDOW_DTYPES)
@pytest.mark.parametrize("window", [1, 16, 50, 4096])  # 4096: wider than every context
@pytest.mark.parametrize("page,block_n", PAGE_TILES)
@pytest.mark.parametrize("splits", [1, "4-separate-reduce", "8-min-split-32"])
def test_decode_sliding_window(dtype, window, page, block_n, splits):
    """Long contexts that the window cuts: the splits divide the window's keys only (a window of 50 in 4 splits
    of >= 16 tokens; an 8-split launch sized for long contexts of which 2 splits of >= 32 tokens hold it)."""
    gen = torch.Generator().manual_seed(9)
    seq_lens = [300, 0, 1, 37, 129]  # 0 = a padding row
    q, kc, vc, bt, _, sl = paged_case([1] * len(seq_lens), seq_lens, page, 8, 2, WD, dtype, gen, DEVICE)
    scale = WD ** -0.5
    cfg = {"BLOCK_N": block_n, "MIN_SPLIT": 16}
    if splits == "4-separate-reduce":
        splits, cfg = 4, {**cfg, "FUSED_REDUCE": False}
    elif splits == "8-min-split-32":
        splits, cfg = 8, {**cfg, "MIN_SPLIT": 32}

    def run(k, v, table):
        out = torch.full_like(q, float("nan"))
        return ta.decode_attention(q, k, v, table, sl, scale, out=out, num_splits=splits, sliding_window=window,
                                   _config=cfg)

    expect = ref.decode_attention_ref(*f32(q, kc, vc), bt, sl, scale, sliding_window=window)
    _poisoned_equal_and_close(run, q, kc, vc, bt, [1] * len(seq_lens), seq_lens, window, expect, dtype)
    assert torch.all(run(kc, vc, bt)[1] == 0)


# ---- chunked local attention (Llama 4): keys floor(p / C) * C .. p -----------------------------------------
@pytest.mark.parametrize("chunk", [8, 24, 1000])  # 1000: longer than every context
@pytest.mark.parametrize("page,block_n", PAGE_TILES)
def test_prefill_chunked(chunk, page, block_n):
    """The sliding-window test's batch (fresh prompt, chunks after cached prefixes, a one-token chunk) in 16-row
    query tiles: chunk starts inside a query tile and inside a key tile, whole chunks below the first query's."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(18)
    q_lens, prefixes = [33, 9, 1, 20], [0, 40, 57, 18]
    seq_lens = [p + n for p, n in zip(prefixes, q_lens)]
    q, kc, vc, bt, qsl, sl = paged_case(q_lens, seq_lens, page, 4, 2, WD, dtype, gen, DEVICE)
    scale = WD ** -0.5

    def run(k, v, table):
        out = torch.full_like(q, float("nan"))
        return ta.prefill_attention(q, k, v, table, qsl, sl, scale, out=out, max_query_len=max(q_lens),
                                    attention_chunk_size=chunk, _config={"BLOCK_M": 16, "BLOCK_N": block_n})

    expect = ref.prefill_attention_ref(*f32(q, kc, vc), bt, qsl, sl, scale, chunk_size=chunk)
    _poisoned_equal_and_close(run, q, kc, vc, bt, q_lens, seq_lens, 0, expect, dtype, chunk)


@pytest.mark.parametrize("chunk", [16, 50])
@pytest.mark.parametrize("page,block_n", PAGE_TILES)
@pytest.mark.parametrize("splits", [1, "4-separate-reduce"])
def test_decode_chunked(chunk, page, block_n, splits):
    """Contexts that end early, mid and late in their chunk (position 299 of chunk 16: 12 keys; 36 of 50: 37);
    the splits divide the chunk's keys only; a padding row gives zeros."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(19)
    seq_lens = [300, 0, 1, 37, 129]
    q, kc, vc, bt, _, sl = paged_case([1] * len(seq_lens), seq_lens, page, 8, 2, WD, dtype, gen, DEVICE)
    scale = WD ** -0.5
    cfg = {"BLOCK_N": block_n, "MIN_SPLIT": 16}
    if splits == "4-separate-reduce":
        splits, cfg = 4, {**cfg, "FUSED_REDUCE": False}

    def run(k, v, table):
        out = torch.full_like(q, float("nan"))
        return ta.decode_attention(q, k, v, table, sl, scale, out=out, num_splits=splits,
                                   attention_chunk_size=chunk, _config=cfg)

    expect = ref.decode_attention_ref(*f32(q, kc, vc), bt, sl, scale, chunk_size=chunk)
    _poisoned_equal_and_close(run, q, kc, vc, bt, [1] * len(seq_lens), seq_lens, 0, expect, dtype, chunk)
    assert torch.all(run(kc, vc, bt)[1] == 0)


def test_window_and_chunk_together_are_refused():
    q, kc, vc, bt, _, sl = paged_case([1], [4], 16, 2, 2, WD, torch.bfloat16, torch.Generator().manual_seed(0),
                                      DEVICE)
    with pytest.raises(ValueError, match="sliding window and chunked"):
        ta.decode_attention(q, kc, vc, bt, sl, 0.1, sliding_window=4, attention_chunk_size=8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("op", ["prefill", "decode", "decode-no-dot"])
def test_softcap(dtype, window, op):
    """Soft-capped logits (Gemma 2: cap * tanh(s / cap)), alone and with a window; queries scaled up so that
    most logits sit beyond the cap (the capped result differs from the plain one)."""
    gen = torch.Generator().manual_seed(10)
    cap, scale = 5.0, WD ** -0.5
    if op == "prefill":
        q_lens, seq_lens = [20, 9], [20, 49]
    else:
        q_lens, seq_lens = [1, 1, 1], [70, 5, 33]
    q, kc, vc, bt, qsl, sl = paged_case(q_lens, seq_lens, 16, 4, 2, WD, dtype, gen, DEVICE)
    q = (4 * q.float()).to(dtype)
    opts = {"sliding_window": window}
    if op == "prefill":
        out = ta.prefill_attention(q, kc, vc, bt, qsl, sl, scale, max_query_len=20, softcap=cap,
                                   _config={"BLOCK_M": 16, "BLOCK_N": 16}, **opts)
    else:
        cfg = {"BLOCK_N": 16, "MIN_SPLIT": 16, "USE_DOT": op == "decode"}
        out = ta.decode_attention(q, kc, vc, bt, sl, scale, num_splits=2, softcap=cap, _config=cfg, **opts)
    expect = ref.paged_attention_ref(*f32(q, kc, vc), bt, qsl, sl, scale, softcap=cap, **opts)
    plain = ref.paged_attention_ref(*f32(q, kc, vc), bt, qsl, sl, scale, **opts)
    assert rel_err(out, expect) < TOL[dtype]
    assert rel_err(plain, expect) > 10 * TOL[dtype]


def test_window_and_cap_arguments_are_checked():
    q, kc, vc, bt, qsl, sl = paged_case([1], [5], 16, 2, 2, 64, torch.float16, torch.Generator(), DEVICE)
    with pytest.raises(ValueError, match="sliding_window"):
        ta.decode_attention(q, kc, vc, bt, sl, 0.1, sliding_window=-2)
    with pytest.raises(ValueError, match="softcap"):
        ta.prefill_attention(q, kc, vc, bt, qsl, sl, 0.1, softcap=-1.0)


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
    cache = rope_cos_sin(d, max_pos, DEVICE)
    pos = torch.randint(0, max_pos, (T,), generator=gen).to(DEVICE)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=gen).to(DEVICE, dtype)
    qw = (1 + 0.1 * torch.randn(d, generator=gen)).to(DEVICE, dtype) if with_norm else None
    kw = (1 + 0.1 * torch.randn(d, generator=gen)).to(DEVICE, dtype) if with_norm else None
    slots = torch.randperm(blocks * page, generator=gen)[:T].to(DEVICE)
    slots[2] = -1  # padding: nothing written
    kc, vc = (torch.full((blocks, page, hkv, d), 7.0, dtype=dtype, device=DEVICE) for _ in range(2))
    kc_ref, vc_ref = kc.clone(), vc.clone()

    q_ref, k_ref, v_ref = unfused_prologue(qkv, pos, cache, hq, hkv, d, qw, kw)
    ta.reshape_and_cache(k_ref, v_ref, kc_ref, vc_ref, slots)

    q = qk_norm_rope_cache(qkv, pos, cache, hq, hkv, d, kc, vc, slots, qw, kw, 1e-6)
    assert rel_err(q, q_ref) < 4e-3
    assert rel_err(kc, kc_ref) < 4e-3 and torch.equal(vc, vc_ref)
    assert (kc == 7.0).sum() == (kc_ref == 7.0).sum()  # the padding slot stayed untouched
