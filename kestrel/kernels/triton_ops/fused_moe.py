"""Fused mixture-of-experts in Triton: two grouped-GEMM launches over tokens sorted and padded by expert.

    gate_up: act[s]  = f(x[s // k] @ w13[e, :I]^T) * (x[s // k] @ w13[e, I:]^T)        (f-and-mul in the epilogue)
    down:    y[s]    = topk_weight[s] * (act[s] @ w2[e]^T)                            (routing weight in the epilogue)
    out[t]  = sum_j y[t * k + j]

s indexes (token, slot) pairs: s = t * k + j, k = the slots per token (routed top-k plus fused shared experts).
f is the experts' activation, the constexpr ACT looked up by name in EPILOGUES (SiLU; gpt-oss's clamped SwiGLU,
where "f(gate) * up" is its own formula below; GELU-tanh: Gemma 4).

Epilogue options (gpt-oss): expert biases (b13 [E, 2I] added to gate and up before the activation, b2 [E, H] to
each expert's output before its routing weight) and the activation (constexpr ACT: 0 SiLU-and-mul, 1 the clamped
SwiGLU "swigluoai", gate clamped above at 7, up to [-7, 7], gate * sigmoid(1.702 gate) * (up + 1)).

Routing stays in torch (the router's top-k ids are always valid expert indices). The layout (sort by expert, pad
each run to BLOCK_M, the block -> expert table) is one Triton launch (prefill-sized batches: a zero-fill and two
grid launches) whose outputs feed only the two Triton GEMMs, never a torch index, so the engine's start-up
pre-compilation, which turns every Triton launch into a compilation and leaves outputs unwritten
(kestrel/kernels/triton_ops/precompile.py), cannot produce an out-of-range torch index; the GEMM grid comes from
host-side sizes, not from a kernel output. `align_by_expert` is the torch reference of the same layout. Nothing
that varies with the batch is a constexpr or a specialised int (`num_valid` is `do_not_specialize`; the grid is
not part of the key), and the tile config comes from a fixed set of batch buckets
(`kestrel/kernels/configs/fused_moe.json`, defaults below), so a run compiles each bucket's variants once and
`warm_up` compiles them all at load time.

FP8 block-quantized experts (DeepSeek-style): w13/w2 float8_e4m3fn with fp32 block scales [E, N/bn, K/bk] and
activations quantized per token and per group of bk columns; BLOCK_K equals bk so each K step reads one scale of
each operand.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from kestrel.kernels.triton_ops.fp8_block import per_token_group_quant_fp8

# the gate_up epilogue's ACT constexpr by the MoE spec's activation name (kestrel/kernels/moe.py MOE_ACTIVATIONS)
EPILOGUES = {"silu": 0, "swigluoai": 1, "gelu": 2}
_GELU_TANH = tl.constexpr(1.5957691216057308)  # 2 sqrt(2/pi): gelu_tanh(x) = x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))

CONFIG_FILE = Path(__file__).resolve().parent.parent / "configs" / "fused_moe.json"
# Upper bounds of the batch buckets (tokens per forward); one config, i.e. one compiled variant, per bucket.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 1 << 30)


@triton.jit(do_not_specialize=["num_valid"])
def _moe_grouped_gemm_kernel(
    A, B, C, A_SCALE, B_SCALE, TOPK_W, SORTED_IDS, BLOCK_EXPERT, NUM_PADDED, BIAS,
    N, K, num_valid,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    stride_asm, stride_bse, stride_bsn, stride_bsk, stride_biase,
    A_ROW_DIV: tl.constexpr,  # k for gate_up (a row per token), 1 for down (a row per (token, slot))
    GATED: tl.constexpr,  # B holds [gate; up] (2N rows): return f(gate) * up (ACT)
    MUL_WEIGHT: tl.constexpr,
    FP8: tl.constexpr, GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACT: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NUM_PADDED):
        return
    slots = tl.load(SORTED_IDS + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    slot_ok = slots < num_valid  # padding entries hold num_valid
    expert = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    a_rows = (slots // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = B + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    up_off = N * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8:
            a_s = tl.load(A_SCALE + a_rows * stride_asm + kb, mask=slot_ok, other=0.0)
            bs_ptrs = B_SCALE + expert * stride_bse + kb * stride_bsk
            b_s = tl.load(bs_ptrs + (offs_n // GROUP_N) * stride_bsn, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc)
        if GATED:
            b_up = tl.load(b_ptrs + up_off, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP8:
                b_s_up = tl.load(bs_ptrs + ((offs_n + N) // GROUP_N) * stride_bsn, mask=n_ok, other=0.0)
                acc_up += tl.dot(a, b_up) * a_s[:, None] * b_s_up[None, :]
            else:
                acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:  # BIAS rows: [gate; up] (2N) when GATED, else N
        bias_row = BIAS + expert * stride_biase
        acc += tl.load(bias_row + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_row + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if ACT == 1:  # kernels/moe.py's SWIGLU_OAI_LIMIT and SWIGLU_OAI_ALPHA
            gate = tl.minimum(acc, 7.0)
            up = tl.minimum(tl.maximum(acc_up, -7.0), 7.0)
            acc = gate * tl.sigmoid(gate * 1.702) * (up + 1.0)
        elif ACT == 2:  # GELU-tanh, tanh through the sigmoid: 1 + tanh(z) = 2 sigmoid(2z)
            acc = acc * tl.sigmoid(_GELU_TANH * (acc + 0.044715 * acc * acc * acc)) * acc_up
        else:
            acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        w = tl.load(TOPK_W + slots, mask=slot_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = C + slots[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=slot_ok[:, None] & n_ok[None, :])


# ------------------------------------------------------------------------------------------------ routing layout
@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def _align_kernel(
    IDS, SORTED, BLOCK_EXPERT, NUM_PADDED, CURSOR,
    num_slots, num_blocks, num_experts,
    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BCHUNK: tl.constexpr,
):
    """One program: count slots per expert, pad each run to BLOCK_M, write the block -> expert table, fill the
    sorted array with the sentinel, then place every slot in its expert's run (an atomic cursor per expert:
    the order inside a run does not change any row's result)."""
    offs = tl.arange(0, CHUNK)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        ids = tl.load(IDS + start + offs, mask=start + offs < num_slots, other=E_PAD - 1).to(tl.int32)
        counts += tl.histogram(ids, E_PAD)  # masked lanes land in bin E_PAD - 1, never a real expert
    counts = tl.where(experts < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    tl.store(CURSOR + experts, pad_end - padded)
    tl.store(NUM_PADDED, tl.sum(padded, 0))
    boffs = tl.arange(0, BCHUNK)
    for b0 in range(0, num_blocks, BCHUNK):
        first_row = (b0 + boffs) * BLOCK_M
        e = tl.sum((pad_end[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        tl.store(BLOCK_EXPERT + b0 + boffs, tl.minimum(e, num_experts - 1), mask=b0 + boffs < num_blocks)
    for s0 in range(0, num_blocks * BLOCK_M, CHUNK):
        tl.store(SORTED + s0 + offs, num_slots, mask=s0 + offs < num_blocks * BLOCK_M)
    tl.debug_barrier()  # the cursors and the sentinel fill are visible to every thread before the scatter
    for start in range(0, num_slots, CHUNK):
        ok = start + offs < num_slots
        ids = tl.load(IDS + start + offs, mask=ok, other=0)
        pos = tl.atomic_add(CURSOR + ids, 1, mask=ok)
        tl.store(SORTED + pos, start + offs, mask=ok)


# Above this many (token, slot) pairs the layout runs as a grid (prefill: the one program costs ~3 ns a slot on
# the H200, 415 us at 16k x 8); at or below, the one-program kernel (decode: one launch, captured in CUDA graphs).
# `python -m benchmarks.moe_kernel --align` times both by slot count.
ALIGN_GRID_ABOVE = 4096
GRID_CHUNK = 1024  # slots per program of the grid path


@triton.jit(do_not_specialize=["num_slots"])
def _align_count_kernel(IDS, COUNTS, BASE, num_slots, num_experts, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Grid path, 1/2: each program histograms its chunk of slots into the global per-expert counts; the counts
    the atomics return are where its slots start inside each expert's run (BASE[program, expert])."""
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(IDS + offs, mask=offs < num_slots, other=E_PAD - 1).to(tl.int32)
    counts = tl.histogram(ids, E_PAD)  # masked lanes land in bin E_PAD - 1, never a real expert
    experts = tl.arange(0, E_PAD)
    mine = (experts < num_experts) & (counts > 0)
    base = tl.atomic_add(COUNTS + experts, counts, mask=mine, sem="relaxed")
    tl.store(BASE + pid * E_PAD + experts, base, mask=mine)


@triton.jit(do_not_specialize=["num_slots", "num_blocks", "slot_programs"])
def _align_place_kernel(
    IDS, SORTED, BLOCK_EXPERT, NUM_PADDED, COUNTS, BASE,
    num_slots, num_blocks, num_experts, slot_programs,
    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BCHUNK: tl.constexpr,
):
    """Grid path, 2/2: every program derives the padded runs from the counts. The first `slot_programs` place
    their chunk's slots (the program's BASE plus a rank from an atomic cursor on it: contention stays inside
    the program); the others write BCHUNK blocks each: the block's expert and the sentinel in its rows past the
    expert's slots. The two sets of rows are disjoint, so nothing orders the programs."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.load(COUNTS + experts)  # zero past num_experts
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    start = pad_end - padded
    if pid < slot_programs:
        offs = pid * CHUNK + tl.arange(0, CHUNK)
        ok = offs < num_slots
        ids = tl.load(IDS + offs, mask=ok, other=0).to(tl.int32)
        rank = tl.atomic_add(BASE + pid * E_PAD + ids, 1, mask=ok, sem="relaxed")
        tl.store(SORTED + tl.gather(start, ids, 0) + rank, offs, mask=ok)
    else:
        b = (pid - slot_programs) * BCHUNK + tl.arange(0, BCHUNK)
        first_row = b * BLOCK_M
        e = tl.sum((pad_end[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        tl.store(BLOCK_EXPERT + b, tl.minimum(e, num_experts - 1), mask=b < num_blocks)
        if pid == slot_programs:
            tl.store(NUM_PADDED, tl.sum(padded, 0))
        # where the slots of the block's expert end (starts and ends both grow with the expert, so the largest
        # end among runs starting at or before the block is its own; past the padded end: the last run's end)
        fill_end = tl.max(tl.where(start[None, :] <= first_row[:, None], (start + counts)[None, :], 0), axis=1)
        rows = first_row[:, None] + tl.arange(0, BLOCK_M)[None, :]
        tl.store(SORTED + rows, num_slots, mask=(rows >= fill_end[:, None]) & (b < num_blocks)[:, None])


def align_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int, grid: bool | None = None):
    """`align_by_expert` in one launch up to ALIGN_GRID_ABOVE slots (what fused_moe uses: ~30 torch launches per
    layer would dominate a batch-1 decode step), above it a zero-fill and two grid launches; `grid` forces
    either. Its outputs feed only the Triton GEMMs, never a torch index, so the compile-only start-up mode
    (outputs left unwritten) stays safe."""
    ids = topk_ids.reshape(-1)
    n, dev = ids.numel(), ids.device
    size = padded_size(n, num_experts, block_m)
    num_blocks = size // block_m
    sorted_ids = torch.empty(size, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    e_pad = triton.next_power_of_2(num_experts + 1)
    if n > ALIGN_GRID_ABOVE if grid is None else grid:
        slot_programs = triton.cdiv(n, GRID_CHUNK)
        bchunk = min(4096 // e_pad, 4096 // block_m)  # [bchunk, E_PAD] and [bchunk, BLOCK_M] tiles
        counts = torch.zeros(e_pad, dtype=torch.int32, device=dev)
        base = torch.empty(slot_programs * e_pad, dtype=torch.int32, device=dev)
        _align_count_kernel[(slot_programs,)](ids, counts, base, n, num_experts, E_PAD=e_pad, CHUNK=GRID_CHUNK)
        _align_place_kernel[(slot_programs + triton.cdiv(num_blocks, bchunk),)](
            ids, sorted_ids, block_expert, num_padded, counts, base, n, num_blocks, num_experts, slot_programs,
            E_PAD=e_pad, BLOCK_M=block_m, CHUNK=GRID_CHUNK, BCHUNK=bchunk)
        return sorted_ids, block_expert, num_padded
    cursor = torch.empty(e_pad, dtype=torch.int32, device=dev)
    # one program walks every slot: wider chunks on more warps cut its serial steps at large batches (batch 256
    # x top-8: 2048 slots in one chunk, not eight)
    chunk = min(2048, max(256, triton.next_power_of_2(n)))
    _align_kernel[(1,)](ids, sorted_ids, block_expert, num_padded, cursor, n, num_blocks, num_experts,
                        E_PAD=e_pad, BLOCK_M=block_m, CHUNK=chunk, BCHUNK=max(16, 4096 // e_pad),
                        num_warps=min(16, chunk // 64))
    return sorted_ids, block_expert, num_padded


def padded_size(num_slots: int, num_experts: int, block_m: int) -> int:
    """Length of the sorted-id array: every slot, plus at most block_m - 1 padding per expert that got slots."""
    return triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m) * block_m


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The torch reference of the routing layout (align_by_expert_triton is what runs). topk_ids [T, k] ->
    sorted_ids int32 [P]: slot ids grouped by expert, each expert's run padded to a multiple of block_m with
                          the value T * k (masked by the kernel);
    block_expert int32 [P / block_m]: the expert of each block (blocks past the padded end are skipped);
    num_padded int32 [1]: where the padded runs end.
    No host synchronisation, so it can be captured in a CUDA graph."""
    flat = topk_ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[expert_of]
    size = padded_size(n, num_experts, block_m)
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, (pad_end - padded)[expert_of] + rank, order.to(torch.int32))
    block_start = torch.arange(0, size, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, block_start, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, pad_end[-1:].to(torch.int32)


# ------------------------------------------------------------------------------------------------ configs
def config_key(num_experts: int, hidden: int, inter: int, fp8: bool) -> str:
    return f"E={num_experts},H={hidden},I={inter},dtype={'fp8_block' if fp8 else 'bf16'}"


@functools.lru_cache(maxsize=None)
def _stored_configs() -> dict:
    return json.loads(CONFIG_FILE.read_text()) if CONFIG_FILE.exists() else {}


def bucket_of(num_tokens: int) -> int:
    return next(b for b in BUCKETS if num_tokens <= b)


def default_config(bucket: int, num_experts: int, top_k: int, fp8: bool) -> dict:
    """Tiles from the average rows per expert: decode batches give each expert a handful of rows."""
    rows = bucket * top_k / num_experts
    block_k = 128 if fp8 else 64
    if rows <= 16:
        up = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, num_warps=4, num_stages=4)
        down = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, num_warps=4, num_stages=4)
    elif rows <= 48:
        up = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=block_k, num_warps=4, num_stages=3)
        down = dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=block_k, num_warps=4, num_stages=3)
    elif rows <= 128:
        up = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=block_k, num_warps=4, num_stages=3)
        down = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=block_k, num_warps=4, num_stages=3)
    else:
        up = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=block_k, num_warps=8, num_stages=3)
        down = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, num_warps=8, num_stages=3)
    return {"up": up, "down": down}


