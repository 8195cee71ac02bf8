"""GEMV for decode at batch 1: y[N] = W[N, K] @ x[K], bf16/fp16, with the neighbouring elementwise work fused in.

At batch 1 a decoder layer is a chain of small launches (norm, projection, activation, ...) whose fixed costs
add up to more than the weight reads. This kernel reads W in large row tiles with plain loads and CUDA-core
FMAs (no tensor-core padding of one row to 16) and folds in:

  * a prologue, RMSNorm of x (after adding the residual stream), as the model's norm kernel computes it: every
    program holds the whole row of x, so the sum of squares costs nothing extra; program 0 writes x + residual;
  * an epilogue, SiLU-and-mul for the MLP's merged [gate; up] weight: each program reads gate row n and up row
    n + N and writes silu(gate . x) * (up . x).

So a layer's MLP is two launches (norm + gate_up + activation, down) instead of four.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.platform.triton_gates import interpreter_mode
from kestrel.kernels.triton_ops.pdl import pdl_launch, pdl_prologue

TILE = 4096  # weight elements per program and K step: BLOCK_N x BLOCK_K


def default_config(k: int) -> dict:
    """H200, bf16, CUDA-graph timed (benchmarks/batch1_kernels.py): 4096-element tiles for K <= 3072 (Qwen3-0.6B:
    qkv 3.6 us vs cuBLAS 4.0, o 2.9 vs 13.0, down 3.4 vs 6.5); two 4096-wide rows per program at K = 4096
    (Llama-8B qkv 14.5 vs 16.1, o 10.5 vs 13.4, gate_up 55.0 vs 55.7); 2048-wide steps where K is a multiple of
    2048 only (8B down, K 14336: 29.7 vs 31.3)."""
    if k >= 4096 and k % 4096 == 0:
        return {"TILE": 8192, "num_warps": 4, "num_stages": 2}
    if k > 4096 and k % 2048 == 0:
        return {"TILE": 2048, "num_warps": 8, "num_stages": 3}
    return {"TILE": TILE, "num_warps": 4, "num_stages": 3}


@triton.jit
def _gemv_kernel(
    X, W, Y, R, NW, RO,
    N, K, stride_wn, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SILU_OUT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_kb = tl.arange(0, BLOCK_K)
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    if NORM:  # K <= BLOCK_K: the whole row in one tile
        mk = offs_kb < K
        xf = tl.load(X + offs_kb, mask=mk, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            xr = (xf + tl.load(R + offs_kb, mask=mk, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
            if pid == 0:
                tl.store(RO + offs_kb, xr, mask=mk)
            xf = xr.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
        xn = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
        x_norm = (xn * tl.load(NW + offs_kb, mask=mk, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        x_norm = x_norm.to(tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs_kb
        mk = offs_k < K
        if NORM:
            x = x_norm
        else:
            x = tl.load(X + offs_k, mask=mk, other=0.0).to(tl.float32)
        wmask = mask_n[:, None] & mk[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=wmask, other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
        if SILU_OUT:
            wu = tl.load(w_rows + N * stride_wn + offs_k[None, :], mask=wmask, other=0.0,
                         eviction_policy="evict_first")
            acc_up += wu.to(tl.float32) * x[None, :]
    # rounded to the output dtype where the unfused chain stores (gate_up's output, then the activation's)
    y = tl.sum(acc, axis=1).to(Y.dtype.element_ty).to(tl.float32)
    if SILU_OUT:
        up = tl.sum(acc_up, axis=1).to(Y.dtype.element_ty).to(tl.float32)
        y = y / (1.0 + tl.exp(-y)) * up
    tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=mask_n)


def _blocks(k: int, norm: bool, tile: int) -> tuple[int, int]:
    block_k = triton.next_power_of_2(k) if norm else min(triton.next_power_of_2(k), tile)
    return max(1, tile // block_k), block_k


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, norm_weight=None, eps: float = 0.0,
         residual: torch.Tensor | None = None, silu_out: bool = False, _config: dict | None = None):
    """x [1, K] -> y [1, N] = x @ w.T (+ bias).

    norm_weight: y = rmsnorm(x + residual) @ w.T; returns (y, x + residual), or (y, x) without residual.
    silu_out: w = [gate; up] (2N rows); y = silu(x @ gate.T) * (x @ up.T), [1, N]. No bias with it.
    """
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes one row, got {tuple(x.shape)}")
    rows, k = w.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight {k}")
    if silu_out and (rows % 2 or bias is not None):
        raise ValueError("silu_out needs a merged [gate; up] weight and no bias")
    n = rows // 2 if silu_out else rows
    norm = norm_weight is not None
    cfg = {"TILE": TILE, "num_warps": 4, "num_stages": 3} if norm else default_config(k)
    if _config:
        cfg.update(_config)
    block_n, block_k = _blocks(k, norm, cfg["TILE"])
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    r = ro = nw = x  # unused unless the norm needs them
    res_out = x
    if norm:
        nw = norm_weight
        if residual is not None:
            r = residual.contiguous()
            res_out = ro = torch.empty_like(x)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, r, nw, ro, n, k, w.stride(0), float(eps),
        BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm, HAS_RESIDUAL=residual is not None, SILU_OUT=silu_out,
        **({} if interpreter_mode() else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}),
        **pdl_launch(1),
    )
    if bias is not None:
        y += bias
    return (y, res_out) if norm else y
