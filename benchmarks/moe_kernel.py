"""The MoE kernel alone on the GPU: the Triton fused MoE against the reference loop (TorchMoE) and a torch
grouped-GEMM baseline (tokens sorted by expert, torch._grouped_mm for gate_up and down, as transformers' default
experts kernel does), batch 1..8192, on one layer of a model shape (default Qwen3-30B-A3B: 128 experts of 768,
top-8, hidden 2048). Prints a table: microseconds per call, and the Triton kernel's bandwidth against the
active-expert bytes it must read.

    python -m benchmarks.moe_kernel [--shape qwen3-30b-a3b] [--fp8] [--json out.json]
    python -m benchmarks.moe_kernel --align [--shape ...]   # the routing layout alone by slot count: the
                                                          # one-program kernel vs the grid path
    python -m benchmarks.moe_kernel --tune [--write]   # search tile configs per batch bucket; --write stores them
                                                       # in kestrel/kernels/configs/fused_moe.json"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from benchmarks.common import SHAPES, git_commit, print_table

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


def bench_us(fn, iters: int = 20) -> float:
    """Microseconds per call; inf for a tile that does not fit the chip (shared memory)."""
    import triton.testing

    try:
        return triton.testing.do_bench(fn, warmup=5, rep=iters) * 1e3
    except triton.runtime.errors.OutOfResources:
        return float("inf")


def grouped_mm_moe(x, w13, w2, topk_w, topk_ids):
    """Baseline: sort (token, slot) pairs by expert, two torch._grouped_mm calls, torch SiLU-and-mul."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    xs = x[order // k]
    gu = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    gate, up = gu.chunk(2, dim=-1)
    y = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    y = y * topk_w.reshape(-1)[order, None].to(y.dtype)
    out = torch.zeros(t * k, x.shape[1], device=x.device, dtype=y.dtype).index_copy_(0, order, y)
    return out.view(t, k, -1).sum(1)


_WEIGHTS: dict = {}


def moe_dims(shape: str) -> tuple[int, int, int, int, int]:
    """(experts, slots per token, hidden, intermediate, shared slots) as the kernel sees one layer: DeepSeek's
    shared experts run fused (FSE) as always-selected extra experts of the routed size."""
    s = SHAPES[shape]
    e = s.get("num_experts", s.get("n_routed_experts", 0))
    shared = s.get("n_shared_experts", 0) or 0
    k = s.get("num_experts_per_tok", s.get("top_k_experts"))  # (Gemma 4's name)
    return e + shared, k + shared, s["hidden_size"], s["moe_intermediate_size"], shared


def experts(shape: str, fp8: bool, gen):
    """One layer's experts (made once per shape and format)."""
    if (shape, fp8) not in _WEIGHTS:
        e, _, h, i, _ = moe_dims(shape)
        w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=gen) * h ** -0.5
        w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=gen) * i ** -0.5
        scales = {}
        if fp8:
            from kestrel.kernels.fp8_quant import quantize_weight_block

            q13, s13 = zip(*(quantize_weight_block(w, (128, 128)) for w in w13))
            q2, s2 = zip(*(quantize_weight_block(w, (128, 128)) for w in w2))
            w13, w2 = torch.stack(q13), torch.stack(q2)
            scales = dict(w13_scale=torch.stack(s13), w2_scale=torch.stack(s2), block_shape=(128, 128))
        _WEIGHTS[(shape, fp8)] = (w13, w2, scales)
    return _WEIGHTS[(shape, fp8)]


def problem(shape: str, t: int, fp8: bool, gen):
    e, k, h, _, shared = moe_dims(shape)
    w13, w2, scales = experts(shape, fp8, gen)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    topk_w, ids = torch.randn(t, e - shared, device="cuda", generator=gen).softmax(-1).topk(k - shared, dim=-1)
    if shared:  # the fused shared experts: always selected, weight 1
        topk_w = torch.cat([topk_w, torch.ones(t, shared, device="cuda")], dim=1)
        ids = torch.cat([ids, torch.arange(e - shared, e, device="cuda").expand(t, shared)], dim=1)
    return x, w13, w2, topk_w, ids.to(torch.int32), scales


