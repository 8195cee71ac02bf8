"""Skinny GEMM for decode at small batch: Y[M, N] = X[M, K] @ W[N, K]^T with M <= 16, bf16/fp16.

At M = 1..16 a linear layer is a read of its weight; cuBLAS picks tiles built for larger M and reaches a fraction
of the copy bandwidth on the small matrices of a 0.6B model. Here each program owns BLOCK_N output columns and
one of SPLIT_K slices of K (the query rows padded to 16 for the tensor cores, which cost nothing at this
intensity). With SPLIT_K > 1 the slices write fp32 partials; the last slice of a column tile to finish (an atomic
counter per tile) sums them and writes Y, then resets its counter, so one launch does everything and the kernel
can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kestrel.kernels.triton_ops.counters import CAPACITY as MAX_TILES, tile_counters
from kestrel.kernels.triton_ops.pdl import pdl_launch, pdl_prologue

M_MAX = 16


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    X, W, Y, WS, CNT,
    M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, 16)
    mask_m = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        offs_k = k_start + k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    y_ptr = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    y_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=y_mask)
    else:
        part = WS + (pid_k * 16 + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(part, acc, mask=y_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        done = tl.atomic_add(CNT + pid_n, 1)  # acq_rel: our partial is visible to whoever sees the count
        if done == SPLIT_K - 1:
            total = tl.zeros([16, BLOCK_N], tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(WS + (s * 16 + offs_m[:, None]) * N + offs_n[None, :], mask=y_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptr, total.to(Y.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(CNT + pid_n, 0)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # the Triton interpreter: any number will do
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> dict:
    """32 columns x 128-deep K tiles, K split in 4 where the column tiles alone leave the chip idle.

    H200, batch 1, bf16 (benchmarks/gemv_check.py --sweep, CUDA-graph timed): N 1024 x K 2048 4.7 us (cuBLAS
    12.7), N 1024 x K 3072 5.0 us (cuBLAS 6.4) with BLOCK_N 32 / BLOCK_K 128 / SPLIT_K 4. At N >= 4096 cuBLAS
    was as fast or faster (4096 x 1024: 4.1 vs 4.6 us), which is why TritonSkinnyDenseLinear keeps it there."""
    tiles = triton.cdiv(n, 32)
    split = 4 if tiles < 2 * num_sms and k >= 4 * 2 * 128 else 1
    return {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": split, "num_warps": 4, "num_stages": 4}


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, _config: dict | None = None):
    """x [M, K] (M <= 16) @ w[N, K]^T (+ bias) -> [M, N] in x's dtype."""
    m, k = x.shape
    n = w.shape[0]
    if m > M_MAX:
        raise ValueError(f"skinny_gemm serves M <= {M_MAX}, got {m}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = dict(default_config(m, n, k, _num_sms(x.device)))
    if _config:
        cfg.update(_config)
    split = cfg["SPLIT_K"]
    tiles = triton.cdiv(n, cfg["BLOCK_N"])
    if split > 1 and tiles > MAX_TILES:
        split = cfg["SPLIT_K"] = 1
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    ws = torch.empty((split, 16, n), dtype=torch.float32, device=x.device) if split > 1 else y
    cnt = tile_counters(x.device) if split > 1 else y
    _skinny_gemm_kernel[(tiles, split)](
        x, w, y, ws, cnt, m, n, k, x.stride(0), w.stride(0), y.stride(0), k_per_split, **cfg, **pdl_launch(m))
    if bias is not None:
        y += bias
    return y
