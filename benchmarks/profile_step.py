"""Where a decode step's time goes at batch 256 (Qwen3-0.6B shape): torch.profiler over decode steps
(GPU kernels and CPU ops) and cProfile of the Python side.
    python -m benchmarks.profile_step [--batch N] [--greedy] [--shape llama-8b]"""
from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch

from benchmarks.common import nano_workload, write_shape

from kestrel import LLM, SamplingParams


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--shape", default="qwen3-0.6b")
    args = ap.parse_args()
    llm = LLM(str(write_shape(args.shape)), load_format="dummy", dtype="bfloat16", max_num_seqs=256,
              max_num_batched_tokens=16384, enable_prefix_caching=False, progress=False)
    eng = llm.engine
    prompts, _ = nano_workload(args.batch)
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0 if args.greedy else 0.6, max_tokens=400, ignore_eos=True))
    core = eng.core
    while core.scheduler.num_waiting or any(r.in_prefill for r in core.scheduler.running):
        eng.step()
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        eng.step()
    torch.cuda.synchronize()
    print(f"decode step at batch {core.scheduler.num_running}: {(time.perf_counter() - t) / 20 * 1e3:.2f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(ka.table(sort_by="cuda_time_total", row_limit=32, max_name_column_width=60))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        eng.step()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(s.getvalue()[-6000:])


if __name__ == "__main__":
    main()
