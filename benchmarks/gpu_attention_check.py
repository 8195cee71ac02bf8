"""H200 check + timing of the Triton attention ops (kestrel/attention/ops) in one run.

1. correctness vs the float32 PyTorch references (kestrel/attention/ops/reference.py) across block sizes,
   GQA ratios, head dims, dtypes, prefix lengths and decode contexts up to 32k (shuffled block ids);
2. timings: decode at batch 256 x ~1000 context (Qwen3-0.6B shape: 16 q heads, 8 kv heads, head dim 128),
   decode at batch 1 x 32k, prefill 8 x 1024, with small sweeps of tile sizes / warps / stages / splits,
   as achieved GB/s (KV bytes read / time) against the measured device copy bandwidth;
3. section `window`: sliding-window (Gemma 3 / Mistral) and soft-capped (Gemma 2) attention: correctness vs the
   reference with everything below each window poisoned with NaN (nothing out of the window may be read), a
   CUDA-graph replay, and timings of windowed decode / prefill beside the same shapes without a window.

Usage: python -m benchmarks.gpu_attention_check [--quick] [--budget SECONDS] [--sections smoke,time,check,window]
Writes the full log to $OUT/gpu_attention_check.log when OUT is set; prints a compact table last.
"""
from __future__ import annotations

import argparse
import math
import os
import time
import traceback

import torch
import triton
from triton.testing import do_bench

from kestrel.attention.ops import reference as ref
from kestrel.attention.ops import triton_attention as ta

DEV = "cuda"
T0 = time.time()
LOG = []
_out_dir = os.environ.get("OUT")


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)


def flush_log():
    if _out_dir:
        with open(os.path.join(_out_dir, "gpu_attention_check.log"), "w") as f:
            f.write("\n".join(LOG) + "\n")


def elapsed():
    return time.time() - T0


def rel_err(out, expect):
    out, expect = out.double(), expect.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - expect).norm() / expect.norm().clamp_min(1e-30)).item()


