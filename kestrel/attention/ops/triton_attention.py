"""Paged-KV attention in Triton: cache writes, varlen causal prefill (with cached prefixes) and split-K decode.

KV cache per layer: k_cache / v_cache `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous. Token at
absolute position p of sequence b lives in block `block_tables[b, p // block_size]`, offset `p % block_size`.

All softmax arithmetic is float32 in the log2 domain (scale * log2(e) folded into one multiply). No launcher
reads a device value on the host: grids depend only on tensor shapes and optional python ints, so every op can
be captured in a CUDA graph.

Per-layer options (fixed for a layer, run-time values): `sliding_window` W (a query at position p sees keys
p-W+1 .. p, as transformers' sliding_window_overlay; 0/None = all of 0 .. p) and `softcap` c (scaled logits s
become c * tanh(s / c), Gemma 2; 0 = off). W and c are run-time kernel arguments; only whether they are on is a
constexpr (WINDOWED, SOFTCAP), so a model compiles at most one more variant per kernel for its sliding layers,
and full-attention layers run the same code as without these options. `sinks` (gpt-oss): a float32 tensor [Hq]
of learned logits, one per query head, that join every row's softmax denominator as a key without a value; the
online softmax starts from it (running max = the sink, sum = 1) instead of from -inf and 0 (constexpr SINKS). `attention_chunk_size` C (chunked local
attention, Llama 4: a query at p sees keys floor(p / C) * C .. p) is the other kind of lower bound: it rides in
the window's run-time argument, and the constexpr CHUNKED picks the bound's formula (`_row_lo`). Windowed kernels never touch the K/V (or
the block-table entries, where a tile spans pages) of tokens below the window: those blocks may already be
freed and reused by another request.

The fused helpers (rms_norm, silu_and_mul, rotary_embedding_) live in `fused_ops.py` and are re-exported here.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kestrel.kernels.triton_ops.fused_ops import rms_norm, rotary_embedding_, silu_and_mul  # noqa: F401  (re-export)
from kestrel.kernels.triton_ops.fused_ops import kv_cache_args, kv_cache_value
from kestrel.platform.triton_gates import check_attention, check_kv_cache_dtype, interpreter_mode
from kestrel.kernels.triton_ops.counters import CAPACITY as COUNTER_CAPACITY, tile_counters
from kestrel.kernels.triton_ops.pdl import pdl_launch, pdl_prologue

__all__ = [
    "reshape_and_cache",
    "prefill_attention",
    "decode_attention",
    "rms_norm",
    "silu_and_mul",
    "rotary_embedding_",
]

_LOG2E = 1.4426950408889634
MAX_SPLITS = 64  # decode context splits (choose_num_splits never exceeds it)
MIN_SPLIT_TOKENS = 256  # no decode split shorter than this (choose_num_splits' rule, applied per sequence)


@functools.cache
def _num_sms(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sms_for(t: torch.Tensor) -> int:
    return _num_sms(t.device.index or 0) if t.is_cuda else 132


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> None:
    """`dtype`: the queries' (reads) or the new keys' (writes); the cache holds it or a float8 dtype."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype}, v_cache {v_cache.dtype}")
    ok, why = check_kv_cache_dtype(k_cache.dtype)
    if not ok:
        raise ValueError(why)
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.dim() != 4 or k_cache.stride(-1) != 1 or k_cache.stride(-2) != k_cache.shape[-1]:
        raise ValueError("KV cache must be [num_blocks, block_size, num_kv_heads, head_dim] with contiguous heads")
    ok, why = check_attention(dtype, k_cache.shape[-1], k_cache.shape[1])
    if not ok:
        raise ValueError(why)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ----------------------------------------------------------------------------------------------------------
