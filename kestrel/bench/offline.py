"""Offline benchmarks of a real model through LLM.generate, as `vllm bench throughput|latency` measure them.

  kestrel bench throughput [--model PATH] --num-prompts 64 --input-len 128 --output-len 128
  kestrel bench latency [--model PATH] --batch-size 1 --input-len 32 --output-len 128

Prompts are random token ids; outputs ignore EOS, so every request generates exactly --output-len tokens."""
from __future__ import annotations

import argparse
import json
import random
import time

from kestrel.config import EngineConfig, add_cli_args, from_cli_args


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(length)]} for _ in range(n)]


def _llm(config: EngineConfig):
    from kestrel import LLM

    return LLM.from_config(config, progress=False)


def throughput(args) -> dict:
    from kestrel import SamplingParams

    llm = _llm(from_cli_args(args))
    prompts = _prompts(args.num_prompts, args.input_len, llm.engine.input_processor.vocab_size, args.seed)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=1.0, detokenize=False)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    total = gen + args.num_prompts * args.input_len
    return {"elapsed_s": dt, "requests_per_s": args.num_prompts / dt, "output_tokens_per_s": gen / dt,
            "total_tokens_per_s": total / dt}


def latency(args) -> dict:
    from kestrel import SamplingParams

    llm = _llm(from_cli_args(args))
    prompts = _prompts(args.batch_size, args.input_len, llm.engine.input_processor.vocab_size, args.seed)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0, detokenize=False)
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    times = []
    for _ in range(args.num_iters):
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"avg_latency_s": sum(times) / len(times), "p50_latency_s": times[len(times) // 2],
            "p90_latency_s": times[min(len(times) - 1, int(len(times) * 0.9))],
            "ms_per_output_token": 1000 * times[len(times) // 2] / args.output_len}


def add_parser(sub, which: str) -> argparse.ArgumentParser:
    p = sub.add_parser(which, help=f"offline {which} of a model (random prompts)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    g.add_argument("--output-len", type=int, default=128, help="generated tokens per request (default: 128)")
    if which == "throughput":
        g.add_argument("--num-prompts", type=int, default=64, help="requests (default: 64)")
    else:
        g.add_argument("--batch-size", type=int, default=1, help="requests per batch (default: 1)")
        g.add_argument("--num-iters", type=int, default=5, help="timed batches (default: 5)")
    g.add_argument("--output-json", default=None, help="also write the results to this file")
    add_cli_args(p)  # --seed (the engine's) also seeds the random prompts
    return p


def run(which: str, args) -> int:
    result = (throughput if which == "throughput" else latency)(args)
    for k, v in result.items():
        print(f"{k:>24}: {v:,.3f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
