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


def poison_outside_window(kc, vc, bt, q_lens, seq_lens, window):
    """What the KV manager may have done to a sliding-window request: every token slot below the window of the
    request's first query holds NaN (freed blocks reused by someone else), and the table entries of the blocks
    wholly below it point at a NaN-filled null block (the last block of the cache) on every other sequence.
    Returns poisoned copies (kc, vc, bt)."""
    kc, vc, bt = kc.clone(), vc.clone(), bt.clone()
    page = kc.shape[1]
    null = kc.shape[0] - 1
    kc[null] = float("nan")
    vc[null] = float("nan")
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        lo = max(0, seq_len - q_len - window + 1) if seq_len else 0
        for pos in range(lo):
            blk = int(bt[b, pos // page])
            kc[blk, pos % page] = float("nan")
            vc[blk, pos % page] = float("nan")
        if b % 2 == 0:
            bt[b, : lo // page] = null
    return kc, vc, bt