def get_config(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, fp8: bool) -> dict:
    """The bucket's stored config for this expert shape (tuned on the H200 by benchmarks/moe_kernel.py --tune),
    else the default. Both GEMMs share BLOCK_M (they share the sorted layout)."""
    bucket = bucket_of(num_tokens)
    stored = _stored_configs().get(config_key(num_experts, hidden, inter, fp8), {}).get(str(bucket))
    cfg = stored or default_config(bucket, num_experts, top_k, fp8)
    assert cfg["up"]["BLOCK_M"] == cfg["down"]["BLOCK_M"], cfg
    if fp8:
        assert cfg["up"]["BLOCK_K"] == cfg["down"]["BLOCK_K"] == 128, "FP8 block tiles need BLOCK_K = 128"
    return cfg


# ------------------------------------------------------------------------------------------------ launch
def _launch(a, b, c, a_scale, b_scale, topk_w, layout, num_valid, a_row_div, gated, mul_weight, group_n, tile,
            bias=None, act=0):
    sorted_ids, block_expert, num_padded = layout
    n_out = b.shape[1] // 2 if gated else b.shape[1]
    k = b.shape[2]
    fp8 = a_scale is not None
    cfg = dict(tile)
    grid = (block_expert.numel(), triton.cdiv(n_out, cfg["BLOCK_N"]))
    dummy = c  # never read when FP8 / MUL_WEIGHT are off
    _moe_grouped_gemm_kernel[grid](
        a, b, c, a_scale if fp8 else dummy, b_scale if fp8 else dummy, topk_w if mul_weight else dummy,
        sorted_ids, block_expert, num_padded, dummy if bias is None else bias,
        n_out, k, num_valid,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
        a_scale.stride(0) if fp8 else 0,
        b_scale.stride(0) if fp8 else 0, b_scale.stride(1) if fp8 else 0, b_scale.stride(2) if fp8 else 0,
        0 if bias is None else bias.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=mul_weight, FP8=fp8, GROUP_N=group_n,
        ACT=act, HAS_BIAS=bias is not None, **cfg,
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block_shape: tuple[int, int] | None = None, config: dict | None = None,
              w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
              activation: str = "silu") -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights / topk_ids [T, k] -> [T, H] in x's dtype.
    FP8: w13/w2 float8_e4m3fn with block scales [E, ceil(rows / bn), ceil(cols / bk)], block_shape (bn, bk).
    w13_bias [E, 2I] / w2_bias [E, H] (rows contiguous) and `activation` (EPILOGUES): see the module docstring."""
    if activation not in EPILOGUES:
        raise ValueError(f"activation {activation!r} is not one of {', '.join(EPILOGUES)}")
    act_id = EPILOGUES[activation]
    t, h = x.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    fp8 = w13_scale is not None
    if t == 0:
        return torch.zeros_like(x)
    cfg = config or get_config(t, e, k, h, inter, fp8)
    bm = cfg["up"]["BLOCK_M"]
    layout = align_by_expert_triton(topk_ids, e, bm)
    num_valid = t * k
    weights = topk_weights.reshape(-1).float().contiguous()
    group_n = block_shape[0] if fp8 else 1
    x = x.contiguous()
    act = torch.empty((num_valid, inter), dtype=x.dtype, device=x.device)
    if fp8:
        xq, xs = per_token_group_quant_fp8(x, block_shape[1])
        _launch(xq, w13, act, xs, w13_scale, None, layout, num_valid, k, True, False, group_n, cfg["up"], w13_bias,
                act_id)
        aq, as_ = per_token_group_quant_fp8(act, block_shape[1])
    else:
        _launch(x, w13, act, None, None, None, layout, num_valid, k, True, False, group_n, cfg["up"], w13_bias,
                act_id)
        aq, as_ = act, None
    y = torch.empty((num_valid, h), dtype=x.dtype, device=x.device)
    _launch(aq, w2, y, as_, w2_scale, weights, layout, num_valid, 1, False, True, group_n, cfg["down"], w2_bias)
    return y.view(t, k, h).sum(dim=1) if k > 1 else y  # one launch; torch accumulates bf16 sums in fp32


def warm_up(x_dtype: torch.dtype, w13: torch.Tensor, w2: torch.Tensor, top_k: int, max_tokens: int,
            w13_scale=None, w2_scale=None, block_shape=None, **epilogue) -> None:
    """Launch every bucket up to max_tokens (ids spread over all experts), so every variant is compiled before
    the first request: at both ends of the bucket and past each slot count where the layout changes variant
    inside it (one-program chunk sizes, the grid path), with int64 ids (torch routers) and int32 ids (the
    Triton router). Meant to run inside compile-only mode (parallel compilation)."""
    e, two_i, h = w13.shape
    edges = (256, 512, 1024, ALIGN_GRID_ABOVE)
    lo = 1
    for b in BUCKETS:
        hi = min(b, max_tokens)
        for t in sorted({lo, hi} | {p // top_k + 1 for p in edges if lo * top_k <= p < hi * top_k}):
            x = torch.zeros(t, h, dtype=x_dtype, device=w13.device)
            ids = (torch.arange(t * top_k, device=w13.device) % e).view(t, top_k)
            fused_moe(x, w13, w2, torch.ones(t, top_k, device=w13.device), ids, w13_scale, w2_scale, block_shape,
                      **epilogue)
            bm = get_config(t, e, top_k, h, two_i // 2, w13_scale is not None)["up"]["BLOCK_M"]
            align_by_expert_triton(ids.to(torch.int32), e, bm)
        if b >= max_tokens:
            break
        lo = b + 1
