"""Batch-1 latency: 128-token prompt, 256 output tokens; ms per output token and time to first token, with
transformers' plain generate on the same model in the same run and the weight-read roofline (tensor parallel
over N GPUs: each reads 1/N of the weights at the same time, so the roofline divides by N; all-reduces are not
counted).

    python -m benchmarks.latency --shape qwen3-0.6b
    python -m benchmarks.latency --shape llama-70b --tensor-parallel-size 4 --hf-output-len 0"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from benchmarks.common import SHAPES, git_commit, measure_ceilings, nano_workload, print_table, shape_facts, write_shape

TTFT_SAMPLES = 15  # one request's first token is ~10 ms: three samples swung 2x between runs


def run_kestrel(model_dir, prompt, n_out, quantization=None, pdl=True, max_model_len=None, tp=1):
    import torch

    from kestrel import LLM, SamplingParams

    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=2048,
              enable_prefix_caching=False, quantization=quantization, progress=False, pdl=pdl, tensor_parallel_size=tp,
              **({"max_model_len": max_model_len} if max_model_len else {}))
    p1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    pn = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    llm.generate([prompt], pn, use_tqdm=False)  # warm-up
    ttfts, totals = [], []
    for _ in range(3):
        t = time.perf_counter()
        llm.generate([prompt], pn, use_tqdm=False)
        totals.append(time.perf_counter() - t)
    for _ in range(TTFT_SAMPLES):  # one request's first token is ~10 ms: enough samples for a stable median
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([prompt], p1, use_tqdm=False)
        ttfts.append(time.perf_counter() - t)
    ttft, total = min(ttfts), min(totals)
    llm.shutdown()  # tensor parallel: the workers exit; the GPU is free for the next engine
    return ttft, (total - ttft) / (n_out - 1), statistics.median(ttfts)


def run_hf(model_dir, prompt, n_out):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompt], device="cuda")
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids, max_new_tokens=8, **kw)
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, **kw)
    torch.cuda.synchronize()
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=n_out, min_new_tokens=n_out, **kw)
    torch.cuda.synchronize()
    total = time.perf_counter() - t
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return ttft, (total - ttft) / (n_out - 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--hf-output-len", type=int, default=64, help="tokens for transformers (0 = skip)")
    ap.add_argument("--quantization", default=None, choices=[None, "fp8"])
    ap.add_argument("--no-pdl", action="store_true", help="turn programmatic dependent launch off")
    ap.add_argument("--max-model-len", type=int, default=None, help="cap the context (vLLM's peer runs use 4096)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is split over")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model_dir = write_shape(args.shape)
    facts = shape_facts(args.shape)
    ceil = measure_ceilings()
    prompt = nano_workload(1, seed=2, in_range=(args.prompt_len, args.prompt_len))[0][0]
    tp = args.tensor_parallel_size
    ttft, tpot, ttft_median = run_kestrel(model_dir, prompt, args.output_len, args.quantization, not args.no_pdl, args.max_model_len,
                             tp)
    roof = facts.active_weight_bytes(1) / ceil["copy_bytes_per_s"] / tp  # active weights read once per token
    rows = [dict(engine="kestrel", ttft_ms=ttft * 1e3, ttft_median_ms=ttft_median * 1e3, ms_per_token=tpot * 1e3, roofline_ms=roof * 1e3,
                 x_roofline=f"{tpot / roof:.2f}")]
    result = dict(shape=args.shape, tensor_parallel_size=tp, commit=git_commit(), ttft_ms=ttft * 1e3,
                  ttft_median_ms=ttft_median * 1e3, ms_per_token=tpot * 1e3,
                  roofline_ms=roof * 1e3)
    if args.hf_output_len:
        httft, htpot = run_hf(model_dir, prompt, args.hf_output_len)
        rows.append(dict(engine="transformers generate", ttft_ms=httft * 1e3, ms_per_token=htpot * 1e3,
                         roofline_ms=roof * 1e3, x_roofline=f"{htpot / roof:.2f}"))
        result.update(hf_ms_per_token=htpot * 1e3, hf_ttft_ms=httft * 1e3, speedup=htpot / tpot)
    print_table(f"Latency, batch 1, {args.shape}{f', TP {tp}' if tp > 1 else ''}, prompt {args.prompt_len}, "
                f"output {args.output_len}, commit {result['commit']}", rows)
    if "speedup" in result:
        print(f"transformers ms/token / Kestrel ms/token: {result['speedup']:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
