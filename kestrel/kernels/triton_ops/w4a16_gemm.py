"""W4A16 GEMM: Y[M, N] = X[M, K] @ dequant(QW)[K, N] (+ bias), 4-bit weights unpacked in the kernel.

The layout (kestrel/kernels/w4a16.py `triton_layout`, shared by GPTQ, AWQ and compressed-tensors): QW int32
[K/8, N], word (i, n) holding W[8i + j, n] in bits 4j..4j+3 as an unsigned nibble u; S and Z [K/G, N] (scales in
the checkpoint's 16-bit dtype, zeros as uint8); W[k, n] = (u - Z[k // G, n]) * S[k // G, n], dequantised in fp32
rounded to the scales' dtype (as the formats' libraries compute it) and then the activation dtype for the
tensor-core dot (fp32 accumulation). BLOCK_K divides G, so every K
step reads one row of scales and zeros. A program owns a BLOCK_M x BLOCK_N tile of Y; decode (M <= 16) uses
BLOCK_M 16, and where its column tiles do not fill the GPU, K is split over programs (fp32 partials summed in a
fixed order afterwards: deterministic)."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def _w4a16_gemm_kernel(
    X, QW, S, Z, B, Y, WS,
    M, N, K, stride_xm, stride_ym, k_per_split,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_kb = tl.arange(0, BLOCK_K)
    offs_wb = tl.arange(0, BLOCK_K // 8)
    shifts = ((offs_kb % 8) * 4)[:, None]
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + offs_kb
        mask_k = offs_k < k_end
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # one load per word, then each word repeated over its 8 rows (not 8 loads of the same address)
        offs_w = k0 // 8 + offs_wb
        words = tl.load(QW + offs_w.to(tl.int64)[:, None] * N + offs_n[None, :],
                        mask=(offs_w < k_end // 8)[:, None] & mask_n[None, :], other=0)
        words = tl.reshape(tl.broadcast_to(words[:, None, :], (BLOCK_K // 8, 8, BLOCK_N)), (BLOCK_K, BLOCK_N))
        u = ((words >> shifts) & 0xF).to(tl.float32)
        g = k0 // GROUP
        s = tl.load(S + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(Z + g * N + offs_n, mask=mask_n, other=0).to(tl.float32)
        # rounded to the scales' dtype first, as the formats dequantise: the same weights as the fallback's
        w = ((u - z[None, :]) * s[None, :]).to(S.dtype.element_ty).to(X.dtype.element_ty)
        acc = tl.dot(x, w, acc)
    out_mask = mask_m[:, None] & mask_n[None, :]
    if not SPLIT:
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=out_mask)
    else:  # fp32 partials [splits, M, N], summed in a fixed order by the caller (deterministic)
        tl.store(WS + (pid_k * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :], acc, mask=out_mask)


def block_k_for(group: int, k: int) -> int:
    """The K step: the largest of 128, 64, 32, 16 that divides the group (channel-wise: any, tails masked)."""
    for b in (128, 64, 32, 16):
        if group % b == 0:
            return b
    raise ValueError(f"W4A16 group size {group} is not a multiple of 16")


def tiles_for(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) by the number of rows."""
    if m <= 16:
        return 16, 64, 4
    if m <= 64:
        return 64, 64, 4
    return 128, 128, 8


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_k_for(m: int, n: int, k: int, bm: int, bn: int, bk: int, sms: int) -> int:
    """Decode rows (M <= 16) with fewer column tiles than SMs split K so that about two programs run per SM;
    each split keeps at least 4 K steps."""
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if m > 16 or tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, tiles), k // (4 * bk)))


def w4a16_gemm(x: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
               bias: torch.Tensor | None = None, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16; fp16 under the interpreter), qw int32 [K/8, N], scales/zeros [ceil(K/G), N].
    `split_k` (tests) overrides the split chosen by `split_k_for`."""
    m, k = x.shape
    n = qw.shape[1]
    assert qw.shape[0] * 8 == k, (qw.shape, k)
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    group = k if group in (-1, k) else group
    bk = 128 if group == k else block_k_for(group, k)
    if group == k:
        bk = min(bk, triton.next_power_of_2(k))
        group = triton.cdiv(k, bk) * bk  # one group: every K step reads scale row 0
    bm, bn, warps = tiles_for(m)
    if split_k is None:
        sms = _num_sms(x.device.index or 0) if x.is_cuda else 132
        split_k = split_k_for(m, n, k, bm, bn, bk, sms)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), bk) * bk  # whole K steps: each stays in one group
    split_k = triton.cdiv(k, k_per_split)
    ws = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else y
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split_k)
    _w4a16_gemm_kernel[grid](x, qw, scales, zeros, bias if bias is not None else scales, y, ws, m, n, k,
                             x.stride(0), y.stride(0), k_per_split, GROUP=group, HAS_BIAS=bias is not None,
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split_k > 1, num_warps=warps, num_stages=3)
    if split_k > 1:
        out = ws.sum(0)
        if bias is not None:
            out += bias.float()
        y.copy_(out)
    return y
