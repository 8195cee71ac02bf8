"""Paged-attention test inputs shared by the reference test (CI) and the Triton op tests: sequences with cached
prefixes in a shuffled paged cache, and the poisoning of everything a sliding window must never read."""
from __future__ import annotations

import torch


def paged_case(q_lens, seq_lens, page, hq, hkv, d, dtype, gen, device="cpu", spare_blocks=2):
    """Random q [sum(q_lens), hq, d] and a paged K/V cache holding seq_lens[b] tokens of each sequence in
    shuffled, disjoint blocks (plus spare blocks; the last one is free to serve as a null block).
    Returns q, k_cache, v_cache, block_tables, query_start_loc, seq_lens (tensors on device)."""
    need = [max(1, -(-s // page)) for s in seq_lens]
    total = sum(need) + spare_blocks
    perm = torch.randperm(total - 1, generator=gen)  # the last block is never handed out
    bt = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i : i + n]
        i += n
    kc = torch.randn(total, page, hkv, d, generator=gen).to(device, dtype)
    vc = torch.randn(total, page, hkv, d, generator=gen).to(device, dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(device, dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, kc, vc, bt.to(device), qsl, sl


def poison_outside_window(kc, vc, bt, q_lens, seq_lens, window, chunk: int = 0):
    """What the KV manager may have done to a sliding-window request: every token slot below the window of the
    request's first query holds NaN (freed blocks reused by someone else), and the table entries of the blocks
    wholly below it point at a NaN-filled null block (the last block of the cache) on every other sequence.
    `chunk`: the same below the first query's attention chunk (chunked local attention; window unused).
    Returns poisoned copies (kc, vc, bt)."""
    from kestrel.attention.ops.reference import window_start

    kc, vc, bt = kc.clone(), vc.clone(), bt.clone()
    page = kc.shape[1]
    null = kc.shape[0] - 1
    kc[null] = float("nan")
    vc[null] = float("nan")
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        lo = window_start(seq_len - q_len, window, chunk) if seq_len else 0
        for pos in range(lo):
            blk = int(bt[b, pos // page])
            kc[blk, pos % page] = float("nan")
            vc[blk, pos % page] = float("nan")
        if b % 2 == 0:
            bt[b, : lo // page] = null
    return kc, vc, bt


def rope_cos_sin(d: int, max_pos: int, device="cpu") -> torch.Tensor:
    """A neox rotary cos/sin cache [max_pos, d] (cos | sin), base 10000."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(max_pos).float()[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(device)


def unfused_prologue(qkv, pos, cos_sin, hq, hkv, d, q_norm_weight=None, k_norm_weight=None):
    """What the fused attention prologue computes, step by step with the Triton ops: split the qkv rows, RMS-norm
    q and k per head (with weights), rotate both. Returns (q, k, v) [T, H, d]."""
    from kestrel.attention.ops import triton_attention as ta

    t = qkv.shape[0]
    q = qkv[:, : hq * d].reshape(t, hq, d).clone()
    k = qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d).clone()
    v = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d).clone()
    if q_norm_weight is not None:
        q, k = ta.rms_norm(q, q_norm_weight, 1e-6), ta.rms_norm(k, k_norm_weight, 1e-6)
    ta.rotary_embedding_(pos, q, k, cos_sin, d, True)
    return q, k, v