def table(args):
    from kestrel.kernels.moe import MoESpec, TorchMoE
    from kestrel.kernels.triton_ops.fused_moe import fused_moe

    e, k, h, i, _ = moe_dims(args.shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ref_kernel = TorchMoE(MoESpec("bench", e, k, h, i, torch.bfloat16))
    rows = []
    bw = torch.cuda.get_device_properties(0)
    for t in BATCHES:
        x, w13, w2, topk_w, ids, scales = problem(args.shape, t, args.fp8, gen)
        y = fused_moe(x, w13, w2, topk_w, ids, **scales)
        hit = int(torch.unique(ids).numel())
        bytes_read = hit * w13[0].numel() * w13.element_size() * 1.5  # w13 + w2 of every hit expert
        row = dict(batch=t, experts_hit=hit, triton_us=bench_us(lambda: fused_moe(x, w13, w2, topk_w, ids, **scales)))
        row["triton_GBps"] = bytes_read / row["triton_us"] / 1e3
        if not args.fp8:
            layer = torch.nn.Module()
            layer.w13, layer.w2 = w13, w2
            ref = ref_kernel.apply(layer, x, topk_w, ids)
            row["rel_err_vs_ref"] = f"{float((y.float() - ref.float()).norm() / ref.float().norm()):.1e}"
            row["reference_us"] = bench_us(lambda: ref_kernel.apply(layer, x, topk_w, ids), 5) if t <= 1024 else float("nan")
            try:
                row["grouped_mm_us"] = bench_us(lambda: grouped_mm_moe(x, w13, w2, topk_w, ids))
            except Exception as err:  # noqa: BLE001 - an old torch or an unsupported layout: the row says nan
                row["grouped_mm_us"] = float("nan")
                print(f"torch._grouped_mm unavailable: {err}")
            row["speedup_vs_grouped_mm"] = row["grouped_mm_us"] / row["triton_us"]
        rows.append(row)
    title = (f"MoE kernel, {args.shape} layer (E={e}, top-{k}, H={h}, I={i}, {'fp8 block' if args.fp8 else 'bf16'}), "
             f"{bw.name}, commit {git_commit()}")
    print_table(title, rows)
    return rows


def align_table(args):
    """The routing layout (sort by expert, pad to BLOCK_M) alone, by tokens x slots: the one-program kernel against
    the grid path, GPU time in a CUDA graph (what a prefill step or a decode graph pays) and eager (host launch
    overhead included); `chosen` is the path fused_moe takes at that slot count."""
    import triton.testing

    from kestrel.kernels.triton_ops import fused_moe as fm

    e, k, h, i, _ = moe_dims(args.shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for t in (64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768):
        ids = problem(args.shape, t, False, gen)[4]
        bm = fm.get_config(t, e, k, h, i, args.fp8)["up"]["BLOCK_M"]
        one, grid = (fm.align_by_expert_triton(ids, e, bm, grid=g) for g in (False, True))
        same = torch.equal(one[1], grid[1]) and torch.equal(one[2], grid[2]) and torch.equal(
            one[0].sort().values, grid[0].sort().values)  # runs may differ in order only
        row = dict(tokens=t, slots=t * k, BLOCK_M=bm, same_layout=same,
                   chosen="grid" if t * k > fm.ALIGN_GRID_ABOVE else "one program")
        for g, name in ((False, "one_program"), (True, "grid")):
            fn = lambda: fm.align_by_expert_triton(ids, e, bm, grid=g)  # noqa: E731
            row[f"{name}_graph_us"] = triton.testing.do_bench_cudagraph(fn, rep=20) * 1e3
            row[f"{name}_eager_us"] = triton.testing.do_bench(fn, warmup=5, rep=20) * 1e3
        rows.append(row)
    print_table(f"MoE routing layout, {args.shape} (E={e}, {k} slots a token), "
                f"{torch.cuda.get_device_properties(0).name}, commit {git_commit()}", rows)
    return rows


def tune(args):
    """Per batch bucket, the fastest (up, down) tile pair sharing BLOCK_M. All candidates compile in parallel
    first (compile-only mode), then each is timed."""
    from kestrel.kernels.triton_ops import fused_moe as fm
    from kestrel.kernels.triton_ops.precompile import compile_only

    e, k, h, i, _ = moe_dims(args.shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bks = (128,) if args.fp8 else (64, 128)
    tiles = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
             for bn, bk, w, st in itertools.product((32, 64, 128), bks, (4, 8), (3, 4))]
    buckets = [b for b in fm.BUCKETS if b <= 8192 and (not args.buckets or b in args.buckets)]
    problems = {b: problem(args.shape, b, args.fp8, gen) for b in buckets}

    def candidates(bm):
        for up, down in itertools.product(tiles, tiles):
            if args.fp8 and up["BLOCK_K"] != down["BLOCK_K"]:
                continue
            yield {"up": dict(up, BLOCK_M=bm), "down": dict(down, BLOCK_M=bm)}

    with compile_only():  # every (tile, BLOCK_M) variant once, in parallel
        x, w13, w2, topk_w, ids, scales = problems[buckets[0]]
        for bm in (16, 32, 64, 128):
            for tile in tiles:
                cfg = {"up": dict(tile, BLOCK_M=bm), "down": dict(tile, BLOCK_M=bm)}
                fm.fused_moe(x, w13, w2, topk_w, ids, config=cfg, **scales)
    best, rows = {}, []
    for b in buckets:
        x, w13, w2, topk_w, ids, scales = problems[b]
        results = []
        for bm in (16, 32, 64, 128):
            if bm > 16 and b * k / e < bm / 4:  # mostly padding
                continue
            # choose up and down separately (they are separate launches), then time the pair
            ups = sorted(tiles, key=lambda tl_: bench_us(lambda: fm.fused_moe(
                x, w13, w2, topk_w, ids, config={"up": dict(tl_, BLOCK_M=bm), "down": dict(tiles[0], BLOCK_M=bm)},
                **scales), 5))[:2]
            downs = sorted(tiles, key=lambda tl_: bench_us(lambda: fm.fused_moe(
                x, w13, w2, topk_w, ids, config={"up": dict(ups[0], BLOCK_M=bm), "down": dict(tl_, BLOCK_M=bm)},
                **scales), 5))[:2]
            for up, down in itertools.product(ups, downs):
                cfg = {"up": dict(up, BLOCK_M=bm), "down": dict(down, BLOCK_M=bm)}
                results.append((bench_us(lambda: fm.fused_moe(x, w13, w2, topk_w, ids, config=cfg, **scales)), cfg))
        us, cfg = min(results, key=lambda r: r[0])
        default_us = bench_us(lambda: fm.fused_moe(x, w13, w2, topk_w, ids,
                                                   config=fm.default_config(b, e, k, args.fp8), **scales))
        best[str(b)] = cfg
        rows.append(dict(bucket=b, tuned_us=us, default_us=default_us, BLOCK_M=cfg["up"]["BLOCK_M"],
                         up=f"{cfg['up']['BLOCK_N']}/{cfg['up']['BLOCK_K']}/w{cfg['up']['num_warps']}/s{cfg['up']['num_stages']}",
                         down=f"{cfg['down']['BLOCK_N']}/{cfg['down']['BLOCK_K']}/w{cfg['down']['num_warps']}/s{cfg['down']['num_stages']}"))
    if buckets[-1] == 8192:
        best[str(fm.BUCKETS[-1])] = best["8192"]
    print_table(f"Tuned fused MoE configs, {args.shape} ({'fp8' if args.fp8 else 'bf16'})", rows)
    key = fm.config_key(e, h, i, args.fp8)
    if args.write:
        stored = json.loads(fm.CONFIG_FILE.read_text()) if fm.CONFIG_FILE.exists() else {}
        stored[key] = {**stored.get(key, {}), **best}
        fm.CONFIG_FILE.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
        print(f"wrote {key} to {fm.CONFIG_FILE}")
    return {key: best}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=[n for n, s in SHAPES.items() if "moe_intermediate_size" in s])
    ap.add_argument("--fp8", action="store_true", help="block-quantized FP8 experts (128x128)")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--align", action="store_true", help="time the routing layout alone (one program vs grid)")
    ap.add_argument("--write", action="store_true", help="with --tune: store the configs in the config file")
    ap.add_argument("--buckets", type=lambda v: [int(b) for b in v.split(",")], default=None,
                    help="with --tune: only these batch buckets (comma-separated; others keep their configs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = tune(args) if args.tune else align_table(args) if args.align else table(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
