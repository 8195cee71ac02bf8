"""MLA kernels in Triton over the paged latent cache `[num_blocks, block_size, kv_lora_rank + rope]`: the latent
write and the absorbed (latent-space MQA) split-K decode.

Decode: one program per (sequence, block of BLOCK_H query heads, context split). Every head of the block reads
the same latent tile once: scores = q_lat . c + q_pe . k_pe (the rope part kept separate: two dots, no concatenated
query), the values are the tile's first kv_lora_rank dims. Splits write float32 partials + log-sum-exp and the
reduce kernel merges them (a sequence held by one split is written directly).
Grids depend on shapes and python ints only, so the launch can be captured in a CUDA graph."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.attention.ops.triton_attention import (MAX_SPLITS, _LOG2E, _mm, _split_bounds, _token_offsets, _upcast,
                                                    split_decode_setup)
from kestrel.kernels.triton_ops.pdl import pdl_launch, pdl_prologue
from kestrel.platform.triton_gates import interpreter_mode


@triton.jit
def _slot_offset(slot, stride_cb, stride_ct, PAGE: tl.constexpr):
    """Element offset (int64) of cache slot `slot` in a paged cache [blocks, PAGE, ...]. By (block, row): a layer's
    cache is a view whose block stride may exceed PAGE rows (its page shares a row of the slot with other parts,
    e.g. SparseMLASpec's indexer keys, kestrel/worker/kv_allocation.py)."""
    slot = slot.to(tl.int64)
    return (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct


@triton.jit
def _write_latent_kernel(KVC, KPE, C, SLOT, stride_kvc, stride_kpe, stride_cb, stride_ct,
                         L: tl.constexpr, R: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr,
                         PAGE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOT + t)
    if slot < 0:
        return
    dst = C + _slot_offset(slot, stride_cb, stride_ct, PAGE)
    offs_l = tl.arange(0, L_PAD)
    offs_r = tl.arange(0, R_PAD)
    c = tl.load(KVC + t.to(tl.int64) * stride_kvc + offs_l, mask=offs_l < L)
    tl.store(dst + offs_l, c.to(C.dtype.element_ty), mask=offs_l < L)
    pe = tl.load(KPE + t.to(tl.int64) * stride_kpe + offs_r, mask=offs_r < R)
    tl.store(dst + L + offs_r, pe.to(C.dtype.element_ty), mask=offs_r < R)


def write_latent(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_c [T, L], k_pe [T, R] -> cache [blocks, block_size, L + R] rows at slot_mapping[:T] (slots < 0 skipped;
    any block stride)."""
    t, L = kv_c.shape
    R = k_pe.shape[1]
    if t == 0:
        return
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1 or cache.stride(-1) != 1 or cache.stride(1) != L + R:
        raise ValueError("write_latent needs contiguous rows and a [blocks, block_size, L + R] cache")
    _write_latent_kernel[(t,)](kv_c, k_pe, cache, slot_mapping, kv_c.stride(0), k_pe.stride(0), cache.stride(0),
                               cache.stride(1), L=L, R=R, L_PAD=triton.next_power_of_2(L),
                               R_PAD=triton.next_power_of_2(R), PAGE=cache.shape[1])


@triton.jit
def _load_latent_queries(QL, QP, row, heads, mask_h, stride_qlt, stride_qlh, stride_qpt, stride_qph,
                         L: tl.constexpr, R: tl.constexpr):
    """One query token's latent-space query [BLOCK_H, L] and rope query [BLOCK_H, R] (row: int64)."""
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)
    q_lat = tl.load(QL + row * stride_qlt + heads[:, None] * stride_qlh + offs_l[None, :], mask=mask_h[:, None],
                    other=0.0)
    q_pe = tl.load(QP + row * stride_qpt + heads[:, None] * stride_qph + offs_r[None, :], mask=mask_h[:, None],
                   other=0.0)
    return q_lat, q_pe


@triton.jit
def _latent_tile(q_lat, q_pe, C, offs, mask_n, m_i, l_i, acc, qk_scale, L: tl.constexpr, R: tl.constexpr,
                 UPCAST: tl.constexpr):
    """One online-softmax step over a tile of latents at element offsets `offs` (mask_n: which are read). A tile
    with nothing to read leaves the state as it was."""
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)
    c = tl.load(C + offs[:, None] + offs_l[None, :], mask=mask_n[:, None], other=0.0)  # [BLOCK_N, L]
    pe = tl.load(C + offs[:, None] + L + offs_r[None, :], mask=mask_n[:, None], other=0.0)  # [BLOCK_N, R]
    s = _mm(q_lat, tl.trans(c), UPCAST) + _mm(q_pe, tl.trans(pe), UPCAST)
    s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _mm(p.to(c.dtype), c, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _store_latent_out(O, PO, PLSE, row, heads, mask_h, m_i, l_i, acc, split, n_active, num_heads, num_splits,
                      stride_ot, stride_oh, L: tl.constexpr, SPLIT: tl.constexpr):
    """The normalised output of one (token, head block), or with several active splits its float32 partial and
    log-sum-exp for the reduce kernel."""
    offs_l = tl.arange(0, L)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if (not SPLIT) or n_active == 1:
        tl.store(O + row * stride_ot + heads[:, None] * stride_oh + offs_l[None, :], o.to(O.dtype.element_ty),
                 mask=mask_h[:, None])
    else:
        prow = (row * num_heads + heads) * num_splits + split
        tl.store(PLSE + prow, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe)), mask=mask_h)
        tl.store(PO + prow[:, None] * L + offs_l[None, :], o, mask=mask_h[:, None])


