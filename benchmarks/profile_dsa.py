"""Where a DSA decode step and a long prefill step go, beside the dense-MLA twin (issue 47): n requests of
prompt_len random tokens are prefilled, then decode steps are timed one by one (no prefill in the figure) and
profiled with torch.profiler; the first prefill steps are profiled too.
    python -m benchmarks.profile_dsa [--prompt-len 32768] [--n 8] [--shapes deepseek-v2-lite-dsa ...]"""
from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.common import write_shape
from benchmarks.engine_steps import decode_ms_per_step, prefill_all
from kestrel import LLM, SamplingParams


def kernel_table(prof, rows: int) -> str:
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


def profile_shape(shape: str, prompt_len: int, n: int, key_dtype: str, rows: int) -> None:
    rng = random.Random(0)
    llm = LLM(str(write_shape(shape)), load_format="dummy", dtype="bfloat16", progress=False,
              max_model_len=prompt_len + 128, indexer_key_dtype=key_dtype)
    llm.generate([[rng.randint(0, 9999) for _ in range(64)]], SamplingParams(max_tokens=4, ignore_eos=True))
    eng, core = llm.engine, llm.engine.core
    for _ in range(n):
        eng.add_request([rng.randint(0, 9999) for _ in range(prompt_len)],
                        SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        first = time.perf_counter() - t
    rest, prefill_steps = prefill_all(eng)
    runner = core.executor.runner
    print(f"\n##### {shape} ({runner.backend.name}, {key_dtype} keys, eager top-k "
          f"{getattr(runner.backend.impl_cls, 'eager_topk', '-')}) {n} x {prompt_len}: first prefill step "
          f"{first * 1e3:.1f} ms, {prefill_steps + 1} prefill steps in {first + rest:.2f} s")
    print(kernel_table(prof, rows))
    print(f"{shape}: decode step at batch {core.scheduler.num_running}: {decode_ms_per_step(eng, 20):.2f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    print(kernel_table(prof, rows))
    del runner, eng, core, prof
    llm.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--shapes", nargs="+", default=["deepseek-v2-lite-dsa", "deepseek-v2-lite-dsa-dense"])
    ap.add_argument("--indexer-key-dtype", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--eager-topk", choices=["torch", "radix"], default=None,
                    help="the sparse prefill's top-k (TritonSparseMLAImpl.eager_topk; default: the engine's)")
    args = ap.parse_args()
    if args.eager_topk:
        from kestrel.attention.backends.triton_sparse_mla import TritonSparseMLAImpl

        TritonSparseMLAImpl.eager_topk = args.eager_topk
        print(f"sparse prefill top-k: {args.eager_topk}")
    for shape in args.shapes:
        profile_shape(shape, args.prompt_len, args.n, args.indexer_key_dtype, args.rows)


if __name__ == "__main__":
    main()
