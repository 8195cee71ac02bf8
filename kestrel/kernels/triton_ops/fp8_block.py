"""Block-scaled FP8 GEMM and per-token-group FP8 activation quantization in Triton.

C[m, n] = sum_kb  As[m, kb] * Bs[row(n), kb] * sum_{k in block kb} A[m, k] * B[n, k]

A: [M, K] fp8 activations with per-token-group scales As [M, ceil(K / BK)] (groups of BK columns).
B: [N, K] fp8 weights (row-major, i.e. K-major as FP8 MMA wants) with block scales Bs, where row(n) = n // group_n
(group_n = the weight block's N size, or 1 when scales were expanded to one row per output row).

The number of K blocks is a compile-time constant (one compile per distinct K), which also keeps the kernel
runnable in the Triton interpreter (TRITON_INTERPRET=1) on the CPU.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_as_m, stride_as_k, stride_bs_n, stride_bs_k,
    group_n,
    NUM_K_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped ordering: consecutive programs share B tiles, for L2 reuse
    pids_per_group = GROUP_M * num_pid_n
    group_id = pid // pids_per_group
    first_m = group_id * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % pids_per_group) % group_rows)
    pid_n = (pid % pids_per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_a = offs_m % M  # out-of-range rows/cols read valid memory; their results are masked at the store
    rows_b = offs_n % N

    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + rows_b[None, :] * stride_bn + offs_k[:, None] * stride_bk
    as_ptrs = as_ptr + rows_a * stride_as_m
    bs_ptrs = bs_ptr + (rows_b // group_n) * stride_bs_n

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, NUM_K_BLOCKS):
        k_left = K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        a_s = tl.load(as_ptrs + kb * stride_as_k)
        b_s = tl.load(bs_ptrs + kb * stride_bs_k)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c = acc.to(c_ptr.dtype.element_ty)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, c, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _per_token_group_quant_kernel(
    x_ptr, q_ptr, s_ptr,
    K, stride_xm, stride_qm, stride_sm,
    eps, fp8_max,
    GROUP: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(axis=0)
    g = tl.program_id(axis=1)
    lane = tl.arange(0, BLOCK)
    cols = g * GROUP + lane
    mask = (lane < GROUP) & (cols < K)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), eps)
    # IEEE round-to-nearest division, as torch divides: Triton's default fp32 `/` is approximate, and a quotient
    # one ulp off flips the fp8 rounding of ~0.1% of the values against the torch quantizer
    scale = tl.math.div_rn(amax, fp8_max)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + g, scale)


def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int, dtype: torch.dtype = torch.float8_e4m3fn, eps: float = 1e-10
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] fp8, scales [M, ceil(K / group_size)] fp32); same math as the torch helper."""
    assert x.dim() == 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    groups = math.ceil(k / group_size)
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, s
    _per_token_group_quant_kernel[(m, groups)](
        x, q, s, k, x.stride(0), q.stride(0), s.stride(0), eps, float(torch.finfo(dtype).max),
        GROUP=group_size, BLOCK=triton.next_power_of_2(group_size),
    )
    return q, s


def default_config(m: int, n: int, is_rocm: bool = False) -> dict:
    """A launch configuration from the problem size: small M (decode) takes narrow tiles to fill the GPU."""
    if m <= 16:
        block_m, block_n, warps = 16, 64, 4
    elif m <= 32:
        block_m, block_n, warps = 32, 64, 4
    elif m <= 64:
        block_m, block_n, warps = 64, 128, 4
    else:
        block_m, block_n, warps = 128, 128, 8
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "GROUP_M": 8, "num_warps": warps, "num_stages": 2 if is_rocm else 3}


def fp8_block_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_n: int,
    block_k: int,
    out_dtype: torch.dtype = torch.bfloat16,
    config: dict | None = None,
) -> torch.Tensor:
    """a [M, K] fp8 with a_scale [M, ceil(K/block_k)]; b [N, K] fp8 with b_scale [ceil(N/group_n), ceil(K/block_k)]."""
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1], (a.shape, b.shape)
    m, k = a.shape
    n = b.shape[0]
    kb = math.ceil(k / block_k)
    assert a_scale.shape == (m, kb), (a_scale.shape, (m, kb))
    assert b_scale.shape[1] == kb and b_scale.shape[0] == math.ceil(n / group_n), (b_scale.shape, n, group_n)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    cfg = dict(config or default_config(m, n, bool(getattr(torch.version, "hip", None))))
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _fp8_block_gemm_kernel[grid](
        a, b, c, a_scale, b_scale,
        m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        group_n,
        NUM_K_BLOCKS=kb, BLOCK_K=block_k,
        **cfg,
    )
    return c
