"""The Triton MLA decode kernel alone (DeepSeek-V2-Lite / V3 dims: latent 512 + rope 64, bf16) on the H200: time and
achieved bandwidth (latent bytes read / time) per batch x context, for the default tile and a small sweep, and
the error against the float32 reference on the first case.

    python -m benchmarks.mla_decode [--heads 16] [--sweep] [--splits]
--splits: at batch >= 64, forced split counts 1..16 on a few tiles (the default derives the count from the
shapes: 2 at batch 256 with 16 heads)."""
from __future__ import annotations

import argparse
import itertools

import torch

from kestrel.attention.backends.torch_mla import mla_latent_attention_ref
from kestrel.attention.ops.triton_mla import default_decode_config, mla_decode_attention

L, R, PAGE = 512, 64, 16


def case(batch: int, ctx: int, heads: int):
    nblk = -(-ctx // PAGE)
    cache = torch.randn(batch * nblk + 1, PAGE, L + R, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(batch * nblk, device="cuda").view(batch, nblk).int()
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q_lat = torch.randn(batch, heads, L, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, heads, R, device="cuda", dtype=torch.bfloat16)
    return q_lat, q_pe, cache, bt, sl


def time_us(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16, help="16: V2-Lite, 128: V3")
    ap.add_argument("--sweep", action="store_true", help="also try BLOCK_N / warps / stages variants")
    ap.add_argument("--splits", action="store_true", help="at batch >= 64, also force 1..16 context splits")
    args = ap.parse_args()
    scale = 192 ** -0.5
    q_lat, q_pe, cache, bt, sl = case(4, 3000, args.heads)
    out = mla_decode_attention(q_lat, q_pe, cache, bt, sl, scale)
    ref = mla_latent_attention_ref(q_lat.float(), q_pe.float(), cache.float(), bt, list(range(5)), [3000] * 4, scale)
    print(f"rel err vs float32 reference (4 x 3000): {((out.float() - ref).norm() / ref.norm()).item():.2e}")
    tiles = [dict(BLOCK_N=bn, num_warps=w, num_stages=s) for bn, w, s in itertools.product((16, 32, 64), (4, 8), (1, 2, 3))]
    print(f"{'batch':>5} {'ctx':>6} {'config':<58} {'us':>8} {'GB/s':>7}")
    for batch, ctx in [(1, 256), (1, 1024), (1, 32768), (16, 1024), (64, 1024), (256, 1024), (256, 4096)]:
        q_lat, q_pe, cache, bt, sl = case(batch, ctx, args.heads)
        nbytes = batch * ctx * (L + R) * 2
        variants = [None]
        if args.sweep:  # the split length matters only where the batch leaves SMs idle
            splits = (32, 64, 128, 256) if batch <= 16 else (64,)
            variants += [dict(t, MIN_SPLIT=ms) for t in tiles for ms in splits]
        if args.splits and batch >= 64:
            variants += [dict(BLOCK_N=bn, num_warps=w, num_stages=st, splits=n) for bn, w, st in
                         ((32, 4, 2), (32, 4, 3), (16, 4, 2), (64, 4, 2), (32, 8, 2)) for n in (1, 2, 4, 8, 16)]
        for v in variants:
            forced = (v or {}).get("splits")
            cfg = {k: x for k, x in v.items() if k != "splits"} if v else None
            try:
                us = time_us(lambda: mla_decode_attention(q_lat, q_pe, cache, bt, sl, scale, _config=cfg,
                                                          max_seq_len=ctx, num_splits=forced))
            except Exception as e:  # a tile that does not fit shared memory
                print(f"{batch:>5} {ctx:>6} {str(v):<58} failed: {type(e).__name__}")
                continue
            label = str(v or {k: default_decode_config(L, batch)[k]
                              for k in ("BLOCK_N", "num_warps", "num_stages", "MIN_SPLIT")})
            print(f"{batch:>5} {ctx:>6} {label:<58} {us:>8.1f} {nbytes / us / 1e3:>7.0f}")


if __name__ == "__main__":
    main()
