"""Batched LoRA for a batch that mixes adapters: shrink (y = x A_s^T) and expand (out += y B_s^T) where s is each
token's adapter slot. Tokens are grouped by slot (a segment per slot over a sorted token list, as punica's SGMV
does for prefill); a decode token is a segment of one row of its slot (BGMV's case). The grid is
(token blocks, column blocks), of a fixed size for a given token count (cdiv(T, BLOCK_M) + slots blocks); each
token block belongs to one slot's segment, read from device buffers, and spare blocks exit at once. So a CUDA
graph replays any mix of adapters.

- `sorted_ids[seg_start[s]:seg_start[s+1]]`: the token rows of slot s; tokens without an adapter are in no segment.
- `blk_slot[i]`, `blk_row0[i]`: token block i covers sorted rows [blk_row0[i], min(+BLOCK_M, segment end)) of
  slot blk_slot[i]; -1: nothing to do.
- shrink writes only the rows of tokens in a segment; expand adds into `out` in place, every shard of a merged
  layer (q/k/v, gate/up) in one launch: shard i reads y's columns [i R, (i+1) R) and writes out's columns of
  shard i. So a LoRA layer costs two launches."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.lora_layout import BLOCK_M


@triton.jit
def _block_tokens(SORTED, SEG, BLK_ROW0, pid_m, slot, BLOCK_M: tl.constexpr):
    """Token block pid_m of `slot`'s segment: its tokens' rows, and which of its BLOCK_M lanes hold one."""
    row0 = tl.load(BLK_ROW0 + pid_m)
    end = tl.load(SEG + slot + 1)
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < end
    tok = tl.load(SORTED + rows, mask=rmask, other=0).to(tl.int64)
    return tok, rmask


@triton.jit
def _lora_shrink_kernel(X, A, Y, SORTED, SEG, BLK_SLOT, BLK_ROW0, K, R, sxm, sxk, sas, sar, sak, sym, syr,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    slot = tl.load(BLK_SLOT + pid_m)
    if slot < 0:
        return
    tok, rmask = _block_tokens(SORTED, SEG, BLK_ROW0, pid_m, slot, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    a_base = A + slot.to(tl.int64) * sas
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        x = tl.load(X + tok[:, None] * sxm + kk[None, :] * sxk, mask=rmask[:, None] & (kk[None, :] < K), other=0.0)
        a = tl.load(a_base + offs_r[None, :] * sar + kk[:, None] * sak,
                    mask=(offs_r[None, :] < R) & (kk[:, None] < K), other=0.0)
        acc += tl.dot(x, a)
    tl.store(Y + tok[:, None] * sym + offs_r[None, :] * syr, acc, mask=rmask[:, None] & (offs_r[None, :] < R))


@triton.jit
def _lora_expand_kernel(Y, B, OUT, SORTED, SEG, BLK_SLOT, BLK_ROW0, R, N0, N1, N2, NB0, NB1, sym, syr, sbs, sbn, sbr,
                        som, son, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """Column blocks of up to 3 shards in one grid axis: blocks [0, NB0) are shard 0's, [NB0, NB0 + NB1) shard
    1's, the rest shard 2's. Shard i reads y's columns [i R, (i+1) R)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(BLK_SLOT + pid_m)
    if slot < 0:
        return
    tok, rmask = _block_tokens(SORTED, SEG, BLK_ROW0, pid_m, slot, BLOCK_M)
    in1 = pid_n >= NB0
    in2 = pid_n >= NB0 + NB1
    shard = in1.to(tl.int32) + in2.to(tl.int32)
    local = pid_n - tl.where(in2, NB0 + NB1, tl.where(in1, NB0, 0))
    n_size = tl.where(in2, N2, tl.where(in1, N1, N0))
    col0 = tl.where(in2, N0 + N1, tl.where(in1, N0, 0))
    offs_n = local * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < n_size
    cols = col0 + offs_n
    offs_r = tl.arange(0, BLOCK_R)
    y = tl.load(Y + tok[:, None] * sym + (shard * R + offs_r[None, :]) * syr,
                mask=rmask[:, None] & (offs_r[None, :] < R), other=0.0)
    b = tl.load(B + slot.to(tl.int64) * sbs + cols[None, :] * sbn + offs_r[:, None] * sbr,
                mask=nmask[None, :] & (offs_r[:, None] < R), other=0.0)
    acc = tl.dot(y.to(b.dtype), b)
    o_ptrs = OUT + tok[:, None] * som + cols[None, :] * son
    omask = rmask[:, None] & nmask[None, :]
    o = tl.load(o_ptrs, mask=omask, other=0.0)
    tl.store(o_ptrs, (o.to(tl.float32) + acc).to(o.dtype), mask=omask)


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def num_row_blocks(num_tokens: int, num_slots: int, m) -> int:
    """Token-block programs for a batch of `num_tokens`: every slot's segment rounds up to whole blocks."""
    n = triton.cdiv(num_tokens, BLOCK_M) + num_slots
    if n > m.blk_slot.numel():
        raise ValueError(f"{num_tokens} tokens exceed the LoRA mapping's capacity")
    return n


def lora_shrink(x: torch.Tensor, a: torch.Tensor, m) -> torch.Tensor:
    """y[t, :] = x[t] @ a[slot(t)]^T for the tokens in a slot's segment (other rows are left unwritten).
    x [T, K]; a [S, R, K]; m: the mapping's buffers (sorted_ids, seg_start, blk_slot, blk_row0); returns y [T, R]
    in float32."""
    t, k = x.shape
    num_slots, r, _ = a.shape
    y = torch.empty((t, r), dtype=torch.float32, device=x.device)
    block_r, block_k = _block(r, 64), _block(k, 64)
    grid = (num_row_blocks(t, num_slots, m), triton.cdiv(r, block_r))
    _lora_shrink_kernel[grid](x, a, y, m.sorted_ids, m.seg_start, m.blk_slot, m.blk_row0, k, r, x.stride(0),
                              x.stride(1), a.stride(0),
                              a.stride(1), a.stride(2), y.stride(0), y.stride(1),
                              BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=block_k)
    return y


def lora_expand(y: torch.Tensor, b: torch.Tensor, out: torch.Tensor, m, rank: int,
                shard_sizes: tuple[int, ...]) -> None:
    """out[t, shard i] += y[t, i*rank:(i+1)*rank] @ b[slot(t), shard i rows]^T, in place, all shards in one launch.
    y [T, len(shards) * rank] float32; b [S, sum(shard_sizes), rank]; out [T, sum(shard_sizes)]."""
    if len(shard_sizes) > 3:
        raise ValueError(f"at most 3 merged shards, got {len(shard_sizes)}")
    t = y.shape[0]
    num_slots = b.shape[0]
    block_r = _block(rank, 256)
    block_n = _block(max(shard_sizes), 64)
    sizes = list(shard_sizes) + [0] * (3 - len(shard_sizes))
    nb = [triton.cdiv(n, block_n) for n in sizes]
    grid = (num_row_blocks(t, num_slots, m), sum(nb))
    _lora_expand_kernel[grid](y, b, out, m.sorted_ids, m.seg_start, m.blk_slot, m.blk_row0, rank, sizes[0], sizes[1], sizes[2], nb[0], nb[1],
                              y.stride(0), y.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
                              out.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=block_r)
