"""DSA (sparse MLA) kernels in Triton, over the paged caches of SparseMLASpec: the latent cache
[blocks, block_size, L + R] and the indexer-key cache [blocks, block_size, D_I].

- `write_index_keys`: one row per token into the key cache (slot -1: padding, skipped); an FP8 cache
  (kestrel/attention/indexer_keys.py: keys [blocks, bs, D] float8 + scales [blocks, bs, 1] float32) takes the
  already rotated and quantized (keys, scales) part by part.
- `indexer_scores`: I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) for the positions s of token t's request,
  -inf past the token's own position. One program per (token, tile of BLOCK_N positions): every head's query sits
  in registers and the weighted head sum happens there, so only [T, width] float32 scores reach memory. With FP8
  keys each position's term is times its key scale (the query's scales are in w); the float8 query and keys go to
  float16 for the dot (exact: every e4m3 value is a float16 value; products exact, float32 sums), one packed
  convert per two values. They went to bf16 before, which Triton does on sm_90 as e4m3 -> f16 -> bf16 (sm_90
  SASS a thread: 64 F2FP + 128 F2F + 64 PRMT, now 64 F2FP) for the [64 heads x 128] query and the [64 x 128] key
  tile of every program: conversions run at a quarter of the FMA rate, the likely reason the FP8 scores ran 2.3x
  slower than bf16 at batch 64 on an H200 (171.8 vs 74.4 us at 8k; to be confirmed by benchmarks/dsa_decode.py).
- `select_topk`: the scores in row chunks under a byte budget, then torch.topk per row, or the radix select of
  triton_topk.py (topk_impl="radix"); -1 where a row has fewer visible positions than k. static_width (CUDA-graph
  decode): the width is the graph's longest context, only each row's visible scores are computed, and the radix
  select reads each row's length from the token positions on the device.
- `sparse_mla_attention`: absorbed MLA of each token over its index list: one program per (token, block of
  BLOCK_H heads, split of the list), reading the selected latents tile by tile (online softmax, the rope dot kept
  separate as in the dense decode kernel, triton_mla.py, whose reduce kernel merges the splits). Entries -1 are
  never read. Serves decode and prefill tokens alike."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.attention.ops.triton_attention import (MAX_SPLITS, _LOG2E, _mm, _split_bounds, _upcast,
                                                    choose_num_splits, split_decode_setup)
from kestrel.attention.ops.triton_mla import (_latent_tile, _load_latent_queries, _mla_reduce_kernel, _slot_offset,
                                              _store_latent_out, default_decode_config)
from kestrel.attention.ops.triton_topk import _top_byte_histogram, radix_histogram, radix_topk
from kestrel.platform.triton_gates import interpreter_mode

SCORE_BUDGET_BYTES = 256 << 20  # float32 scores of one row chunk, [rows, context]
STRIDED_PROGRAMS = 4096  # visible_only scores: about this many programs in all, each striding over its row


@triton.jit
def _write_rows_kernel(X, C, SLOT, stride_x, stride_cb, stride_ct, D: tl.constexpr, D_PAD: tl.constexpr,
                       PAGE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOT + t)
    if slot < 0:
        return
    offs = tl.arange(0, D_PAD)
    x = tl.load(X + t.to(tl.int64) * stride_x + offs, mask=offs < D)
    tl.store(C + _slot_offset(slot, stride_cb, stride_ct, PAGE) + offs, x.to(C.dtype.element_ty), mask=offs < D)


def write_index_keys(index_k, cache, slot_mapping: torch.Tensor) -> None:
    """index_k [T, D] -> cache [blocks, block_size, D] rows at slot_mapping[:T] (any block stride: the layer's
    view of its page, the latents before the keys). FP8: (keys [T, D], scales [T, 1]) into the (keys, scales)
    cache parts."""
    if isinstance(cache, tuple):
        for rows, part in zip(index_k, cache):
            write_index_keys(rows, part, slot_mapping)
        return
    t, d = index_k.shape
    if t == 0:
        return
    if index_k.stride(-1) != 1 or cache.stride(-1) != 1 or cache.stride(1) != d:
        raise ValueError("write_index_keys needs contiguous rows and a [blocks, block_size, D] cache")
    _write_rows_kernel[(t,)](index_k, cache, slot_mapping, index_k.stride(0), cache.stride(0), cache.stride(1), D=d,
                             D_PAD=triton.next_power_of_2(d), PAGE=cache.shape[1])


@triton.jit
def _index_key_tile(K, KS, BT, req, offs_n, visible, offs_d, stride_kb, stride_kt, stride_ksb, stride_kst,
                    stride_btb, PAGE: tl.constexpr, KEY_FP8: tl.constexpr, FP8_DOT: tl.constexpr):
    """Positions offs_n of request req from the paged key cache: ([BLOCK_N, D] keys ready for the dot, their
    FP8 scales [BLOCK_N] (1.0 without FP8)); invisible positions read as 0."""
    blk = tl.load(BT + req * stride_btb + offs_n // PAGE, mask=visible, other=0).to(tl.int64)
    k = tl.load(K + blk[:, None] * stride_kb + (offs_n % PAGE)[:, None] * stride_kt + offs_d[None, :],
                mask=visible[:, None], other=0.0)
    if KEY_FP8 and not FP8_DOT:
        k = k.to(tl.float16)
    scale = tl.full(offs_n.shape, 1.0, tl.float32)
    if KEY_FP8:
        scale = tl.load(KS + blk * stride_ksb + (offs_n % PAGE).to(tl.int64) * stride_kst, mask=visible, other=0.0)
    return k, scale


@triton.jit(do_not_specialize=["width", "num_heads"])
def _indexer_scores_kernel(Q, W, K, KS, BT, REQ, QPOS, S, HIST, width, num_heads,
                           stride_qt, stride_qh, stride_wt, stride_kb, stride_kt, stride_ksb, stride_kst,
                           stride_btb, stride_st,
                           D: tl.constexpr, H_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                           UPCAST: tl.constexpr, KEY_FP8: tl.constexpr, FP8_DOT: tl.constexpr,
                           VISIBLE_ONLY: tl.constexpr, FIRST_HIST: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    q_pos = tl.load(QPOS + t)
    # the whole row (-inf past q_pos), or only its visible part, each program striding over the tiles
    end = width
    if VISIBLE_ONLY:
        end = tl.minimum(width, q_pos + 1)
    heads = tl.arange(0, H_PAD)
    mask_h = heads < num_heads
    offs_d = tl.arange(0, D)
    # the token's queries and head weights once a program (a program with no visible tile reads none)
    needed = tl.program_id(1) * BLOCK_N <= q_pos
    q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_h[:, None] & needed,
                other=0.0)  # [H_PAD, D]
    w = tl.load(W + t * stride_wt + heads, mask=mask_h & needed, other=0.0).to(tl.float32)
    if KEY_FP8 and not FP8_DOT:
        q = q.to(tl.float16)  # exact (every e4m3 value is a float16 value), one cvt per 2 (bf16: 3 per 2)
    if FIRST_HIST:  # the radix select's first pass over the scores this program writes
        hist = tl.zeros([256], tl.int32)
    for n0 in range(tl.program_id(1) * BLOCK_N, end, tl.num_programs(1) * BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        visible = offs_n <= q_pos
        in_row = offs_n < width
        score = tl.full([BLOCK_N], float("-inf"), tl.float32)
        if n0 <= q_pos:
            req = tl.load(REQ + t).to(tl.int64)
            k, k_scale = _index_key_tile(K, KS, BT, req, offs_n, visible, offs_d, stride_kb, stride_kt, stride_ksb,
                                         stride_kst, stride_btb, PAGE, KEY_FP8, FP8_DOT)
            logits = tl.maximum(_mm(q, tl.trans(k), UPCAST), 0.0)  # [H_PAD, BLOCK_N]
            weighted = tl.sum(logits * w[:, None], axis=0)
            if KEY_FP8:
                weighted = weighted * k_scale
            score = tl.where(visible, weighted, float("-inf"))
        tl.store(S + t * stride_st + offs_n, score, mask=in_row)
        if FIRST_HIST:  # the candidates the select reads: the row, or (its last = q_pos) the visible part
            if VISIBLE_ONLY:
                hist += _top_byte_histogram(score, in_row & visible)
            else:
                hist += _top_byte_histogram(score, in_row)
    if FIRST_HIST:
        bins = tl.arange(0, 256)
        tl.atomic_add(HIST + t * 4 * 256 + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit(do_not_specialize=["width", "num_heads"])
def _indexer_scores_rows_kernel(Q, W, K, KS, BT, REQ, QPOS, S, TILE0, TILE_END, width, num_heads,
                                stride_qt, stride_qh, stride_wt, stride_kb, stride_kt, stride_ksb, stride_kst,
                                stride_btb, stride_st,
                                D: tl.constexpr, H_PAD: tl.constexpr, ROWS: tl.constexpr, PAGE: tl.constexpr,
                                BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, KEY_FP8: tl.constexpr,
                                FP8_DOT: tl.constexpr):
    """indexer_scores for up to ROWS consecutive rows of one request a program (a prefill's rows): each key tile
    is read once for all of them, one [ROWS * H_PAD, D] x [D, BLOCK_N] dot. Whole rows, -inf past each position."""
    tile = tl.program_id(0)
    r0 = tl.load(TILE0 + tile).to(tl.int64)
    r_end = tl.load(TILE_END + tile).to(tl.int64)
    rows = r0 + tl.arange(0, ROWS)
    in_tile = rows < r_end
    pos = tl.load(QPOS + rows, mask=in_tile, other=-1)  # [ROWS]
    last = tl.max(pos, axis=0)
    req = tl.load(REQ + r0).to(tl.int64)
    qrow = r0 + tl.arange(0, ROWS * H_PAD) // H_PAD  # [ROWS * H_PAD]: row-major (row, head)
    heads = tl.arange(0, ROWS * H_PAD) % H_PAD
    mask_q = (qrow < r_end) & (heads < num_heads)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + qrow[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_q[:, None],
                other=0.0)
    w = tl.load(W + qrow * stride_wt + heads, mask=mask_q, other=0.0).to(tl.float32)
    if KEY_FP8 and not FP8_DOT:
        q = q.to(tl.float16)
    for n0 in range(tl.program_id(1) * BLOCK_N, width, tl.num_programs(1) * BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        visible = pos[:, None] >= offs_n[None, :]  # [ROWS, BLOCK_N]
        score = tl.full([ROWS, BLOCK_N], float("-inf"), tl.float32)
        if n0 <= last:
            k, k_scale = _index_key_tile(K, KS, BT, req, offs_n, offs_n <= last, offs_d, stride_kb, stride_kt,
                                         stride_ksb, stride_kst, stride_btb, PAGE, KEY_FP8, FP8_DOT)
            logits = tl.maximum(_mm(q, tl.trans(k), UPCAST), 0.0) * w[:, None]  # [ROWS * H_PAD, BLOCK_N]
            weighted = tl.sum(tl.reshape(logits, (ROWS, H_PAD, BLOCK_N)), axis=1)
            if KEY_FP8:
                weighted = weighted * k_scale[None, :]
            score = tl.where(visible, weighted, float("-inf"))
        tl.store(S + rows[:, None] * stride_st + offs_n[None, :], score,
                 mask=in_tile[:, None] & (offs_n < width)[None, :])


def row_tiles(token_req: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row, end row) int32 of each tile of at most `rows` consecutive rows of one request (the rows of a
    request are contiguous in a step). Reads the tile count on the host."""
    t = token_req.shape[0]
    idx = torch.arange(t, device=token_req.device)
    new_run = torch.ones(t, dtype=torch.bool, device=token_req.device)
    new_run[1:] = token_req[1:] != token_req[:-1]
    run_start = torch.cummax(torch.where(new_run, idx, torch.zeros_like(idx)), dim=0).values
    starts = torch.nonzero(new_run | ((idx - run_start) % rows == 0)).flatten()
    ends = torch.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1:] = t
    return starts.to(torch.int32), torch.minimum(ends, starts + rows).to(torch.int32)


