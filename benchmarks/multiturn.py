"""Multi-turn chat against a device KV pool smaller than the conversations' working set (issue 53): each of N
conversations returns for T turns, its context growing by its last answer and a new user message; between two turns
of one conversation every other conversation takes its turn, so the device pool has long evicted its prefix. Run
with the host KV tier (`--kv-offloading-size`) and without, in one process, one after the other: TTFT p50 / p99 of
the returning turns (2..T) and of the first turns, output tokens/s, and the prompt tokens served from a cache.

    python -m benchmarks.multiturn [--shape qwen3-0.6b] [--conversations 64] [--turns 5] [--pool-fraction 0.25]
                                   [--concurrency 8] [--offload-gib auto] [--json out.json]

Random weights (load_format dummy), greedy, ignore_eos: the same tokens in both runs, so the same work."""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import git_commit, print_table, shape_facts, write_shape


@dataclass
class Conversation:
    context: list[int]  # what the next turn's prompt starts with
    ttfts: list[float] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)


def make_conversations(n: int, first_range: tuple[int, int], seed: int, vocab: int) -> list[Conversation]:
    rng = random.Random(seed)
    return [Conversation([rng.randrange(10, vocab) for _ in range(rng.randint(*first_range))]) for _ in range(n)]


def turn_queue(n: int, turns: int) -> list[tuple[int, int]]:
    """(conversation, turn) in the order they are sent: every conversation's turn t before any turn t + 1."""
    return [(c, t) for t in range(turns) for c in range(n)]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run(model_dir: Path, args, offload_gib: float | None, num_blocks: int, save: str) -> dict:
    import torch

    from kestrel import LLM, SamplingParams

    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", progress=False, enable_prefix_caching=True,
              num_kv_blocks=num_blocks, max_model_len=args.max_model_len, kv_offloading_size=offload_gib,
              kv_offloading_save=save)
    eng = llm.engine
    llm.generate([[11] * 64] * 4, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    convs = make_conversations(args.conversations, (args.first_min, args.first_max), args.seed, args.vocab)
    rng = random.Random(args.seed + 1)
    queue, live = turn_queue(len(convs), args.turns), {}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    out_tokens, t0 = 0, time.perf_counter()
    while queue or live:
        while queue and len(live) < args.concurrency and queue[0][0] not in {v[0] for v in live.values()}:
            c, t = queue.pop(0)
            conv = convs[c]
            if t:
                conv.context += [rng.randrange(10, args.vocab) for _ in range(args.user_len)]
            rid = eng.add_request(list(conv.context), params)
            live[rid] = (c, t, time.perf_counter(), [])
        for o in eng.step():
            if o.request_id not in live:
                continue
            c, t, sent_at, ttft = live[o.request_id]
            if not ttft and o.outputs and o.outputs[0].token_ids:
                ttft.append(time.perf_counter() - sent_at)
            if o.finished:
                conv = convs[c]
                conv.ttfts.append(ttft[0] if ttft else time.perf_counter() - sent_at)
                conv.cached.append(o.num_cached_tokens)
                conv.context += list(o.outputs[0].token_ids)
                out_tokens += len(o.outputs[0].token_ids)
                del live[o.request_id]
    wall = time.perf_counter() - t0
    first = [cv.ttfts[0] for cv in convs]
    returning = [x for cv in convs for x in cv.ttfts[1:]]
    contexts = [len(cv.context) for cv in convs]
    cached = sum(sum(cv.cached[1:]) for cv in convs)
    result = dict(offload_gib=offload_gib or 0, kv_blocks=num_blocks, wall_s=round(wall, 2),
                  out_tok_s=round(out_tokens / wall, 1),
                  ttft_first_p50_ms=round(statistics.median(first) * 1e3, 1),
                  ttft_return_p50_ms=round(statistics.median(returning) * 1e3, 1),
                  ttft_return_p99_ms=round(percentile(returning, 0.99) * 1e3, 1),
                  returning_cached_tokens=cached, final_context_mean=round(statistics.mean(contexts)))
    del llm, eng
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", help="a shape of benchmarks/common.py, or a folder with a "
                    "config.json (random weights either way)")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--first-min", type=int, default=3500, help="first prompt's tokens, at least")
    ap.add_argument("--first-max", type=int, default=6500, help="first prompt's tokens, at most")
    ap.add_argument("--user-len", type=int, default=200, help="tokens of each later user message")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8, help="turns in flight at once")
    ap.add_argument("--pool-fraction", type=float, default=0.25,
                    help="the device KV pool as a fraction of the conversations' final working set")
    ap.add_argument("--offload-gib", default="auto",
                    help="the host tier's GiB (auto: the working set's bytes plus 10%%)")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--save", default="evict,free", help="the host tier's --kv-offloading-save policies to run")
    ap.add_argument("--only", choices=("tier", "none"), default=None, help="the tier runs only, or the run without")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if Path(args.shape).is_dir():  # a folder with a config.json (a tiny model for a CPU smoke run)
        cfg = json.loads((Path(args.shape) / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        kv_bytes = 2 * 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim
        model_dir = Path(args.shape)
    else:
        kv_bytes, model_dir = shape_facts(args.shape).kv_bytes_per_token, write_shape(args.shape)
    mean_final = (args.first_min + args.first_max) / 2 + (args.turns - 1) * args.user_len + args.turns * args.output_len
    working_set = int(args.conversations * mean_final)
    num_blocks = max(int(working_set * args.pool_fraction) // args.block_size, args.max_model_len // args.block_size + 1)
    gib = working_set * kv_bytes * 1.1 / 2**30 if args.offload_gib == "auto" else float(args.offload_gib)
    tier = round(max(gib, 0.01), 3)
    configs = [(f"host tier, save at {s}", tier, s) for s in args.save.split(",")] + [("no tier", None, "evict")]
    if args.only:
        configs = configs[:-1] if args.only == "tier" else configs[-1:]
    rows = []
    for name, offload, save in configs:
        r = run(model_dir, args, offload, num_blocks, save)
        rows.append(dict(config=name, **r))
        print(f"--- {name}: {r}", flush=True)
    print_table(f"Multi-turn chat, {args.shape}: {args.conversations} conversations x {args.turns} turns, working set "
                f"~{working_set:,} tokens, device pool {num_blocks * args.block_size:,} tokens "
                f"({args.pool_fraction:.0%}), concurrency {args.concurrency}, commit {git_commit()}", rows)
    none = rows[-1] if rows[-1]["config"] == "no tier" else None
    for a in rows[:-1] if none else ():
        print(f"{a['config']}: returning turns' TTFT p50 {none['ttft_return_p50_ms'] / a['ttft_return_p50_ms']:.2f}x "
              f"sooner than without a tier, p99 {none['ttft_return_p99_ms'] / a['ttft_return_p99_ms']:.2f}x; "
              f"throughput {a['out_tok_s'] / none['out_tok_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(shape=args.shape, commit=git_commit(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