# reshape_and_cache
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _reshape_and_cache_kernel(
    KEY, VALUE, KC, VC, SLOT, KS, VS,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    num_heads,
    HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, PAGE: tl.constexpr, FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SLOT + t)
    if slot < 0:
        return
    blk = slot // PAGE
    off = slot % PAGE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < num_heads)[:, None]
    t64 = t.to(tl.int64)
    src_k = KEY + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = VALUE + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = blk * stride_cb + off * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(KC + dst, kv_cache_value(k, KS, FP8_MAX).to(KC.dtype.element_ty), mask=mask)
    tl.store(VC + dst, kv_cache_value(v, VS, FP8_MAX).to(VC.dtype.element_ty), mask=mask)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """key/value [T, Hkv, D] -> k_cache/v_cache at slot_mapping[T] (int64; slot < 0 = padding, skipped). A float8
    cache stores key / k_scale and value / v_scale (float32 tensors of one value), saturated to its range."""
    T = key.shape[0]
    if T == 0:
        return
    _check_cache(k_cache, v_cache, key.dtype)
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _, page, hkv, d = k_cache.shape
    ks, vs, fp8_max = kv_cache_args(k_cache, k_scale, v_scale)
    _reshape_and_cache_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping, ks, vs,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        hkv,
        HEAD_DIM=d, H_PAD=triton.next_power_of_2(hkv), PAGE=page, FP8_MAX=fp8_max,
        num_warps=4 if hkv * d >= 1024 else 1,
    )


# ----------------------------------------------------------------------------------------------------------
# shared pieces
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _mm(a, b, UPCAST: tl.constexpr):
    """tl.dot with fp32 accumulation. UPCAST: the CPU interpreter multiplies bf16 as raw uint16 bits (a
    Triton interpreter bug), so there the operands go to fp32 first; on the GPU UPCAST is always False."""
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        c = tl.dot(a, b)
    return c


def _upcast(dtype: torch.dtype) -> bool:
    return interpreter_mode() and dtype == torch.bfloat16


@triton.jit
def _token_offsets(bt_row, n0, limit, stride_b, stride_t, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                   lo=0, LOWER: tl.constexpr = False):
    """Element offsets (int64) of tokens n0..n0+BLOCK_N-1 of one sequence in the paged cache, and their mask
    (tokens < limit, and >= lo if LOWER: no block-table entry of a token outside is read)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < limit
    if LOWER:
        mask_n = mask_n & (offs_n >= lo)
    if BLOCK_N <= PAGE:
        # n0 is a multiple of BLOCK_N, so the whole tile sits inside one page: one block-table read.
        blk = tl.load(bt_row + n0 // PAGE).to(tl.int64)
        offs = blk * stride_b + ((n0 % PAGE) + tl.arange(0, BLOCK_N)) * stride_t
    else:
        blk = tl.load(bt_row + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
        offs = blk * stride_b + (offs_n % PAGE) * stride_t
    return offs, mask_n


@triton.jit
def _scores(qk, qk_scale, cap_log2, SOFTCAP: tl.constexpr):
    """Logits in the log2 domain from raw q.k. SOFTCAP: qk_scale is scale / c and cap_log2 is c * log2(e), so
    this is c * tanh(scale * q.k / c) * log2(e); tanh from exp2 (no libdevice: the interpreter runs it too)."""
    if SOFTCAP:
        x = qk * qk_scale
        t = tl.exp2(tl.abs(x) * (-2.0 * 1.4426950408889634))
        th = (1.0 - t) / (1.0 + t)
        s = tl.where(x < 0, -th, th) * cap_log2
    else:
        s = qk * qk_scale
    return s


@triton.jit
def _softmax_start(SINK, heads, mask, ROWS: tl.constexpr, SINKS: tl.constexpr, has_sink=True):
    """The online softmax's (running max, running sum) before any key, per row: (-inf, 0), or with SINKS the
    rows' sink logit in the log2 domain and 1 (where has_sink: a split decode counts the sink in one split only)."""
    if SINKS:
        sink = tl.load(SINK + heads, mask=mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m = tl.where(has_sink, sink, float("-inf")) + tl.zeros([ROWS], tl.float32)
        l = tl.where(has_sink, 1.0, 0.0) + tl.zeros([ROWS], tl.float32)
    else:
        m = tl.full([ROWS], float("-inf"), tl.float32)
        l = tl.zeros([ROWS], tl.float32)
    return m, l


@triton.jit
def _kv_scale(ptr, FP8_MAX: tl.constexpr):
    """A float8 cache's per-tensor scale (FP8_MAX > 0), else 1.0. Attention folds K's into the logit scale and V's
    into the output (both linear), so tiles are only converted to the query's dtype (exact from float8)."""
    if FP8_MAX > 0:
        s = tl.load(ptr)
    else:
        s = 1.0
    return s


def _score_args(scale: float, softcap: float | None) -> tuple[float, float, bool]:
    """(qk_scale, cap_log2, SOFTCAP) for _scores."""
    if softcap:
        return float(scale) / float(softcap), float(softcap) * _LOG2E, True
    return float(scale) * _LOG2E, 0.0, False


def _check_options(sliding_window, softcap, chunk_size=0) -> tuple[int, bool]:
    """(the kernels' window argument: the window or the chunk size, 0 = neither; whether it is a chunk size);
    raises on bad values."""
    w = 0 if sliding_window is None else sliding_window
    if int(w) != w or w < 0:
        raise ValueError(f"sliding_window must be a non-negative integer or None, got {sliding_window!r}")
    c = chunk_size or 0
    if int(c) != c or c < 0:
        raise ValueError(f"attention_chunk_size must be a non-negative integer or None, got {chunk_size!r}")
    if w and c:
        raise ValueError("a sliding window and chunked attention together")
    if softcap is not None and not softcap >= 0:
        raise ValueError(f"softcap must be >= 0 (0 = off), got {softcap!r}")
    return int(c or w), bool(c)


def _check_sinks(sinks, num_q_heads: int) -> None:
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_q_heads,)
                              or sinks.stride(0) != 1):
        raise ValueError(f"sinks must be a contiguous float32 tensor of {num_q_heads} per-head logits, got "
                         f"{sinks.dtype} {tuple(sinks.shape)}")