@triton.jit(do_not_specialize=["num_splits", "min_split"])
def _mla_decode_kernel(
    QL, QP, C, BT, SL, O, PO, PLSE,
    qk_scale, num_heads, num_splits, min_split,
    stride_qlb, stride_qlh, stride_qpb, stride_qph,
    stride_cb, stride_ct, stride_btb, stride_ob, stride_oh,
    L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    b64 = b.to(tl.int64)
    seq_len = tl.load(SL + b)
    per_split, n_active = _split_bounds(seq_len, num_splits, min_split, BLOCK_N)
    if split >= n_active:
        return
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < num_heads
    q_lat, q_pe = _load_latent_queries(QL, QP, b64, heads, mask_h, stride_qlb, stride_qlh, stride_qpb, stride_qph,
                                       L, R)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, L], tl.float32)
    bt_row = BT + b64 * stride_btb
    for n0 in range(start, end, BLOCK_N):
        offs, mask_n = _token_offsets(bt_row, n0, end, stride_cb, stride_ct, PAGE, BLOCK_N)
        m_i, l_i, acc = _latent_tile(q_lat, q_pe, C, offs, mask_n, m_i, l_i, acc, qk_scale, L, R, UPCAST)
    _store_latent_out(O, PO, PLSE, b64, heads, mask_h, m_i, l_i, acc, split, n_active, num_heads, num_splits,
                      stride_ob, stride_oh, L, SPLIT)


