"""Engine CPU time per decode step at batch 256 with the model replaced by a stub (no device work), so what
is left is scheduling, input preparation, sampling bookkeeping and output processing. Also prints the parts
spent in the runner's input preparation and in scheduling (of that, building the runner's step deltas).
--shape gemma3-1b: 26 layers in 7 KV-cache groups (1 full-attention, 6 sliding-window).

    python -m benchmarks.cpu_overhead [--batch 256] [--shape gemma3-1b] [--json out.json]
    python -m benchmarks.ab --base .old --scripts new --benches cpu_overhead --repeat 5   # A/B, interleaved"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import SHAPES, nano_workload

from kestrel import LLM, SamplingParams


class StubModel(torch.nn.Module):
    def __init__(self, real, vocab):
        super().__init__()
        self.real, self.vocab = real, vocab

    def forward(self, input_ids, positions, ctx, inputs_embeds=None):
        return torch.zeros(input_ids.shape[0], 8)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], self.vocab)


TINY = dict(hidden_size=64, intermediate_size=64, vocab_size=512, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, bos_token_id=1, eos_token_id=2)
# shape -> (layers: the shape's KV-cache groups with tiny layers, KV blocks that hold the batch)
SHAPE_RUNS = {"qwen3-0.6b": (1, 40000), "gemma3-1b": (26, 160000)}


def timed(obj, name: str, calls: dict) -> None:
    """Wrap obj.name so that the wall time of each call goes to calls[name] and its thread CPU time (what other
    processes on a busy machine do not inflate) to calls[name + ' cpu']."""
    fn = getattr(obj, name)
    calls[name], calls[name + " cpu"] = [], []

    def wrapper(*args, **kwargs):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            calls[name + " cpu"].append(time.thread_time() - c)
            calls[name].append(time.perf_counter() - t)

    setattr(obj, name, wrapper)


def ms(xs: list[float]) -> str:
    """Median and minimum (the one to compare on a busy machine) in ms."""
    return f"{statistics.median(xs) * 1e3:.3f} (min {min(xs) * 1e3:.3f}) ms"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPE_RUNS))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--steps", type=int, default=50, help="decode steps timed")
    ap.add_argument("--json", default=None, help="write step_ms and the medians and minimums of its parts here")
    ap.add_argument("--detokenize", action="store_true", help="also stream text (off: token ids, as the "
                    "throughput benchmark)")
    ap.add_argument("--prefix-caching", action="store_true", help="register full blocks in the prefix cache, "
                    "as serving does by default (off: the throughput benchmark's setting)")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp())
    layers, blocks = SHAPE_RUNS[args.shape]
    cfg = dict(SHAPES[args.shape], num_hidden_layers=layers, **TINY)
    (d / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(d), load_format="dummy", device="cpu", progress=False, max_num_batched_tokens=16384,
              num_kv_blocks=blocks,
              enable_prefix_caching=args.prefix_caching, async_scheduling="on")
    eng = llm.engine
    runner = eng.core.executor.runner
    runner.model = StubModel(runner.model, 512)
    prompts, _ = nano_workload(args.batch, vocab_cap=512)
    for p in prompts:
        # greedy: on the CPU a sampling step's random draw would dominate what this measures
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True,
                                          detokenize=args.detokenize))
    while eng.core.scheduler.num_waiting or any(r.in_prefill for r in eng.core.scheduler.running):
        eng.step()
    for _ in range(5):
        eng.step()
    n = args.steps
    calls = {}
    timed(runner, "_prepare", calls)
    timed(eng.core.scheduler, "_step_input", calls)
    timed(eng.core.scheduler, "schedule", calls)
    t = time.perf_counter()
    for _ in range(n):
        eng.step()
    dt = (time.perf_counter() - t) / n
    groups = len(runner.kv_cache_groups)
    print(f"CPU time per decode step at batch {args.batch}, {args.shape} ({groups} KV groups): {dt * 1e3:.2f} ms "
          f"({dt / args.batch * 1e6:.1f} us/request)")
    print(f"  of it runner prepare {ms(calls['_prepare'])}, scheduling {ms(calls['schedule'])}, "
          f"of that step deltas {ms(calls['_step_input'])}")
    print(f"  thread CPU time: runner prepare {ms(calls['_prepare cpu'])}, scheduling {ms(calls['schedule cpu'])}, "
          f"of that step deltas {ms(calls['_step_input cpu'])}")
    if args.json:
        parts = {f"{key}_{stat}_ms": round(f(calls[name]) * 1e3, 4) for key, name in
                 (("prepare", "_prepare"), ("schedule", "schedule"), ("step_input", "_step_input"))
                 for stat, f in (("median", statistics.median), ("min", min))}
        Path(args.json).write_text(json.dumps(dict(step_ms=round(dt * 1e3, 4), batch=args.batch, shape=args.shape,
                                                   **parts)))
    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            eng.step()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