# ----------------------------------------------------------------------------------------------------------
# decode: split-K flash decoding, one program per (sequence, kv head, split) covering all query heads of the group
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _split_bounds(seq_len, num_splits, min_split, BLOCK_N: tl.constexpr):
    """Tokens per split and the number of splits that hold context (at least 1, so that an empty row is
    written). Splits are at least min_split tokens long: a short context uses few of the launched splits."""
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    per_split = tl.maximum(per_split, min_split)
    n_active = tl.maximum(tl.minimum(tl.cdiv(seq_len, per_split), num_splits), 1)
    return per_split, n_active


@triton.jit
def _row_lo(pos, window, CHUNKED: tl.constexpr):
    """The first key a query at `pos` sees: pos - W + 1 in a sliding window W, its chunk's start with CHUNKED
    (`window` then holds the chunk size), never below 0."""
    if CHUNKED:
        lo = (tl.maximum(pos, 0) // window) * window
    else:
        lo = tl.maximum(pos - window + 1, 0)
    return lo


@triton.jit
def _decode_window(seq_len, window, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr, CHUNKED: tl.constexpr):
    """(lo, lo_al): the first key of the decode query's window and the tile boundary at or below it. The splits
    divide lo_al .. seq_len-1 only; keys in lo_al .. lo-1 are masked (never loaded)."""
    if WINDOWED:
        lo = _row_lo(seq_len - 1, window, CHUNKED)
        lo_al = (lo // BLOCK_N) * BLOCK_N
    else:
        lo = 0
        lo_al = 0
    return lo, lo_al


@triton.jit(do_not_specialize=["num_splits", "min_split", "window"])
def _decode_kernel(
    Q, K, V, BT, SL, O, PO, PLSE, CNT, KS, VS, SINK,
    qk_scale, cap_log2, G, num_q_heads, num_splits, min_split, window,
    stride_qb, stride_qh,
    stride_cb, stride_ct, stride_ch,
    stride_btb,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, G_PAD: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, UPCAST: tl.constexpr,
    FUSED_REDUCE: tl.constexpr, MAX_SPLITS: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
    FP8_MAX: tl.constexpr, PDL: tl.constexpr, CHUNKED: tl.constexpr = False, SINKS: tl.constexpr = False,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b64 = b.to(tl.int64)
    seq_len = tl.load(SL + b)
    lo, lo_al = _decode_window(seq_len, window, BLOCK_N, WINDOWED, CHUNKED)
    per_split, n_active = _split_bounds(seq_len - lo_al, num_splits, min_split, BLOCK_N)
    if split >= n_active:
        return  # past the context: CUDA graphs launch splits for max_model_len, most are empty at short contexts
    start = lo_al + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, G_PAD)
    mask_g = offs_g < G
    heads = kvh * G + offs_g
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_g[:, None], other=0.0)
    if not USE_DOT:
        q = q.to(tl.float32)
    qk_scale = qk_scale * _kv_scale(KS, FP8_MAX)

    m_i, l_i = _softmax_start(SINK, heads, mask_g, G_PAD, SINKS, split == 0)
    acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
    bt_row = BT + b64 * stride_btb
    k_base = K + kvh * stride_ch
    v_base = V + kvh * stride_ch
    for n0 in range(start, end, BLOCK_N):
        # Every tile holds at least one visible key (splits start at tile boundaries >= lo_al, end > lo).
        offs, mask_n = _token_offsets(bt_row, n0, end, stride_cb, stride_ct, PAGE, BLOCK_N, lo, WINDOWED)
        k = tl.load(k_base + offs[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0).to(Q.dtype.element_ty)
        v = tl.load(v_base + offs[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0).to(Q.dtype.element_ty)
        if USE_DOT:
            s = _mm(q, tl.trans(k), UPCAST)
        else:
            s = tl.sum(q[:, None, :] * k[None, :, :].to(tl.float32), axis=2)
        s = tl.where(mask_n[None, :], _scores(s, qk_scale, cap_log2, SOFTCAP), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, UPCAST)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if FP8_MAX > 0:
        o = o * tl.load(VS)
    dst = O + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if not SPLIT:
        tl.store(dst, o.to(O.dtype.element_ty), mask=mask_g[:, None])
    elif n_active == 1:
        tl.store(dst, o.to(O.dtype.element_ty), mask=mask_g[:, None])  # one split holds it all: nothing to merge
    else:
        row = (b64 * num_q_heads + heads) * num_splits + split
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(PLSE + row, lse, mask=mask_g)
        tl.store(PO + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask_g[:, None])
        if FUSED_REDUCE:
            # The last active split of this (sequence, kv head) to finish merges them all: no second launch.
            cnt = CNT + b * tl.num_programs(1) + kvh
            tl.debug_barrier()  # every thread's partial is written before the release below
            done = tl.atomic_add(cnt, 1)  # acq_rel: the other splits' partials are visible to the last one
            if done == n_active - 1:
                base = (b64 * num_q_heads + heads) * num_splits
                offs_s = tl.arange(0, MAX_SPLITS)
                lse_all = tl.load(PLSE + base[:, None] + offs_s[None, :],
                                  mask=mask_g[:, None] & (offs_s[None, :] < n_active), other=float("-inf"),
                                  cache_modifier=".cg")
                m = tl.max(lse_all, axis=1)
                m = tl.where(m == float("-inf"), 0.0, m)
                denom = tl.sum(tl.exp2(lse_all - m[:, None]), axis=1)
                denom = tl.where(denom == 0.0, 1.0, denom)
                merged = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
                for sp in range(0, n_active):
                    w = tl.exp2(tl.load(PLSE + base + sp, mask=mask_g, other=float("-inf"), cache_modifier=".cg")
                                - m) / denom
                    po = tl.load(PO + (base + sp)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_g[:, None],
                                 other=0.0, cache_modifier=".cg")
                    merged += w[:, None] * po
                tl.store(dst, merged.to(O.dtype.element_ty), mask=mask_g[:, None])
                tl.atomic_xchg(cnt, 0)


@triton.jit(do_not_specialize=["num_splits", "min_split", "window"])
def _decode_reduce_kernel(
    PO, PLSE, O, SL, stride_ob, stride_oh, num_splits, min_split, window,
    MAX_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr,
    PDL: tl.constexpr, CHUNKED: tl.constexpr = False,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SL + b)
    _, lo_al = _decode_window(seq_len, window, BLOCK_N, WINDOWED, CHUNKED)
    _, n_active = _split_bounds(seq_len - lo_al, num_splits, min_split, BLOCK_N)
    if n_active == 1:
        return  # the decode kernel wrote the output itself
    row = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits
    offs_s = tl.arange(0, MAX_SPLITS)
    mask_s = offs_s < n_active
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(PLSE + row + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, axis=0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    po = tl.load(PO + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    o = tl.sum(po * w[:, None], axis=0) / denom
    tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, o.to(O.dtype.element_ty))


def _default_decode_config(head_dim: int, group: int, page: int, batch: int = 256) -> dict:
    # Chosen on the H200 (see benchmarks/NOTES.md): tensor-core dot with the query group padded to 16 rows.
    # H200, bf16, B=256 x ~1000 ctx, 16q/8kv/128: BLOCK_N 64 / 4 warps / 3 stages = 4065 GB/s (96% of copy bw);
    # 2 stages 3938, 1 stage 3642; the non-dot (broadcast-sum) variant at best 1875 GB/s.
    # d=64: 64 / 2 warps / 3 stages 3898 GB/s (92%), 128 / 4 / 3 3857, the d=128 default 3732.
    # d=256: 32 / 4 / 2..3 ~4180 GB/s (98%); 64-token tiles 4138; 128-token tiles 3444.
    # Batch <= 8, d=128 (latency, benchmarks/batch1_kernels.py): 128-token tiles / 8 warps / 2 stages and splits
    # of >= 128 tokens: 8.2 us at 384 tokens and 9.9 us at 1024 in a 64-split graph launch (the throughput
    # config: 11.2 and 13.1 us).
    if head_dim > 128:
        cfg = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "USE_DOT": True}
    elif head_dim <= 64:
        cfg = {"BLOCK_N": 64, "num_warps": 2, "num_stages": 3, "USE_DOT": True}
    elif batch <= 8:
        return {"BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "USE_DOT": True, "MIN_SPLIT": 128}
    else:
        cfg = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "USE_DOT": True}
    # Shortest split (tokens): a launch sized for long contexts (CUDA graphs split for max_model_len) uses only
    # as many splits as the context fills at this length; the others exit at once.
    cfg["MIN_SPLIT"] = MIN_SPLIT_TOKENS
    return cfg


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int = 132,
                      min_split: int = MIN_SPLIT_TOKENS) -> int:
    """Splits of the context per (sequence, kv head), a power of two in [1, 64], from shapes only.

    No split once batch * kv heads alone fills the chip twice (H200, 1k contexts: B=64 -> 512 programs ran
    68.9 us unsplit vs 72.1 with 2 splits); below that, enough splits for about 4 programs per SM, none shorter
    than 256 tokens (B=16: 4 splits 24.0 us vs 36.4 unsplit; B=1 x 32k: 64 splits 40.2 us vs 62.0 with 16).
    """
    work = max(1, batch * num_kv_heads)
    if work >= 2 * num_sms:
        return 1
    want = triton.cdiv(4 * num_sms, work)
    cap = max(1, max_context // min_split)
    splits = 1
    while splits * 2 <= min(want, cap, 64):
        splits *= 2
    return splits


def split_decode_setup(q: torch.Tensor, out: torch.Tensor, cfg: dict, programs: int, max_ctx: int,
                       num_splits: int | None, shortest_split: int = MIN_SPLIT_TOKENS):
    """What a split-K decode launch of q [B, H, D] needs besides its kernels' arguments: the split count (unless
    given: choose_num_splits over `programs` (sequence, head-block) programs a sequence, none shorter than
    `shortest_split` tokens), the float32 partial outputs [B, H, splits, D] and log-sum-exps [B, H, splits] of split
    launches (unsplit: `out`, unused), the kernel's shortest split (cfg's MIN_SPLIT in whole BLOCK_N tiles), and
    the compiler's launch options. Returns (num_splits, po, plse, min_split, launch)."""
    B, H, D = q.shape
    if num_splits is None:
        num_splits = choose_num_splits(B, programs, max_ctx, _sms_for(q), min_split=shortest_split)
    if num_splits & (num_splits - 1) or num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits must be a power of two <= {MAX_SPLITS}")
    if num_splits > 1:
        po = torch.empty((B, H, num_splits, D), dtype=torch.float32, device=q.device)
        plse = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
    else:
        po = plse = out  # unused
    min_split = triton.cdiv(max(int(cfg["MIN_SPLIT"]), 1), cfg["BLOCK_N"]) * cfg["BLOCK_N"]
    launch = {} if interpreter_mode() else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    return num_splits, po, plse, min_split, launch


def decode_attention(
    q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, num_splits=None, *, max_seq_len=None,
    sliding_window=None, softcap=0.0, k_scale=None, v_scale=None, attention_chunk_size=0, sinks=None, _config=None
):
    """q [B, Hq, D] (one token per sequence, at position seq_lens[b]-1) -> out [B, Hq, D].

    num_splits: splits of the context (power of two); default from the shapes (block table width or
    max_seq_len, capped by the window), never from device values. Rows with seq_len 0 produce zeros.
    sliding_window / softcap / attention_chunk_size: see the module docstring (the splits divide the window's or
    the chunk's keys only).
    k_scale / v_scale: a float8 cache's per-tensor scales (float32 tensors of one value).
    sinks: per-head sink logits, float32 [Hq] (None: no sinks); split 0 counts them.
    """
    window, chunked = _check_options(sliding_window, softcap, attention_chunk_size)
    B, hq, d = q.shape
    _check_sinks(sinks, hq)
    _check_cache(k_cache, v_cache, q.dtype)
    _, page, hkv, _ = k_cache.shape
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    group = hq // hkv
    q = _last_dim_contiguous(q)
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    cfg = dict(_default_decode_config(d, group, page, B))
    if _config:
        cfg.update(_config)
    max_ctx = max_seq_len if max_seq_len is not None else block_tables.shape[1] * page
    if window:
        max_ctx = min(max_ctx, window + cfg["BLOCK_N"])
    num_splits, po, plse, min_split, launch = split_decode_setup(q, out, cfg, hkv, max_ctx, num_splits)
    g_pad = max(16, triton.next_power_of_2(group)) if cfg["USE_DOT"] else triton.next_power_of_2(group)
    # The split count is a run-time argument (one compiled variant for split and one for unsplit launches,
    # not one per power of two): each variant costs ~1 s of Triton compilation at start-up. Split launches merge
    # in the same launch (the last split reduces, counted per (sequence, kv head)) unless `_config` turns that off
    # or the batch outgrows the counters; then a second kernel merges.
    fused_reduce = num_splits > 1 and cfg.get("FUSED_REDUCE", True) and B * hkv <= COUNTER_CAPACITY
    cnt = tile_counters(q.device) if fused_reduce else out
    qk_scale, cap_log2, has_softcap = _score_args(scale, softcap)
    ks, vs, fp8_max = kv_cache_args(k_cache, k_scale, v_scale)
    _decode_kernel[(B, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, po, plse, cnt, ks, vs, q if sinks is None else sinks,
        qk_scale, cap_log2, group, hq, num_splits, min_split, window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        HEAD_DIM=d, G_PAD=g_pad, PAGE=page,
        BLOCK_N=cfg["BLOCK_N"], SPLIT=num_splits > 1, USE_DOT=cfg["USE_DOT"], UPCAST=_upcast(q.dtype),
        FUSED_REDUCE=fused_reduce, MAX_SPLITS=MAX_SPLITS, WINDOWED=window > 0, SOFTCAP=has_softcap,
        FP8_MAX=fp8_max, CHUNKED=chunked, SINKS=sinks is not None, **launch,
        **pdl_launch(B),
    )
    if num_splits > 1 and not fused_reduce:
        _decode_reduce_kernel[(B, hq)](
            po, plse, out, seq_lens, out.stride(0), out.stride(1), num_splits, min_split, window,
            MAX_SPLITS=MAX_SPLITS, HEAD_DIM=d, BLOCK_N=cfg["BLOCK_N"], WINDOWED=window > 0, CHUNKED=chunked,
            **({} if interpreter_mode() else {"num_warps": 4 if d >= 128 else 2}), **pdl_launch(B),
        )
    return out


# ----------------------------------------------------------------------------------------------------------
# prefill: varlen causal attention over a paged cache with cached prefixes
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _masked_tile(q, k_base, v_base, offs_d, offs, mask_n, offs_n, pos_m, m_i, l_i, acc, qk_scale, cap_log2, window,
                 UPCAST: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, CHUNKED: tl.constexpr):
    """One online-softmax step of a windowed prefill over a tile that needs the causal and window masks. A row
    may see none of the tile's keys (windows narrower than the tiles): its running max stays -inf, and the
    exponentials are taken against 0 instead so that nothing turns into NaN."""
    k = tl.load(k_base + offs[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0).to(q.dtype)
    s = _scores(_mm(q, tl.trans(k), UPCAST), qk_scale, cap_log2, SOFTCAP)
    visible = (offs_n[None, :] <= pos_m[:, None]) & mask_n[None, :]
    if CHUNKED:
        visible = visible & (offs_n[None, :] >= (pos_m[:, None] // window) * window)
    elif WINDOWED:
        visible = visible & (offs_n[None, :] > pos_m[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + offs[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, UPCAST)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_seqs", "window"])
def _prefill_kernel(
    Q, K, V, BT, QSL, SL, O, KS, VS, SINK,
    qk_scale, cap_log2, G, num_seqs, window,
    stride_qt, stride_qh,
    stride_cb, stride_ct, stride_ch,
    stride_btb,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEARCH_ITERS: tl.constexpr, UPCAST: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, Q_DIM: tl.constexpr, O_DIM: tl.constexpr,
    FP8_MAX: tl.constexpr, CHUNKED: tl.constexpr = False, SINKS: tl.constexpr = False,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // G
    # Sequence b owns programs [qsl[b] // BLOCK_M + b, qsl[b+1] // BLOCK_M + b + 1): find b by binary search.
    lo = pid * 0
    hi = lo + num_seqs - 1
    for _ in range(SEARCH_ITERS):
        mid = (lo + hi + 1) // 2
        ok = tl.load(QSL + mid) // BLOCK_M + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    b = lo
    q_start = tl.load(QSL + b)
    q_len = tl.load(QSL + b + 1) - q_start
    # Heaviest (last) query block of a sequence first: long programs start early, short ones fill the tail.
    j = tl.cdiv(q_len, BLOCK_M) - 1 - (pid - (q_start // BLOCK_M + b))
    if j < 0:
        return
    m0 = j * BLOCK_M
    seq_len = tl.load(SL + b)
    ctx = seq_len - q_len

    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (q_start + offs_m).to(tl.int64)
    q_mask = mask_m[:, None]
    if Q_DIM < HEAD_DIM:  # a narrower query (MLA: 192 of 256): its missing lanes read as zeros
        q_mask = q_mask & (offs_d < Q_DIM)[None, :]
    q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    pos_m = ctx + offs_m
    qk_scale = qk_scale * _kv_scale(KS, FP8_MAX)

    m_i, l_i = _softmax_start(SINK, h + offs_m * 0, mask_m, BLOCK_M, SINKS)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_btb
    k_base = K + kvh * stride_ch
    v_base = V + kvh * stride_ch
    # keys < ctx + m0 are visible to every query of this block (within the window): no mask there.
    full_end = ((ctx + m0) // BLOCK_N) * BLOCK_N
    kv_end = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
    if WINDOWED:
        # Keys from lo (the first row's window start) on; those from the last row's window start on are inside
        # every row's window. The tiles below that boundary (and below full_end) take the window mask.
        lo = _row_lo(ctx + m0, window, CHUNKED)
        lo_al = (lo // BLOCK_N) * BLOCK_N
        edge_end = tl.cdiv(_row_lo(ctx + m0 + BLOCK_M - 1, window, CHUNKED), BLOCK_N) * BLOCK_N
        edge_end = tl.minimum(tl.maximum(edge_end, lo_al), full_end)
        for n0 in range(lo_al, edge_end, BLOCK_N):
            offs, mask_n = _token_offsets(bt_row, n0, kv_end, stride_cb, stride_ct, PAGE, BLOCK_N, lo, True)
            m_i, l_i, acc = _masked_tile(q, k_base, v_base, offs_d, offs, mask_n, n0 + tl.arange(0, BLOCK_N), pos_m,
                                         m_i, l_i, acc, qk_scale, cap_log2, window, UPCAST, True, SOFTCAP,
                                         CHUNKED)
        mid_start = edge_end
    else:
        lo = 0
        mid_start = 0
    for n0 in range(mid_start, full_end, BLOCK_N):
        offs, mask_n = _token_offsets(bt_row, n0, kv_end, stride_cb, stride_ct, PAGE, BLOCK_N)
        k = tl.load(k_base + offs[:, None] + offs_d[None, :]).to(q.dtype)
        s = _scores(_mm(q, tl.trans(k), UPCAST), qk_scale, cap_log2, SOFTCAP)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs[:, None] + offs_d[None, :]).to(q.dtype)
        acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    for n0 in range(full_end, kv_end, BLOCK_N):
        if WINDOWED:
            offs, mask_n = _token_offsets(bt_row, n0, kv_end, stride_cb, stride_ct, PAGE, BLOCK_N, lo, True)
            m_i, l_i, acc = _masked_tile(q, k_base, v_base, offs_d, offs, mask_n, n0 + tl.arange(0, BLOCK_N), pos_m,
                                         m_i, l_i, acc, qk_scale, cap_log2, window, UPCAST, True, SOFTCAP,
                                         CHUNKED)
        else:
            offs, mask_n = _token_offsets(bt_row, n0, kv_end, stride_cb, stride_ct, PAGE, BLOCK_N)
            k = tl.load(k_base + offs[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0).to(q.dtype)
            s = _scores(_mm(q, tl.trans(k), UPCAST), qk_scale, cap_log2, SOFTCAP)
            offs_n = n0 + tl.arange(0, BLOCK_N)
            visible = (offs_n[None, :] <= pos_m[:, None]) & mask_n[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + offs[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, UPCAST)
            m_i = m_new

    o = acc / l_i[:, None]
    if FP8_MAX > 0:
        o = o * tl.load(VS)
    o_mask = mask_m[:, None]
    if O_DIM < HEAD_DIM:  # only the first O_DIM lanes (MLA's values: 128 of 256)
        o_mask = o_mask & (offs_d < O_DIM)[None, :]
    tl.store(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], o.to(O.dtype.element_ty), mask=o_mask)


def _default_prefill_config(head_dim: int, max_query_len: int | None) -> dict:
    if max_query_len is not None and max_query_len <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64 if head_dim <= 128 else 32, "num_warps": 4, "num_stages": 2}
    if head_dim <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    if head_dim <= 128:
        # H200, 8 x 1024 causal, 16q/8kv/128, page 16: 64/64/4w/2s = 238 TFLOP/s; 128/64/8w/2s = 212
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    if head_dim <= 256:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    # d=512 (Gemma 4's global layers): the [32 x 512] float32 accumulator on 8 warps; sm_90 ptxas: 32/32/8w/2s
    # spills nothing, 32/32/4w 180 bytes a thread, 64/32/8w 132 (untimed)
    return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}


def _search_iters(num_seqs: int) -> int:
    """Binary-search steps over query_start_loc: a constexpr, so it is bucketed (8 covers 256 sequences) instead
    of following the batch, which would compile a new kernel variant for every power of two of batch size."""
    return max(8, int(math.ceil(math.log2(max(num_seqs, 2)))))


def prefill_attention(
    q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out=None,
    max_query_len=None, max_seq_len=None, *, sliding_window=None, softcap=0.0, k_scale=None, v_scale=None,
    attention_chunk_size=0, sinks=None, _config=None,
):
    """Causal varlen attention for q [T, Hq, Dq]; K/V [.., D] (prefix and new tokens) are read from the paged
    cache -> out [T, Hq, Do] (default Do = D).

    Sequence b's queries are q[query_start_loc[b]:query_start_loc[b+1]] at absolute positions
    seq_lens[b] - q_len_b + i. The grid is sized from T and B alone (each program finds its sequence by a
    binary search over query_start_loc), so no host sync; max_query_len only picks the tile size and
    max_seq_len is accepted for interface symmetry. sliding_window / softcap / attention_chunk_size: see the
    module docstring.
    Dq, Do <= D: a query narrower than the keys (its missing lanes count as zeros) and an output of the first Do
    lanes only (MLA's padded heads: 192-dim queries and 128-dim values over 256-dim K/V, no padded copies).
    k_scale / v_scale: a float8 cache's per-tensor scales (float32 tensors of one value).
    sinks: per-head sink logits, float32 [Hq] (None: no sinks).
    """
    window, chunked = _check_options(sliding_window, softcap, attention_chunk_size)
    T, hq, dq = q.shape
    _check_sinks(sinks, hq)
    _check_cache(k_cache, v_cache, q.dtype)
    _, page, hkv, d = k_cache.shape
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    q = _last_dim_contiguous(q)
    if out is None:
        out = q.new_empty(T, hq, d)
    if dq > d or out.shape[-1] > d or out.stride(-1) != 1:
        raise ValueError(f"query ({dq}) and output ({out.shape[-1]}) dims must fit the cache's {d}, output rows "
                         "contiguous")
    B = seq_lens.shape[0]
    if T == 0 or B == 0:
        return out
    cfg = dict(_default_prefill_config(d, max_query_len))
    if _config:
        cfg.update(_config)
    bm = cfg["BLOCK_M"]
    launch = {} if interpreter_mode() else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    qk_scale, cap_log2, has_softcap = _score_args(scale, softcap)
    ks, vs, fp8_max = kv_cache_args(k_cache, k_scale, v_scale)
    _prefill_kernel[(T // bm + B, hq)](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, ks, vs, q if sinks is None else sinks,
        qk_scale, cap_log2, hq // hkv, B, window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        HEAD_DIM=d, PAGE=page, BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"],
        SEARCH_ITERS=_search_iters(B), UPCAST=_upcast(q.dtype), WINDOWED=window > 0, SOFTCAP=has_softcap,
        Q_DIM=dq, O_DIM=out.shape[-1], FP8_MAX=fp8_max, CHUNKED=chunked, SINKS=sinks is not None, **launch,
    )
    return out
