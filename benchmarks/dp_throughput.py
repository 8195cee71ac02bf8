"""Data-parallel throughput: the 256-request workload of throughput.py (token-id prompts, ignore_eos) through the
async engine (the server's frontend without HTTP) over one engine core, then over N (--data-parallel-size N: one
engine-core process a GPU, least-loaded routing), on a random-weight model shape. LLM (offline) steps one
in-process engine core, so data parallelism is measured here.

    python -m benchmarks.dp_throughput --shape llama-8b --data-parallel-size 2 [--json out.json]"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time

from benchmarks.common import SHAPES, git_commit, nano_workload, print_table, write_shape


async def run_engine(model: str, dp: int, prompts, outs, args) -> dict:
    from kestrel.config import EngineConfig
    from kestrel.frontend.async_engine import AsyncEngine
    from kestrel.core.sampling_params import SamplingParams

    t0 = time.perf_counter()
    cfg = EngineConfig.create(model=model, load_format="dummy", data_parallel_size=dp,
                              tensor_parallel_size=args.tensor_parallel_size, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
                              **({"max_model_len": args.max_model_len} if args.max_model_len else {}))
    engine = await AsyncEngine(cfg).start()
    startup = time.perf_counter() - t0
    routed = collections.Counter()  # requests per engine core
    add = engine.client.add_request

    def counted_add(request) -> int:
        routed[i := add(request)] += 1
        return i
    engine.client.add_request = counted_add

    async def one(prompt, n: int) -> int:
        params = SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True, detokenize=False)
        async for out in engine.generate(prompt, params):
            last = out
        return len(last.outputs[0].token_ids)

    try:  # warm-up: a few short requests on every engine (JIT, allocator)
        await asyncio.gather(*(one(p[:64], 16) for p in prompts[:8 * dp]))
        routed.clear()
        t = time.perf_counter()
        n_out = sum(await asyncio.gather(*(one(p, o) for p, o in zip(prompts, outs))))
        dt = time.perf_counter() - t
    finally:
        await engine.shutdown()
    assert n_out == sum(outs), (n_out, sum(outs))
    n_total = n_out + sum(len(p) for p in prompts)
    return dict(data_parallel_size=dp, requests=len(prompts), seconds=dt, out_tok_s=n_out / dt,
                total_tok_s=n_total / dt, startup_s=startup,
                requests_per_engine="/".join(str(routed[i]) for i in range(dp)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    ap.add_argument("--model", default=None, help="a config.json folder instead of --shape (CPU smoke test)")
    ap.add_argument("--data-parallel-size", type=int, default=2, help="engine cores compared with one")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs each engine core's model spans")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", default="100:1024", help="prompt length range in tokens, LO:HI")
    ap.add_argument("--output-len", default="100:1024", help="output length range in tokens, LO:HI")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    def span(s: str) -> tuple[int, int]:
        lo, _, hi = s.partition(":")
        return int(lo), int(hi or lo)

    model = args.model or str(write_shape(args.shape))
    vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
    prompts, outs = nano_workload(args.num_requests, in_range=span(args.input_len), out_range=span(args.output_len),
                                  vocab_cap=min(10000, vocab))
    rows = [asyncio.run(run_engine(model, dp, prompts, outs, args)) for dp in (1, args.data_parallel_size)]
    scaling = rows[1]["out_tok_s"] / rows[0]["out_tok_s"]
    tp = args.tensor_parallel_size
    name = args.model or args.shape
    print_table(f"Data parallel, {name} (random weights){f', TP {tp} each' if tp > 1 else ''}, commit {git_commit()}",
                rows)
    print(f"\ndata parallel {args.data_parallel_size} / one engine core: {scaling:.2f}x output tokens/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shape=name, tensor_parallel_size=tp, commit=git_commit(), runs=rows, scaling=scaling), f,
                      indent=1)


if __name__ == "__main__":
    main()
