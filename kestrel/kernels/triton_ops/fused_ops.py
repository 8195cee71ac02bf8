"""Fused elementwise helpers in Triton: RMSNorm (+ residual add), SiLU-and-mul, rotary embedding (in place).

Each is one kernel; arithmetic in float32, storage in the input dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.platform.triton_gates import interpreter_mode
from kestrel.kernels.triton_ops.pdl import pdl_launch, pdl_prologue
from kestrel.kernels.triton_ops.precompile import compiling_only


def _warps(n: int) -> dict:
    if interpreter_mode():
        return {}
    return {"num_warps": 1 if n <= 256 else 4 if n <= 2048 else 8 if n <= 8192 else 16}


def kv_cache_args(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None):
    """(k scale, v scale, FP8_MAX) kernel arguments of a KV-cache write or read: for a float8 cache its per-tensor
    scales (float32 tensors of one value, read in the kernel) and the dtype's largest value; otherwise the cache
    as unused pointers and 0.0 (no scaling)."""
    if cache.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return cache, cache, 0.0
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {cache.dtype} KV cache needs k_scale and v_scale")
    return k_scale, v_scale, float(torch.finfo(cache.dtype).max)


@triton.jit
def kv_cache_value(x, scale_ptr, FP8_MAX: tl.constexpr):
    """What a KV-cache write stores for x before the store rounds it to the cache dtype: x itself, or for a float8
    cache (FP8_MAX > 0) x / scale saturated to +-FP8_MAX (kestrel/attention/kv_quant.py's quantize)."""
    if FP8_MAX > 0:
        y = x.to(tl.float32) / tl.load(scale_ptr)
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    else:
        y = x
    return y


# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(
    X, R, W, O, RO,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        xr = x.to(RO.dtype.element_ty)
        tl.store(RO + row * stride_ro + offs, xr, mask=mask)
        x = xr.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    y = (x * tl.rsqrt(var + eps)).to(O.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(O + row * stride_o + offs, (y * w).to(O.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim. With residual: returns (rmsnorm(x + residual), x + residual), one kernel."""
    n = x.shape[-1]
    shape = x.shape
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n)
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        new_res = torch.empty(shape, dtype=x.dtype, device=x.device)
        nr2 = new_res.view(-1, n)
    else:
        r2 = nr2 = x2  # unused
    if rows:
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out2, nr2,
            x2.stride(0), r2.stride(0), out2.stride(0), nr2.stride(0),
            n, float(eps),
            BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None,
            **_warps(n), **pdl_launch(rows),
        )
    return out if residual is None else (out, new_res)


# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(X, O, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(O + row * stride_o + offs, y.to(O.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:]."""
    two_i = x.shape[-1]
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    o2 = out.view(-1, inter)
    rows = x2.shape[0]
    if rows and inter:
        block = min(2048, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
            x2, o2, x2.stride(0), o2.stride(0), inter, BLOCK=block, **_warps(block), **pdl_launch(rows)
        )
    return out


# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _rotate_heads(base, stride_h, num_heads, cos, sin, i1, i2, mask_r, H_PAD: tl.constexpr):
    offs_h = tl.arange(0, H_PAD)
    mask = (offs_h < num_heads)[:, None] & mask_r[None, :]
    ptr = base + offs_h[:, None] * stride_h
    x1 = tl.load(ptr + i1[None, :], mask=mask, other=0.0)
    x2 = tl.load(ptr + i2[None, :], mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    o1 = x1f * cos[None, :] - x2f * sin[None, :]
    o2 = x2f * cos[None, :] + x1f * sin[None, :]
    tl.store(ptr + i1[None, :], o1.to(x1.dtype), mask=mask)
    tl.store(ptr + i2[None, :], o2.to(x2.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    POS, Q, K, CS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t)
    offs = tl.arange(0, HALF_PAD)
    mask_r = offs < HALF
    cos = tl.load(CS + pos * stride_cs + offs, mask=mask_r, other=0.0).to(tl.float32)
    sin = tl.load(CS + pos * stride_cs + HALF + offs, mask=mask_r, other=0.0).to(tl.float32)
    if IS_NEOX:
        i1 = offs
        i2 = offs + HALF
    else:
        i1 = offs * 2
        i2 = offs * 2 + 1
    _rotate_heads(Q + t * stride_qt, stride_qh, num_q_heads, cos, sin, i1, i2, mask_r, HQ_PAD)
    _rotate_heads(K + t * stride_kt, stride_kh, num_kv_heads, cos, sin, i1, i2, mask_r, HKV_PAD)


def rotary_embedding_(positions, q, k, cos_sin_cache, rot_dim, is_neox=True) -> None:
    """Rotate the first rot_dim dims of every head of q [T, Hq, D] and k [T, Hkv, D] in place.

    cos_sin_cache [max_pos, rot_dim]: first half cos, second half sin (float32). q/k may be strided views
    (e.g. slices of a fused qkv output) as long as the last dim is contiguous.
    """
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary_embedding_ works in place and needs the head dim contiguous")
    T = q.shape[0]
    if T == 0:
        return
    half = rot_dim // 2
    hq, hkv = q.shape[1], k.shape[1]
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    _rotary_kernel[(T,)](
        positions, q, k, cs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cs.stride(0),
        hq, hkv,
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
        HQ_PAD=triton.next_power_of_2(hq), HKV_PAD=triton.next_power_of_2(hkv),
        IS_NEOX=bool(is_neox),
        **_warps(hq * half),
    )


# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _norm_rope_heads(ptr, stride_h, num_heads, W, cos, sin, eps,
                     HEAD_DIM: tl.constexpr, HALF: tl.constexpr, H_PAD: tl.constexpr, HAS_NORM: tl.constexpr):
    """Load heads [H_PAD, HEAD_DIM] as two halves, RMS-normalise each head (optional), rotate (neox). Returns
    the rotated halves in the storage dtype."""
    offs_h = tl.arange(0, H_PAD)
    offs = tl.arange(0, HALF)
    mask = (offs_h < num_heads)[:, None]
    p = ptr + offs_h[:, None] * stride_h + offs[None, :]
    x1 = tl.load(p, mask=mask, other=0.0)
    x2 = tl.load(p + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:  # rounded like rms_norm: normalise, store dtype, scale by the weight, store dtype
        r = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(W + offs).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + offs).to(tl.float32)[None, :]
        a = ((a * r).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        b = ((b * r).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    o1 = a * cos[None, :] - b * sin[None, :]
    o2 = b * cos[None, :] + a * sin[None, :]
    return o1.to(dt), o2.to(dt), offs_h, offs, mask


@triton.jit
def _qk_norm_rope_cache_kernel(
    QKV, POS, CS, QW, KW, QO, KC, VC, SLOT, KS, VS,
    stride_t, stride_cs, stride_qo, stride_cb, stride_ct, eps,
    num_q_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr, PAGE: tl.constexpr, FP8_MAX: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t)
    offs = tl.arange(0, HALF)
    cos = tl.load(CS + pos * stride_cs + offs).to(tl.float32)
    sin = tl.load(CS + pos * stride_cs + HALF + offs).to(tl.float32)
    row = QKV + t * stride_t
    q1, q2, oh, od, mq = _norm_rope_heads(row, HEAD_DIM, num_q_heads, QW, cos, sin, eps, HEAD_DIM, HALF, HQ_PAD,
                                          HAS_NORM)
    dst = QO + t * stride_qo + oh[:, None] * HEAD_DIM + od[None, :]
    tl.store(dst, q1, mask=mq)
    tl.store(dst + HALF, q2, mask=mq)
    slot = tl.load(SLOT + t)
    if slot >= 0:
        k_row = row + num_q_heads * HEAD_DIM
        k1, k2, kh, kd, mk = _norm_rope_heads(k_row, HEAD_DIM, num_kv_heads, KW, cos, sin, eps, HEAD_DIM, HALF,
                                              HKV_PAD, HAS_NORM)
        cdst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct + kh[:, None] * HEAD_DIM + kd[None, :]
        cdt = KC.dtype.element_ty
        tl.store(KC + cdst, kv_cache_value(k1, KS, FP8_MAX).to(cdt), mask=mk)
        tl.store(KC + cdst + HALF, kv_cache_value(k2, KS, FP8_MAX).to(cdt), mask=mk)
        v_src = k_row + num_kv_heads * HEAD_DIM + kh[:, None] * HEAD_DIM + kd[None, :]
        tl.store(VC + cdst, kv_cache_value(tl.load(v_src, mask=mk), VS, FP8_MAX).to(cdt), mask=mk)
        tl.store(VC + cdst + HALF, kv_cache_value(tl.load(v_src + HALF, mask=mk), VS, FP8_MAX).to(cdt), mask=mk)


def qk_norm_rope_cache(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, k_cache, v_cache,
                       slot_mapping, q_norm_weight=None, k_norm_weight=None, eps=1e-6, k_scale=None,
                       v_scale=None) -> torch.Tensor:
    """One kernel for the attention input of a token: split the fused qkv row [T, (Hq + 2 Hkv) * D], RMS-normalise
    q and k per head (Qwen3; skipped without weights), rotate both (neox, full head dim), write k and v into the
    paged cache at slot_mapping (slot < 0: not written; a float8 cache: quantised with k_scale / v_scale) and
    return q [T, Hq, D]. Same rounding as rms_norm then rotary_embedding_ then reshape_and_cache."""
    T = qkv.shape[0]
    if qkv.stride(-1) != 1:
        raise ValueError("qkv must have a contiguous last dim")
    q = torch.empty((T, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    if cs.shape[-1] != head_dim:
        raise ValueError("qk_norm_rope_cache rotates the whole head (rot_dim == head_dim)")
    has_norm = q_norm_weight is not None
    page = k_cache.shape[1]
    ks, vs, fp8_max = kv_cache_args(k_cache, k_scale, v_scale)
    _qk_norm_rope_cache_kernel[(T,)](
        qkv, positions, cs, q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv, q,
        k_cache, v_cache, slot_mapping, ks, vs,
        qkv.stride(0), cs.stride(0), q.stride(0), k_cache.stride(0), k_cache.stride(1), float(eps),
        num_q_heads, num_kv_heads,
        HEAD_DIM=head_dim, HALF=head_dim // 2, HQ_PAD=triton.next_power_of_2(num_q_heads),
        HKV_PAD=triton.next_power_of_2(num_kv_heads), HAS_NORM=has_norm, PAGE=page, FP8_MAX=fp8_max,
        **_warps(num_q_heads * head_dim),
        **pdl_launch(T),
    )
    return q


# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _moe_topk_softmax_kernel(
    LOGITS, GATE, W, IDS, stride_l, stride_g, stride_w, stride_i, num_experts, scale, shared_base,
    K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, N_SHARED: tl.constexpr, S_PAD: tl.constexpr,
    RENORM: tl.constexpr, HAS_GATE: tl.constexpr, PDL: tl.constexpr,
):
    """One token: softmax over the experts, the top K (lowest index among equal scores), optionally renormalised,
    times `scale`; then N_SHARED always-selected shared-expert slots weighted 1 or sigmoid(gate)."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    x = tl.load(LOGITS + t * stride_l + offs, mask=offs < num_experts, other=float("-inf")).to(tl.float32)
    # NaN logits (a CUDA-graph padding row's garbage) rank last: every id stays a valid expert index, which the
    # layout kernel and any per-expert lookup (Gemma 4's per_expert_scale) index with
    x = tl.where(x != x, float("-inf"), x)
    m = tl.max(x, axis=0)
    denom = tl.sum(tl.exp(x - m), axis=0)
    kk = tl.arange(0, K_PAD)
    w = tl.zeros([K_PAD], tl.float32)
    ids = tl.zeros([K_PAD], tl.int32)
    s = x
    for j in tl.static_range(K):
        best = tl.max(s, axis=0)
        idx = tl.minimum(tl.min(tl.where(s == best, offs, E_PAD), axis=0), num_experts - 1)
        w = tl.where(kk == j, tl.exp(best - m), w)
        ids = tl.where(kk == j, idx, ids)
        s = tl.where(offs == idx, float("-inf"), s)
    if RENORM:
        w = w / tl.sum(w, axis=0)
    else:
        w = w / denom
    tl.store(W + t * stride_w + kk, w * scale, mask=kk < K)
    tl.store(IDS + t * stride_i + kk, ids, mask=kk < K)
    if N_SHARED > 0:
        ss = tl.arange(0, S_PAD)
        if HAS_GATE:
            g = tl.load(GATE + t * stride_g).to(tl.float32)
            gw = tl.sigmoid(g).to(GATE.dtype.element_ty).to(tl.float32)  # as torch rounds sigmoid(x) in x's dtype
        else:
            gw = 1.0
        tl.store(W + t * stride_w + K + ss, tl.zeros([S_PAD], tl.float32) + gw, mask=ss < N_SHARED)
        tl.store(IDS + t * stride_i + K + ss, shared_base + ss, mask=ss < N_SHARED)


def moe_topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool, scale: float = 1.0,
                     num_shared: int = 0, shared_gate: torch.Tensor | None = None):
    """A softmax router's selection in one launch (what select_experts does with ~10 torch kernels):
    logits [T, E] -> (weights fp32 [T, k + num_shared], ids int32 [T, k + num_shared]); the last num_shared slots
    are the fused shared experts E .. E + num_shared - 1, weighted 1 or sigmoid(shared_gate [T, 1])."""
    t, e = logits.shape
    n = top_k + num_shared
    w = torch.empty((t, n), dtype=torch.float32, device=logits.device)
    # compile-only start-up (precompile.py) skips the launch; torch lookups by these ids (Gemma 4's
    # per_expert_scale) then read the buffer as it is: zeros keep them in range
    ids = (torch.zeros if compiling_only() else torch.empty)((t, n), dtype=torch.int32, device=logits.device)
    if t:
        gate = shared_gate if shared_gate is not None else logits
        e_pad = triton.next_power_of_2(e)
        _moe_topk_softmax_kernel[(t,)](
            logits, gate, w, ids, logits.stride(0), gate.stride(0), w.stride(0), ids.stride(0), e, float(scale), e,
            K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad, N_SHARED=num_shared,
            S_PAD=triton.next_power_of_2(max(num_shared, 1)), RENORM=renormalize, HAS_GATE=shared_gate is not None,
            **_warps(e_pad), **pdl_launch(t),
        )
    return w, ids
