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


def prefill_ab(shape: str, prompt_len: int, n: int, key_dtype: str, variants: list[str]) -> None:
    """The sparse prefill's candidates (TritonSparseMLAImpl.eager_topk / eager_score_rows, read at each call) on
    one engine: n fresh prompts prefilled per variant, then aborted; each variant twice, interleaved."""
    from kestrel.attention.backends.triton_sparse_mla import TritonSparseMLAImpl

    rng = random.Random(1)
    llm = LLM(str(write_shape(shape)), load_format="dummy", dtype="bfloat16", progress=False,
              max_model_len=prompt_len + 128, indexer_key_dtype=key_dtype)
    llm.generate([[rng.randint(0, 9999) for _ in range(64)]], SamplingParams(max_tokens=4, ignore_eos=True))
    eng = llm.engine
    seconds = {v: [] for v in variants}
    for _ in range(2):
        for v in variants:
            topk, rows = v.split("/")
            TritonSparseMLAImpl.eager_topk, TritonSparseMLAImpl.eager_score_rows = topk, int(rows)
            ids = [eng.add_request([rng.randint(0, 9999) for _ in range(prompt_len)],
                                   SamplingParams(max_tokens=2, ignore_eos=True)) for _ in range(n)]
            seconds[v].append(prefill_all(eng)[0])
            for rid in ids:
                eng.abort_request(rid)
            while eng.has_unfinished_requests():
                eng.step()
    print(f"\n##### sparse prefill A/B, {shape} ({key_dtype} keys), {n} x {prompt_len}, best of 2:")
    base = min(seconds[variants[0]])
    for v in variants:
        print(f"  top-k/rows {v:10s} {min(seconds[v]):7.2f} s  ({base / min(seconds[v]):.2f}x of {variants[0]})")
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
    ap.add_argument("--prefill-ab", default=None, help="comma-separated TOPK/ROWS variants (e.g. "
                    "torch/1,radix/1,radix/4): only the sparse prefill A/B on the first shape")
    args = ap.parse_args()
    if args.prefill_ab:
        prefill_ab(args.shapes[0], args.prompt_len, args.n, args.indexer_key_dtype, args.prefill_ab.split(","))
        return
    if args.eager_topk:
        from kestrel.attention.backends.triton_sparse_mla import TritonSparseMLAImpl

        TritonSparseMLAImpl.eager_topk = args.eager_topk
        print(f"sparse prefill top-k: {args.eager_topk}")
    for shape in args.shapes:
        profile_shape(shape, args.prompt_len, args.n, args.indexer_key_dtype, args.rows)


if __name__ == "__main__":
    main()