def block_tables_for(seq_lens, page, gen, spare=3):
    need = [max(1, -(-s // page)) for s in seq_lens]
    total = sum(need) + spare
    perm = torch.randperm(total, generator=gen)
    bt = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i : i + n]
        i += n
    return bt.to(DEV), total


def rand_cache(nb, page, hkv, d, dtype):
    return (torch.randn(nb, page, hkv, d, device=DEV, dtype=dtype),
            torch.randn(nb, page, hkv, d, device=DEV, dtype=dtype))


TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
RESULTS = []  # (op, case, err, ok)


def record(op, case, err, tol):
    ok = err < tol
    RESULTS.append((op, case, err, ok))
    log(f"  {op:9s} {case:48s} err={err:.2e} {'PASS' if ok else 'FAIL'}")


def guarded(op, case, fn, *args):
    try:
        fn(*args)
    except Exception as e:
        RESULTS.append((op, case + " ERROR", float("inf"), False))
        log(f"  {op} {case}: ERROR {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        log("    " + traceback.format_exc().strip().splitlines()[-3][:200])


# ------------------------------------------------------------------------------------------------------------
def check_reshape_and_cache(gen):
    for dtype in (torch.bfloat16, torch.float16):
        for page in (16, 64):
            for hkv, d in ((1, 64), (8, 128), (2, 256)):
                T, nb = 300, 40
                key = torch.randn(T, hkv, d, device=DEV, dtype=dtype)
                # value as a strided slice of a wider tensor (like a fused qkv output)
                wide = torch.randn(T, hkv * 3, d, device=DEV, dtype=dtype)
                value = wide[:, hkv : 2 * hkv]
                slots = torch.randperm(nb * page, generator=gen)[:T].to(torch.int64)
                slots[::7] = -1
                slots = slots.to(DEV)
                kc, vc = rand_cache(nb, page, hkv, d, dtype)
                kr, vr = kc.clone(), vc.clone()
                ta.reshape_and_cache(key, value, kc, vc, slots)
                ref.reshape_and_cache_ref(key, value, kr, vr, slots)
                torch.cuda.synchronize()
                err = 0.0 if (torch.equal(kc, kr) and torch.equal(vc, vr)) else 1.0
                record("cache", f"{str(dtype)[6:]} page={page} hkv={hkv} d={d}", err, 0.5)


def check_prefill(gen, pages, groups, dims, dtypes, prefixes=(0, 100, 1000)):
    hkv = 2
    for dtype in dtypes:
        for page in pages:
            for d in dims:
                for g in groups:
                    guarded("prefill", f"{str(dtype)[6:]} page={page} d={d} gqa={g}", _prefill_case,
                            gen, dtype, page, d, g, hkv, prefixes)


def _prefill_case(gen, dtype, page, d, g, hkv, prefixes):
    hq = hkv * g
    # one varlen batch: each prefix length with a few query lengths, plus a 1-token chunk
    q_lens, seq_lens = [], []
    for p in prefixes:
        for ql in (300, 77):
            q_lens.append(ql)
            seq_lens.append(p + ql)
    q_lens.append(1)
    seq_lens.append(555)
    bt, nb = block_tables_for(seq_lens, page, gen)
    kc, vc = rand_cache(nb, page, hkv, d, dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    scale = d ** -0.5
    ta.prefill_attention(q, kc, vc, bt, qsl, sl, scale, out=out, max_query_len=max(q_lens))
    expect = ref.prefill_attention_ref(q.float(), kc.float(), vc.float(), bt, qsl, sl, scale)
    torch.cuda.synchronize()
    # error per prefix length (max over its sequences); the last sequence is the 1-token chunk
    errs = {}
    qs = qsl.tolist()
    for i in range(len(q_lens)):
        e = rel_err(out[qs[i] : qs[i + 1]], expect[qs[i] : qs[i + 1]])
        key = seq_lens[i] - q_lens[i] if i < len(q_lens) - 1 else "chunk1"
        errs[key] = max(errs.get(key, 0.0), e)
    for key, e in errs.items():
        record("prefill", f"{str(dtype)[6:]} page={page} d={d} gqa={g} prefix={key}", e, TOL[dtype])


def check_decode(gen, pages, groups, dims, dtypes, split_options=(None, 1)):
    hkv = 2
    seq_lens = [0, 1, 17, 1000, 4097, 32768, 777, 0, 2049]
    for dtype in dtypes:
        for page in pages:
            for d in dims:
                for g in groups:
                    guarded("decode", f"{str(dtype)[6:]} page={page} d={d} gqa={g}", _decode_case,
                            gen, dtype, page, d, g, hkv, seq_lens, split_options)


def _decode_case(gen, dtype, page, d, g, hkv, seq_lens, split_options):
    hq = hkv * g
    bt, nb = block_tables_for(seq_lens, page, gen)
    kc, vc = rand_cache(nb, page, hkv, d, dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = torch.randn(len(seq_lens), hq, d, device=DEV, dtype=dtype)
    scale = d ** -0.5
    expect = ref.decode_attention_ref(q.float(), kc.float(), vc.float(), bt, sl, scale)
    for splits in split_options:
        out = torch.full_like(q, float("nan"))
        ta.decode_attention(q, kc, vc, bt, sl, scale, out=out, num_splits=splits)
        torch.cuda.synchronize()
        zero_ok = bool((out[0] == 0).all() and (out[7] == 0).all())
        err = rel_err(out, expect) if zero_ok else float("inf")
        worst = max(rel_err(out[i], expect[i]) for i in range(len(seq_lens)) if seq_lens[i])
        ns = splits or ta.choose_num_splits(len(seq_lens), hkv, bt.shape[1] * page)
        record("decode", f"{str(dtype)[6:]} page={page} d={d} gqa={g} splits={ns}",
               max(err, worst), TOL[dtype])


def check_fused():
    for dtype in (torch.bfloat16, torch.float16):
        for n in (1024, 4096):
            x = torch.randn(257, n, device=DEV, dtype=dtype)
            w = 1 + 0.1 * torch.randn(n, device=DEV, dtype=dtype)
            r = torch.randn(257, n, device=DEV, dtype=dtype)
            record("rmsnorm", f"{str(dtype)[6:]} n={n}", rel_err(ta.rms_norm(x, w, 1e-6), ref.rms_norm_ref(x, w, 1e-6)),
                   TOL[dtype])
            o, nr = ta.rms_norm(x, w, 1e-6, residual=r)
            eo, enr = ref.rms_norm_ref(x, w, 1e-6, residual=r)
            record("rmsnorm", f"{str(dtype)[6:]} n={n} +residual (res exact)",
                   max(rel_err(o, eo), 0.0 if torch.equal(nr, enr) else 1.0), TOL[dtype])
            xs = torch.randn(257, 2 * n, device=DEV, dtype=dtype)
            record("silu_mul", f"{str(dtype)[6:]} I={n}", rel_err(ta.silu_and_mul(xs), ref.silu_and_mul_ref(xs)),
                   TOL[dtype])
        for is_neox in (True, False):
            for d, rot in ((128, 128), (64, 32)):
                T, hq, hkv = 300, 16, 8
                inv = 1.0 / (1e6 ** (torch.arange(0, rot, 2, device=DEV).float() / rot))
                ang = torch.arange(40000, device=DEV).float()[:, None] * inv[None, :]
                cache = torch.cat([ang.cos(), ang.sin()], -1)
                pos = torch.randint(0, 40000, (T,), device=DEV)
                qkv = torch.randn(T, (hq + 2 * hkv) * d, device=DEV, dtype=dtype)
                q = qkv[:, : hq * d].view(T, hq, d)
                k = qkv[:, hq * d : (hq + hkv) * d].view(T, hkv, d)
                qe, ke = ref.rotary_embedding_ref(pos, q, k, cache, rot, is_neox)
                ta.rotary_embedding_(pos, q, k, cache, rot, is_neox)
                record("rope", f"{str(dtype)[6:]} neox={is_neox} d={d} rot={rot}",
                       max(rel_err(q, qe), rel_err(k, ke)), TOL[dtype])


# ------------------------------------------------------------------------------------------------------------
def poison_outside_window(kc, vc, bt, q_lens, seq_lens, window):
    """Copies with every K/V slot below each request's window (that of its first query) set to NaN, and the
    table entries of wholly out-of-window blocks of every other request pointed at a NaN null block (a spare)."""
    kc, vc, bt = kc.clone(), vc.clone(), bt.clone()
    page = kc.shape[1]
    null = sorted(set(range(kc.shape[0])) - set(bt.flatten().tolist()))[0]  # block_tables_for leaves spares
    kc[null] = float("nan")
    vc[null] = float("nan")
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        lo = max(0, seq_len - q_len - window + 1) if seq_len else 0
        if lo == 0:
            continue
        pos = torch.arange(lo, device=DEV)
        blocks = bt[b, pos // page].long()
        kc[blocks, pos % page] = float("nan")
        vc[blocks, pos % page] = float("nan")
        if b % 2 == 0:
            bt[b, : lo // page] = null
    return kc, vc, bt


def check_windowed(gen, dtypes=(torch.bfloat16, torch.float16), pages=(16, 64),
                   shapes=((4, 1, 256), (16, 8, 128), (8, 4, 256))):
    """Gemma 3 shapes (1B 4q/1kv/256, 27B 32q/16kv/128 ~ 16/8/128, 4B 8q/4kv/256); windows 1, 512, 1024, 4096 and
    soft-capping 50 (Gemma 2), with every key below the window NaN: outputs must stay finite and match."""
    for dtype in dtypes:
        for page in pages:
            for hq, hkv, d in shapes:
                for window, cap in ((512, 0.0), (1024, 0.0), (4096, 0.0), (1, 0.0), (1024, 50.0), (0, 50.0)):
                    case = f"{str(dtype)[6:]} page={page} {hq}/{hkv}/{d} W={window} cap={cap:g}"
                    guarded("win-dec", case, _windowed_decode_case, gen, dtype, page, hq, hkv, d, window, cap, case)
                    guarded("win-pre", case, _windowed_prefill_case, gen, dtype, page, hq, hkv, d, window, cap, case)


def _windowed_decode_case(gen, dtype, page, hq, hkv, d, window, cap, case):
    seq_lens = [0, 1, 17, 1000, 4097, 32768, 777, 0, 2049, 1025]
    bt, nb = block_tables_for(seq_lens, page, gen)
    kc, vc = rand_cache(nb, page, hkv, d, dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = torch.randn(len(seq_lens), hq, d, device=DEV, dtype=dtype) * (3.0 if cap else 1.0)
    scale = d ** -0.5
    pkc, pvc, pbt = poison_outside_window(kc, vc, bt, [1] * len(seq_lens), seq_lens, window) if window else (kc, vc, bt)
    expect = ref.decode_attention_ref(q.float(), kc.float(), vc.float(), bt, sl, scale, sliding_window=window,
                                      softcap=cap)
    for splits in (None, 1, 64):
        out = torch.full_like(q, float("nan"))
        ta.decode_attention(q, pkc, pvc, pbt, sl, scale, out=out, num_splits=splits, sliding_window=window,
                            softcap=cap)
        torch.cuda.synchronize()
        zero_ok = bool((out[0] == 0).all() and (out[7] == 0).all())
        worst = max(rel_err(out[i], expect[i]) for i in range(len(seq_lens)) if seq_lens[i])
        record("win-dec", f"{case} splits={splits or 'auto'}", worst if zero_ok else float("inf"), TOL[dtype])


def _windowed_prefill_case(gen, dtype, page, hq, hkv, d, window, cap, case):
    q_lens, seq_lens = [], []
    for prefix in (0, 100, 1000, 3000):
        for ql in (300, 77):
            q_lens.append(ql)
            seq_lens.append(prefix + ql)
    q_lens.append(1)
    seq_lens.append(2555)
    bt, nb = block_tables_for(seq_lens, page, gen)
    kc, vc = rand_cache(nb, page, hkv, d, dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=dtype) * (3.0 if cap else 1.0)
    scale = d ** -0.5
    pkc, pvc, pbt = poison_outside_window(kc, vc, bt, q_lens, seq_lens, window) if window else (kc, vc, bt)
    expect = ref.prefill_attention_ref(q.float(), kc.float(), vc.float(), bt, qsl, sl, scale, sliding_window=window,
                                       softcap=cap)
    out = torch.full_like(q, float("nan"))
    ta.prefill_attention(q, pkc, pvc, pbt, qsl, sl, scale, out=out, max_query_len=max(q_lens), sliding_window=window,
                         softcap=cap)
    torch.cuda.synchronize()
    qs = qsl.tolist()
    worst = max(rel_err(out[qs[i] : qs[i + 1]], expect[qs[i] : qs[i + 1]]) for i in range(len(q_lens)))
    record("win-pre", case, worst, TOL[dtype])


def windowed_graph_check(window=1024):
    """A windowed split decode captured in a CUDA graph: replay equals eager, also after the contexts grow."""
    q, kc, vc, bt, sl, _, _ = decode_setup(4, 3000, 5000, 16, hq=8, hkv=4, d=256)
    scale = 256 ** -0.5
    out = torch.empty_like(q)
    fn = lambda: ta.decode_attention(q, kc, vc, bt, sl, scale, out=out, num_splits=16,  # noqa: E731
                                     max_seq_len=bt.shape[1] * 16, sliding_window=window)
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ok = True
    for grow in (0, 7, 300):
        sl.add_(grow)
        sl.clamp_(max=bt.shape[1] * 16)
        fn()
        eager = out.clone()
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ok &= torch.equal(out, eager)
    log(f"  windowed decode cuda graph replay (W={window}, 16 splits) == eager: {ok}")
    RESULTS.append(("graph", f"windowed decode W={window} capture+replay == eager", 0.0 if ok else 1.0, ok))


def time_windowed(copy_bw, quick):
    """Windowed vs full attention on the same shapes: the windowed kernels read only the window's keys."""
    for name, (B, lo, hi, hq, hkv, d, window) in {
        "dec256 W512 g3-1b": (256, 800, 1200, 4, 1, 256, 512),
        "dec256 W1024 16/8/128": (256, 3000, 5000, 16, 8, 128, 1024),
        "dec1x32k W1024": (1, 32768, 32768, 8, 4, 256, 1024),
    }.items():
        setup = decode_setup(B, lo, hi, 16, hq=hq, hkv=hkv, d=d)
        q, kc, vc, bt, sl, kv_bytes, seq_lens = setup
        scale = d ** -0.5
        win_bytes = sum(min(s, window) for s in seq_lens) * hkv * d * 2 * kc.element_size()
        expect = ref.decode_attention_ref(q[:8].float(), kc.float(), vc.float(), bt[:8], sl[:8], scale,
                                          sliding_window=window)
        for label, w, nbytes in ((f"{name} full", 0, kv_bytes), (name, window, win_bytes)):
            out = torch.empty_like(q)
            fn = lambda: ta.decode_attention(q, kc, vc, bt, sl, scale, out=out, sliding_window=w)  # noqa: E731
            t = bench_graph(fn)
            err = rel_err(out[:8], expect) if w else 0.0
            gbs = nbytes / t / 1e9
            log(f"  {label:26s} {t * 1e6:8.1f} us {gbs:7.0f} GB/s {100 * gbs * 1e9 / copy_bw:5.1f}% err={err:.1e}")
            TIMINGS.append((label, "default", t * 1e6, gbs, 100 * gbs * 1e9 / copy_bw, ""))
            if w:
                RESULTS.append(("win-time", f"{label} vs reference", err, err < 1e-2))
        del setup
    hq, hkv, d, dtype = 8, 4, 256, torch.bfloat16
    for name, (B, L, prefix, window) in {"prefill 8x4096 W1024": (8, 4096, 0, 1024),
                                         "chunk 8x512+3584 W1024": (8, 512, 3584, 1024)}.items():
        gen = torch.Generator().manual_seed(2)
        seq_lens = [prefix + L] * B
        bt, nb = block_tables_for(seq_lens, 16, gen)
        kc, vc = rand_cache(nb, 16, hkv, d, dtype)
        q = torch.randn(B * L, hq, d, device=DEV, dtype=dtype)
        qsl = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=DEV)
        sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
        for label, w in ((f"{name} full", 0), (name, window)):
            out = torch.empty_like(q)
            fn = lambda: ta.prefill_attention(q, kc, vc, bt, qsl, sl, d ** -0.5, out=out, max_query_len=L,  # noqa
                                              sliding_window=w)
            t = bench(fn)
            log(f"  {label:26s} {t * 1e6:8.1f} us")
            TIMINGS.append((label, "default", t * 1e6, 0.0, 0.0, ""))
        if quick:
            break


# ------------------------------------------------------------------------------------------------------------
def bench(fn):
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e-3  # seconds


def bench_graph(fn, calls=20):
    """Time fn as the engine runs it: captured in a CUDA graph (no Python/launch overhead). Seconds per call."""
    fn()  # compile outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    t = do_bench(g.replay, warmup=25, rep=150, return_mode="median") * 1e-3
    del g
    return t / calls


def copy_bandwidth():
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device=DEV).random_(0, 255)
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a))
    del a, b
    return 2 * n / t


TIMINGS = []  # (name, config, us, GB/s, % copy bw, extra)


def decode_setup(B, ctx_lo, ctx_hi, page, hq=16, hkv=8, d=128, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(ctx_lo, ctx_hi + 1, (B,), generator=gen).tolist()
    bt, nb = block_tables_for(seq_lens, page, gen)
    kc, vc = rand_cache(nb, page, hkv, d, dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = torch.randn(B, hq, d, device=DEV, dtype=dtype)
    kv_bytes = sum(seq_lens) * hkv * d * 2 * kc.element_size()
    return q, kc, vc, bt, sl, kv_bytes, seq_lens


def time_decode(name, setup, configs, copy_bw, graph=True):
    q, kc, vc, bt, sl, kv_bytes, seq_lens = setup
    scale = q.shape[-1] ** -0.5
    expect = ref.decode_attention_ref(q[:8].float(), kc.float(), vc.float(), bt[:8], sl[:8], scale)
    best = None
    for cfg in configs:
        cfg = dict(cfg)
        splits = cfg.pop("splits", None)
        label = " ".join(f"{k}={v}" for k, v in cfg.items()) + f" splits={splits or 'auto'}" + ("" if graph else " eager")
        try:
            out = torch.empty_like(q)
            fn = lambda: ta.decode_attention(q, kc, vc, bt, sl, scale, out=out, num_splits=splits, _config=cfg)  # noqa
            t = bench_graph(fn) if graph else bench(fn)
            err = rel_err(out[:8], expect)
        except Exception as e:  # a config that does not compile (e.g. out of shared memory) is skipped
            log(f"  {name} {label}: ERROR {type(e).__name__}: {str(e).splitlines()[0][:150]}")
            continue
        gbs = kv_bytes / t / 1e9
        log(f"  {name:14s} {label:62s} {t * 1e6:8.1f} us {gbs:7.0f} GB/s {100 * gbs * 1e9 / copy_bw:5.1f}% err={err:.1e}")
        if err > 1e-2:
            log("   ^ wrong result, not counted")
            continue
        if best is None or t < best[0]:
            best = (t, label, gbs, cfg, splits)
    if best:
        TIMINGS.append((name, best[1], best[0] * 1e6, best[2], 100 * best[2] * 1e9 / copy_bw, ""))
    return best


def decode_sweep_configs(d=128):
    cfgs = []
    for bn in (32, 64, 128):
        for w in (2, 4, 8):
            for st in (1, 2, 3):
                cfgs.append({"USE_DOT": True, "BLOCK_N": bn, "num_warps": w, "num_stages": st})
    for bn in (16, 32):
        for w in (2, 4):
            cfgs.append({"USE_DOT": False, "BLOCK_N": bn, "num_warps": w, "num_stages": 1})
    return cfgs


def time_prefill(name, copy_bw, configs, B=8, L=1024, prefix=0, page=16, sdpa=False):
    hq, hkv, d, dtype = 16, 8, 128, torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    seq_lens = [prefix + L] * B
    bt, nb = block_tables_for(seq_lens, page, gen)
    kc, vc = rand_cache(nb, page, hkv, d, dtype)
    T = B * L
    q = torch.randn(T, hq, d, device=DEV, dtype=dtype)
    qsl = torch.arange(0, T + 1, L, dtype=torch.int32, device=DEV)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    scale = d ** -0.5
    flops = 4 * hq * d * B * (L * (L + 1) / 2 + L * prefix)
    kv_bytes = B * (prefix + L) * hkv * d * 2 * 2
    expect = ref.prefill_attention_ref(q[:L].float(), kc.float(), vc.float(), bt[:1], qsl[:2], sl[:1], scale)
    best = None
    for cfg in configs:
        label = "default" if not cfg else " ".join(f"{k}={v}" for k, v in cfg.items())
        try:
            out = torch.empty_like(q)
            fn = lambda: ta.prefill_attention(q, kc, vc, bt, qsl, sl, scale, out=out, max_query_len=L, _config=cfg)  # noqa
            t = bench(fn)
            err = rel_err(out[:L], expect)
        except Exception as e:
            log(f"  {name} {label}: ERROR {type(e).__name__}: {str(e).splitlines()[0][:150]}")
            continue
        log(f"  {name:18s} {label:55s} {t * 1e6:8.1f} us {flops / t / 1e12:6.1f} TFLOP/s "
            f"{kv_bytes / t / 1e9:6.0f} GB/s err={err:.1e}")
        if err < 1e-2 and (best is None or t < best[0]):
            best = (t, label)
    if best:
        t = best[0]
        TIMINGS.append((name, best[1], t * 1e6, kv_bytes / t / 1e9, 100 * kv_bytes / t / copy_bw,
                        f"{flops / t / 1e12:.0f} TFLOP/s"))
    if not sdpa:
        return
    # torch's own flash attention on the same (dense, contiguous) problem, for scale
    try:
        qd = q.view(B, L, hq, d).transpose(1, 2)
        kd = torch.randn(B, hkv, L, d, device=DEV, dtype=dtype)
        vd = torch.randn_like(kd)
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)  # noqa
        t = bench(fn)
        log(f"  torch SDPA (dense, reference point) {t * 1e6:8.1f} us {flops / t / 1e12:6.1f} TFLOP/s")
        TIMINGS.append(("torch sdpa 8x1024", "dense causal gqa", t * 1e6, kv_bytes / t / 1e9,
                        100 * kv_bytes / t / copy_bw, f"{flops / t / 1e12:.0f} TFLOP/s"))
    except Exception as e:
        log(f"  torch SDPA: {type(e).__name__}: {e}")


def graph_check(setup):
    q, kc, vc, bt, sl, kv_bytes, _ = setup
    scale = q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    ta.decode_attention(q, kc, vc, bt, sl, scale, out=out)
    eager = out.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ta.decode_attention(q, kc, vc, bt, sl, scale, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ta.decode_attention(q, kc, vc, bt, sl, scale, out=out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ok = torch.equal(out, eager)
    t = bench(g.replay)
    log(f"  cuda graph replay: equal to eager={ok}  {t * 1e6:.1f} us")
    RESULTS.append(("graph", "decode B=256 capture+replay == eager", 0.0 if ok else 1.0, ok))
    return t


# ------------------------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer sweep points")
    ap.add_argument("--budget", type=float, default=340.0, help="seconds after which remaining checks are skipped")
    ap.add_argument("--sections", default="smoke,time,check,window", help="comma list of smoke,time,check,window")
    args = ap.parse_args()
    sections = args.sections.split(",")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    p = torch.cuda.get_device_properties(0)
    log(f"device {p.name} sms={p.multi_processor_count} torch {torch.__version__} triton {triton.__version__}")
    copy_bw = copy_bandwidth()
    log(f"device copy bandwidth (read+write): {copy_bw / 1e12:.2f} TB/s   [{elapsed():.0f}s]")

    try:
        if "smoke" in sections:
            log("== smoke checks")
            check_decode(gen, (16,), (2,), (128,), (torch.bfloat16,))
            check_prefill(gen, (16,), (2,), (128,), (torch.bfloat16,))
            log(f"   [{elapsed():.0f}s]")
        if "time" in sections:
            log("== decode B=256, ctx 800..1200 (Qwen3-0.6B: 16q/8kv/128), CUDA-graph timed")
            setup = decode_setup(256, 800, 1200, 16)
            base = {"USE_DOT": True, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
            time_decode("dec256 eager", setup, [{}], copy_bw, graph=False)
            cfgs = [{}] + ([] if args.quick else [
                dict(base, num_stages=4), dict(base, BLOCK_N=128), dict(base, BLOCK_N=128, num_stages=4),
                dict(base, BLOCK_N=32, num_warps=2, num_stages=3), dict(base, BLOCK_N=32, num_warps=2, num_stages=4),
                dict(base, BLOCK_N=64, num_warps=2, num_stages=4)])
            best = time_decode("dec256 page16", setup, cfgs, copy_bw)
            graph_check(setup)
            del setup
            setup = decode_setup(256, 800, 1200, 64)
            time_decode("dec256 page64", setup, [{}] + ([] if args.quick else [dict(base, num_stages=4)]), copy_bw)
            del setup
            for d, hq in ((64, 16), (256, 16)):
                setup = decode_setup(256, 800, 1200, 16, hq=hq, d=d)
                cfgs = [{}] + [dict(base, BLOCK_N=bn, num_warps=w, num_stages=st)
                               for bn, w, st in ((32, 4, 2), (32, 4, 3), (64, 4, 2), (32, 8, 3), (64, 8, 2), (128, 4, 3))
                               if not (d == 64 and bn == 32 and w == 8)]
                if args.quick:
                    cfgs = [{}]
                elif d == 64:
                    cfgs += [dict(base, BLOCK_N=128, num_warps=4, num_stages=4), dict(base, BLOCK_N=64, num_warps=2)]
                time_decode(f"dec256 d={d}", setup, cfgs, copy_bw)
                del setup
            log(f"   [{elapsed():.0f}s]")
            log("== decode, smaller batches and long contexts (splits)")
            for B in (16, 64):
                setup = decode_setup(B, 800, 1200, 16)
                splits = (1, 2, 4) if args.quick else (1, 2, 4, 8, 16)
                time_decode(f"dec{B} ctx1k", setup, [{}] + [{"splits": s} for s in splits], copy_bw)
                del setup
            setup = decode_setup(1, 32768, 32768, 16)
            cfgs = [{}] + [{"splits": s} for s in (16, 32, 64, 128)] + [
                {"splits": s, "BLOCK_N": 128} for s in (32, 64)] + [{"splits": 64, "num_stages": 4}]
            time_decode("dec1x32k", setup, [{}] if args.quick else cfgs, copy_bw)
            time_decode("dec1x32k eager", setup, [{}], copy_bw, graph=False)
            del setup
            setup = decode_setup(8, 30000, 32768, 16)
            time_decode("dec8x32k", setup, [{}] if args.quick else [{}, {"splits": 8}, {"splits": 16}], copy_bw)
            del setup
            log(f"   [{elapsed():.0f}s]")
            log("== prefill (16q/8kv/128, bf16)")
            pcfgs = [{}]
            if not args.quick:
                for bm, bn, w, st in ((64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2),
                                      (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 8, 3), (64, 128, 4, 3)):
                    pcfgs.append({"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st})
            time_prefill("prefill 8x1024", copy_bw, pcfgs, sdpa=True)
            alt = [] if args.quick else [{"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}]
            time_prefill("prefill pg64", copy_bw, [{}] + alt, page=64)
            time_prefill("chunk 8x512+1536", copy_bw, [{}] + alt, L=512, prefix=1536)
            log(f"   [{elapsed():.0f}s]")
        flush_log()
        if "check" in sections:
            log("== correctness matrix")
            check_reshape_and_cache(gen)
            check_fused()
            dtypes = (torch.bfloat16, torch.float16)
            for d in (128, 64, 256):
                if elapsed() > args.budget:
                    log(f"  budget reached: skipping decode/prefill checks for d={d}")
                    RESULTS.append(("SKIPPED", f"d={d} checks (time budget)", 0.0, False))
                    continue
                check_decode(gen, (16, 64), (1, 2, 8), (d,), dtypes, split_options=(None, 1) if d == 128 else (None,))
                check_prefill(gen, (16, 64), (1, 2, 8), (d,), dtypes)
                log(f"   [{elapsed():.0f}s]")
                flush_log()
        if "window" in sections:
            log("== sliding window / soft-capping: correctness (NaN below every window), graph replay, timings")
            check_windowed(gen, pages=(16,) if args.quick else (16, 64))
            windowed_graph_check()
            log(f"   [{elapsed():.0f}s]")
            time_windowed(copy_bw, args.quick)
            log(f"   [{elapsed():.0f}s]")
            flush_log()
    except Exception:
        log(traceback.format_exc())

    # ---- compact summary
    log("")
    log("== timings (best config each; GB/s = KV bytes read / time; % of measured copy bandwidth)")
    log(f"{'case':18s} {'us':>9s} {'GB/s':>7s} {'%bw':>6s}  config / extra")
    for name, cfg, us, gbs, pct, extra in TIMINGS:
        log(f"{name:18s} {us:9.1f} {gbs:7.0f} {pct:5.1f}%  {cfg} {extra}")
    fails = [r for r in RESULTS if not r[3]]
    by_op = {}
    for op, _, err, ok in RESULTS:
        e = by_op.setdefault(op, [0, 0, 0.0])
        e[0] += 1
        e[1] += ok
        if math.isfinite(err):
            e[2] = max(e[2], err)
        else:
            e[2] = float("inf")
    log("== correctness: op  passed/total  max rel err")
    for op, (n, okn, mx) in by_op.items():
        log(f"{op:9s} {okn:4d}/{n:<4d} {mx:.2e}")
    for op, case, err, _ in fails[:20]:
        log(f"FAIL {op} {case} err={err:.2e}")
    log(f"SUMMARY: {'PASS' if not fails else 'FAIL'} ({len(RESULTS) - len(fails)}/{len(RESULTS)})  "
        f"total {elapsed():.0f}s")
    flush_log()


if __name__ == "__main__":
    main()