@triton.jit(do_not_specialize=["num_splits", "min_split"])
def _mla_reduce_kernel(PO, PLSE, O, SL, stride_ob, stride_oh, num_splits, min_split,
                       MAX_SPLITS: tl.constexpr, L: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """Merge one (sequence, head)'s split partials by their log-sum-exp weights."""
    pdl_prologue(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    _, n_active = _split_bounds(tl.load(SL + b), num_splits, min_split, BLOCK_N)
    if n_active == 1:
        return  # written by the decode kernel
    row = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits
    offs_s = tl.arange(0, MAX_SPLITS)
    offs_l = tl.arange(0, L)
    lse = tl.load(PLSE + row + offs_s, mask=offs_s < n_active, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp2(lse - m), axis=0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    # one split's [L] partial at a time: a [MAX_SPLITS, L] float32 tile would spill (25 us a launch at batch 1)
    acc = tl.zeros([L], tl.float32)
    for sp in range(0, n_active):
        acc += tl.exp2(tl.load(PLSE + row + sp) - m) * tl.load(PO + (row + sp) * L + offs_l)
    tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_l, (acc / denom).to(O.dtype.element_ty))


def default_decode_config(L: int, batch: int) -> dict:
    # H200 sweep (benchmarks/mla_decode.py --sweep, 16 heads, 512 + 64; docs/benchmarks.md): small batches want
    # wide tiles and short splits (1 x 32k: 38 us vs 52 with 32-token tiles; 1 x 1k: 10.9 vs 12.0), large batches
    # 32-token tiles on 4 warps (256 x 1k: 120 us, 2.5 TB/s). A [16 heads x 512] float32 accumulator.
    if batch <= 8:
        tile = {"BLOCK_N": 64, "num_warps": 8, "MIN_SPLIT": 32}
    elif batch <= 16:
        tile = {"BLOCK_N": 64, "num_warps": 8, "MIN_SPLIT": 128}
    else:
        tile = {"BLOCK_N": 32, "num_warps": 4, "MIN_SPLIT": 64, "num_stages": 3}  # 256 x 1k: 109 us vs 115 with 2
    if L <= 256:
        tile["BLOCK_N"] = 64
    return {"BLOCK_H": 16, "num_stages": 2, **tile}


def mla_decode_attention(q_lat, q_pe, cache, block_tables, seq_lens, scale, out=None, num_splits=None, *,
                         max_seq_len=None, _config=None):
    """q_lat [B, H, L], q_pe [B, H, R] (one query token per sequence, at position seq_lens[b] - 1) over the paged
    latent cache [blocks, block_size, L + R] -> out [B, H, L] (latent-space output, before W_UV). L and R must be
    powers of two (512 and 64 for DeepSeek). Rows with seq_len 0 produce zeros."""
    B, H, L = q_lat.shape
    R = q_pe.shape[-1]
    _, page, lr = cache.shape
    if lr != L + R or L & (L - 1) or R & (R - 1) or R < 16:
        raise ValueError(f"latent dims {L} + {R} (cache {lr}): both powers of two, the rope part >= 16")
    if q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("mla_decode_attention needs the last dims contiguous")
    if out is None:
        out = torch.empty_like(q_lat)
    if B == 0:
        return out
    cfg = {**default_decode_config(L, B), **(_config or {})}
    head_blocks = triton.cdiv(H, cfg["BLOCK_H"])
    max_ctx = max_seq_len if max_seq_len is not None else block_tables.shape[1] * page
    # a program here holds 16 heads x 512 latent dims: it fills the chip at half the batch a paged-attention
    # program does (H200 split sweep: 64 x 1k best at 4 splits, 256 x 1k unsplit; docs/benchmarks.md, session 7)
    num_splits, po, plse, min_split, launch = split_decode_setup(q_lat, out, cfg, 2 * head_blocks, max_ctx,
                                                                 num_splits, shortest_split=cfg["MIN_SPLIT"])
    _mla_decode_kernel[(B, head_blocks, num_splits)](
        q_lat, q_pe, cache, block_tables, seq_lens, out, po, plse,
        float(scale) * _LOG2E, H, num_splits, min_split,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        L=L, R=R, PAGE=page, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], SPLIT=num_splits > 1,
        UPCAST=_upcast(q_lat.dtype), **launch, **pdl_launch(B),
    )
    if num_splits > 1:
        _mla_reduce_kernel[(B, H)](
            po, plse, out, seq_lens, out.stride(0), out.stride(1), num_splits, min_split,
            MAX_SPLITS=MAX_SPLITS, L=L, BLOCK_N=cfg["BLOCK_N"],
            **({} if interpreter_mode() else {"num_warps": 4}), **pdl_launch(B),
        )
    return out


@triton.jit
def _expand_kv_kernel(KN, KPE, VS, ROWS, K, V, num_heads,
                      stride_kns, stride_knh, stride_pes, stride_vss, stride_vsh, stride_r, stride_h,
                      NOPE: tl.constexpr, R: tl.constexpr, VD: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = (heads < num_heads)[:, None]
    offs_d = tl.arange(0, D)
    is_nope = (offs_d < NOPE)[None, :]
    k_nope = tl.load(KN + s * stride_kns + heads[:, None] * stride_knh + offs_d[None, :], mask=mask_h & is_nope)
    pe = tl.load(KPE + s * stride_pes + offs_d - NOPE, mask=(offs_d >= NOPE) & (offs_d < NOPE + R), other=0.0)
    k = tl.where(is_nope, k_nope.to(K.dtype.element_ty), pe.to(K.dtype.element_ty)[None, :])
    mask_v = mask_h & (offs_d < VD)[None, :]
    v = tl.load(VS + s * stride_vss + heads[:, None] * stride_vsh + offs_d[None, :], mask=mask_v)
    dst = tl.load(ROWS + s) * stride_r + heads[:, None] * stride_h + offs_d[None, :]
    tl.store(K + dst, k, mask=mask_h)
    tl.store(V + dst, v.to(V.dtype.element_ty), mask=mask_v)


def expand_kv(k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, k_out: torch.Tensor,
              v_out: torch.Tensor) -> None:
    """The dense prefill's keys and values in one pass: k_nope [S, H, nope], k_pe [S, R] (shared by the heads),
    v [S, H, vd] (strided views of kv_b_proj's output are fine) -> k_out[rows[s]] = [k_nope, k_pe, zeros] and
    v_out[rows[s], :, :vd] = v, both outputs [N, H, D] contiguous. v_out's lanes >= vd and the rows not in `rows`
    are left as they were: the prefill reads no row past a context's end, and the dense path stores only its
    first vd output lanes, to which no other value lane contributes."""
    S, H, nope = k_nope.shape
    R, vd, D = k_pe.shape[-1], v.shape[-1], k_out.shape[-1]
    if nope + R > D or vd > D or k_out.shape != v_out.shape or not (k_out.is_contiguous() and v_out.is_contiguous()):
        raise ValueError(f"expand_kv: keys {nope} + {R} and values {vd} into contiguous [N, H, {D}] buffers")
    if S == 0:
        return
    if k_nope.stride(-1) != 1 or k_pe.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("expand_kv needs the last dims contiguous")
    block_h = min(triton.next_power_of_2(H), 16)
    _expand_kv_kernel[(S, triton.cdiv(H, block_h))](
        k_nope, k_pe, v, rows, k_out, v_out, H,
        k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), v.stride(0), v.stride(1), k_out.stride(0),
        k_out.stride(1), NOPE=nope, R=R, VD=vd, D=D, BLOCK_H=block_h,
        **({} if interpreter_mode() else {"num_warps": 4}),
    )