def indexer_scores(index_q, index_w, cache, block_tables, token_req, q_pos, width: int, out=None,
                   block_n: int = 64, visible_only: bool = False, _fp8_dot: bool = False,
                   hist: torch.Tensor | None = None, rows_per_program: int = 1) -> torch.Tensor:
    """index_q [T, H, D], index_w [T, H] (float32, scales folded in), the key cache [blocks, page, D], each token's
    request (token_req [T]) and position (q_pos [T]) -> [T, width] float32 scores over positions 0..width-1,
    -inf past each token's position. D a power of two >= 16. An FP8 cache: (keys [blocks, page, D] float8, scales
    [blocks, page, 1] float32), index_q float8 with its scales folded into index_w (indexer_keys.py).
    visible_only: only positions 0..q_pos are written (the rest of each row is left as it was), by a grid sized
    from T alone, each program striding over its row's tiles: the CUDA-graph path, whose width is the graph's
    longest context and whose reader (radix_topk with last=q_pos) reads no further.
    _fp8_dot (FP8 keys; for benchmarks/dsa_decode.py until an H200 timing decides): the float8 tiles straight into
    the FP8 MMA (no conversion at all; Hopper's FP8 MMA accumulates with less precision than float32, as
    DeepSeek's own FP8 indexer does) instead of into float16 first (exact products, float32 sums).
    hist: a triton_topk.radix_histogram(T): each row's first radix pass over the scores the top-k will read (the
    whole row, or with visible_only 0..q_pos) is added into hist[:, 0], for radix_topk(hist=hist).
    rows_per_program (a power of two; not with visible_only or hist): up to that many consecutive rows of one
    request share each key tile (_indexer_scores_rows_kernel): a prefill reads its keys that many times less."""
    cache, scales = cache if isinstance(cache, tuple) else (cache, None)
    t, h, d = index_q.shape
    if d & (d - 1) or d < 16 or cache.shape[-1] != d:
        raise ValueError(f"index head dim {d} (cache {cache.shape[-1]}): a power of two >= 16")
    if index_q.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("indexer_scores needs the last dims contiguous")
    if out is None:
        out = torch.empty(t, width, dtype=torch.float32, device=index_q.device)
    if t == 0 or width == 0:
        return out
    if hist is not None and (hist.dtype != torch.int32 or hist.shape != (t, 4, 256) or not hist.is_contiguous()):
        raise ValueError(f"hist must be a contiguous int32 [{t}, 4, 256] (radix_histogram)")
    fp8 = scales is not None
    ks = scales if fp8 else cache  # unread without FP8
    tiles = triton.cdiv(width, block_n)
    if rows_per_program > 1:
        if visible_only or hist is not None or rows_per_program & (rows_per_program - 1):
            raise ValueError("rows_per_program > 1 (a power of two) computes whole rows, without hist")
        starts, ends = row_tiles(token_req, rows_per_program)
        h_pad = max(16, triton.next_power_of_2(h))
        _indexer_scores_rows_kernel[(starts.shape[0], tiles)](
            index_q, index_w, cache, ks, block_tables, token_req, q_pos, out, starts, ends, width, h,
            index_q.stride(0), index_q.stride(1), index_w.stride(0), cache.stride(0), cache.stride(1),
            ks.stride(0), ks.stride(1), block_tables.stride(0), out.stride(0),
            D=d, H_PAD=h_pad, ROWS=rows_per_program, PAGE=cache.shape[1], BLOCK_N=block_n,
            UPCAST=_upcast(index_q.dtype), KEY_FP8=fp8, FP8_DOT=fp8 and _fp8_dot,
            num_warps=8 if rows_per_program * h_pad >= 128 else 4)
        return out
    programs = min(tiles, max(1, STRIDED_PROGRAMS // t)) if visible_only else tiles
    _indexer_scores_kernel[(t, programs)](
        index_q, index_w, cache, ks, block_tables, token_req, q_pos, out, out if hist is None else hist, width, h,
        index_q.stride(0), index_q.stride(1), index_w.stride(0), cache.stride(0), cache.stride(1),
        ks.stride(0), ks.stride(1), block_tables.stride(0), out.stride(0),
        D=d, H_PAD=max(16, triton.next_power_of_2(h)), PAGE=cache.shape[1], BLOCK_N=block_n,
        UPCAST=_upcast(index_q.dtype), KEY_FP8=fp8, FP8_DOT=fp8 and _fp8_dot, VISIBLE_ONLY=visible_only,
        FIRST_HIST=hist is not None)
    return out


def select_topk(index_q, index_w, cache, block_tables, token_req, q_pos, width: int, index_topk: int,
                budget_bytes: int = SCORE_BUDGET_BYTES, topk_impl: str = "torch",
                static_width: bool = False, first_pass_in_scores: bool = False,
                rows_per_program: int = 1) -> torch.Tensor:
    """Each token's min(index_topk, visible) best positions -> [T, index_topk] int32, -1 padded; the scores
    exist one row chunk at a time (rows x width x 4 bytes <= budget_bytes). `cache` as in indexer_scores.
    topk_impl: "torch" (torch.topk) or "radix" (triton_topk.radix_topk, no sort).
    static_width (CUDA graphs): `width` is the graph's longest context, not the step's, and nothing is read on the
    host: the radix select reads each row's length from q_pos on the device, and only visible scores are
    computed (indexer_scores' visible_only), so the cost follows the real contexts, not the width.
    first_pass_in_scores (with the radix select; off until GPU timings decide): the scores kernel also makes the
    select's first histogram pass (indexer_scores' hist), so the select skips it; the same selection.
    rows_per_program: indexer_scores' (eager steps only: the CUDA-graph path keeps one row a program)."""
    if topk_impl not in ("torch", "radix"):
        raise ValueError(f"topk_impl {topk_impl!r}: torch or radix")
    t = index_q.shape[0]
    out = torch.full((t, index_topk), -1, dtype=torch.int32, device=index_q.device)
    k = min(index_topk, width)
    if t == 0 or k == 0:
        return out
    rows = max(1, budget_bytes // (4 * width))
    radix = static_width or topk_impl == "radix"
    for r0 in range(0, t, rows):
        r1 = min(t, r0 + rows)
        hist = radix_histogram(r1 - r0, index_q.device) if radix and first_pass_in_scores else None
        scores = indexer_scores(index_q[r0:r1], index_w[r0:r1], cache, block_tables, token_req[r0:r1],
                                q_pos[r0:r1], width, visible_only=static_width, hist=hist,
                                rows_per_program=1 if static_width or hist is not None else rows_per_program)
        if static_width:
            radix_topk(scores, k, out[r0:r1], last=q_pos[r0:r1], hist=hist)
        elif radix:
            radix_topk(scores, k, out[r0:r1], hist=hist)
        else:
            best = scores.topk(k, dim=-1)
            out[r0:r1, :k] = best.indices.to(torch.int32).masked_fill_(best.values == float("-inf"), -1)
    return out


@triton.jit(do_not_specialize=["num_heads", "topk", "num_splits", "min_split"])
def _sparse_mla_kernel(QL, QP, C, BT, REQ, IDX, O, PO, PLSE, qk_scale, num_heads, topk, num_splits, min_split,
                       stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_cb, stride_ct, stride_btb,
                       stride_it, stride_ot, stride_oh,
                       L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    per_split, n_active = _split_bounds(topk, num_splits, min_split, BLOCK_N)
    if split >= n_active:
        return
    start = split * per_split
    end = tl.minimum(start + per_split, topk)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < num_heads
    q_lat, q_pe = _load_latent_queries(QL, QP, t, heads, mask_h, stride_qlt, stride_qlh, stride_qpt, stride_qph,
                                       L, R)
    req = tl.load(REQ + t).to(tl.int64)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, L], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        pos = tl.load(IDX + t * stride_it + offs_n, mask=offs_n < end, other=-1)
        valid = pos >= 0
        pos = tl.where(valid, pos, 0)
        blk = tl.load(BT + req * stride_btb + pos // PAGE, mask=valid, other=0).to(tl.int64)
        offs = blk * stride_cb + (pos % PAGE).to(tl.int64) * stride_ct
        m_i, l_i, acc = _latent_tile(q_lat, q_pe, C, offs, valid, m_i, l_i, acc, qk_scale, L, R, UPCAST)
    # with several active splits: partials merged by triton_mla's reduce kernel (same bounds from topk)
    _store_latent_out(O, PO, PLSE, t, heads, mask_h, m_i, l_i, acc, split, n_active, num_heads, num_splits,
                      stride_ot, stride_oh, L, SPLIT)


def default_sparse_config(num_tokens: int, L: int = 512) -> dict:
    # The dense MLA decode's tiles (triton_mla.default_decode_config, swept on the H200): up to 16 tokens 64-token
    # tiles on 8 warps; above, 32-token tiles on 4 warps, 3 stages. The first guess here kept 64-token tiles on 4
    # warps above 16 tokens, which spills at 512 + 64 (ptxas -v for sm_90: 255 registers and 248 bytes of spill
    # stores and loads a thread in the tile loop; 32-token tiles: 230 registers, none). MIN_SPLIT None: splits
    # as short as one BLOCK_N tile (sparse_num_splits).
    return {**default_decode_config(L, num_tokens), "MIN_SPLIT": None}


def _resolved_config(num_tokens: int, _config: dict | None, L: int = 512) -> dict:
    cfg = {**default_sparse_config(num_tokens, L), **(_config or {})}
    if cfg["MIN_SPLIT"] is None:
        cfg["MIN_SPLIT"] = cfg["BLOCK_N"]
    return cfg


def sparse_num_splits(num_tokens: int, num_heads: int, topk: int, num_sms: int = 132,
                      _config: dict | None = None, L: int = 512) -> int:
    """Splits of each token's k selected positions, from the shapes only (so a CUDA graph may capture them):
    triton_mla's rule for the dense decode (choose_num_splits over (token, head block) programs, a program of 16
    heads x 512 latent dims weighing two), none shorter than MIN_SPLIT tokens, by default one BLOCK_N tile.
    So a small batch fills the chip: 1 token x 16 heads x k 2048 -> 32 splits of 64 (32 programs; with the first
    guess, MIN_SPLIT 256, it was 8 programs on a 132-SM H200: 27.5 us for 2.4 MB); 64 tokens -> 4 splits (256
    programs, as before); from 132 tokens on (264 programs, twice the SMs) none. The reduce kernel then merges up
    to 32 float32 partials [16, 512] a token (1 MB at batch 1, in L2)."""
    cfg = _resolved_config(num_tokens, _config, L)
    head_blocks = triton.cdiv(num_heads, cfg["BLOCK_H"])
    return choose_num_splits(num_tokens, 2 * head_blocks, topk, num_sms, min_split=cfg["MIN_SPLIT"])


def sparse_mla_attention(q_lat, q_pe, cache, block_tables, token_req, topk_indices, scale, out=None,
                         num_splits=None, _config=None) -> torch.Tensor:
    """q_lat [T, H, L], q_pe [T, H, R] over each token's selected positions (topk_indices [T, k], request-local,
    -1: none) of the latent cache [blocks, page, L + R] -> [T, H, L] (before W_UV). L, R powers of two, R >= 16.
    Few tokens split the k selected positions across programs (num_splits: a power of two, default
    sparse_num_splits from the shapes) and merge the partials by their log-sum-exps."""
    t, h, L = q_lat.shape
    R = q_pe.shape[-1]
    if cache.shape[-1] != L + R or L & (L - 1) or R & (R - 1) or R < 16:
        raise ValueError(f"latent dims {L} + {R} (cache {cache.shape[-1]}): both powers of two, rope >= 16")
    if q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1 or cache.stride(-1) != 1 or topk_indices.stride(-1) != 1:
        raise ValueError("sparse_mla_attention needs the last dims contiguous")
    if out is None:
        out = torch.empty_like(q_lat)
    k = topk_indices.shape[1]
    if t == 0:
        return out
    cfg = _resolved_config(t, _config, L)
    head_blocks = triton.cdiv(h, cfg["BLOCK_H"])
    # num_splits None: split_decode_setup's choose_num_splits with these programs and MIN_SPLIT (sparse_num_splits)
    num_splits, po, plse, min_split, launch = split_decode_setup(q_lat, out, cfg, 2 * head_blocks, k, num_splits,
                                                                 shortest_split=cfg["MIN_SPLIT"])
    _sparse_mla_kernel[(t, head_blocks, num_splits)](
        q_lat, q_pe, cache, block_tables, token_req, topk_indices, out, po, plse, float(scale) * _LOG2E, h, k,
        num_splits, min_split, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(1), block_tables.stride(0), topk_indices.stride(0), out.stride(0),
        out.stride(1), L=L, R=R, PAGE=cache.shape[1], BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"],
        SPLIT=num_splits > 1, UPCAST=_upcast(q_lat.dtype), **launch)
    if num_splits > 1:
        lengths = torch.full((t,), k, dtype=torch.int32, device=q_lat.device)
        _mla_reduce_kernel[(t, h)](po, plse, out, lengths, out.stride(0), out.stride(1), num_splits, min_split,
                                   MAX_SPLITS=MAX_SPLITS, L=L, BLOCK_N=cfg["BLOCK_N"], PDL=False,
                                   **({} if interpreter_mode() else {"num_warps": 4}))
    return out
