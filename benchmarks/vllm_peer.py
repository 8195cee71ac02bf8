"""vLLM as a side-by-side peer on the same GPU run: the 256-request workload and batch-1 latency on a
random-weight model shape through vLLM's offline `LLM` (load_format="dummy", token-id prompts, no tokenizer),
with the same roofline as our own benchmarks (tensor parallel over N GPUs: divided by N, each GPU reading 1/N of
the weights at the same time). vLLM 0.26 is staged for the GPU machine by shared/peers/vllm/stage.sh (installed
into /tmp/site; run with PYTHONPATH=/tmp/site).

    python -m benchmarks.vllm_peer --shape qwen3-30b-a3b [--json out.json] [--skip-latency]
    python -m benchmarks.vllm_peer --shape llama-8b --tensor-parallel-size 2"""
from __future__ import annotations

import argparse
import json
import time

from benchmarks.common import git_commit, measure_ceilings, nano_workload, print_table, shape_facts, write_shape, SHAPES


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is split over")
    ap.add_argument("--router-dtype", choices=["float32", "model"], default="float32",
                    help="DeepSeek shapes: vLLM's moe_router_dtype. Its dummy weights (uniform +-1e-3, norm weights "
                         "included) give router logits ~1e-5, and with the model dtype its softmax output is bf16, "
                         "which rounds all 64 scores to 1/64: every token then picks the same 6 experts, a workload "
                         "no real checkpoint gives. float32 (what transformers computes the router in) keeps "
                         "per-token routing, as in our runs.")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    t0 = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    model_dir = write_shape(args.shape)
    overrides = {}
    if SHAPES[args.shape].get("model_type", "").startswith("deepseek") and args.router_dtype == "float32":
        overrides["moe_router_dtype"] = "float32"
    llm = LLM(hf_overrides=overrides or None, model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, gpu_memory_utilization=0.88,
              enable_prefix_caching=False, seed=0, tensor_parallel_size=args.tensor_parallel_size)
    startup = time.perf_counter() - t0
    as_prompts = lambda ps: [{"prompt_token_ids": p} for p in ps]  # noqa: E731
    prompts, outs = nano_workload(args.num_requests)
    llm.generate(as_prompts([p[:64] for p in prompts[:8]]),
                 SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, detokenize=False) for o in outs]
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = llm.generate(as_prompts(prompts), params, use_tqdm=False)
    dt = time.perf_counter() - t
    n_out = sum(len(r.outputs[0].token_ids) for r in res)
    assert n_out == sum(outs), (n_out, sum(outs))
    n_total = n_out + sum(len(p) for p in prompts)
    tp = args.tensor_parallel_size
    result = dict(engine=f"vllm {vllm.__version__}", hf_overrides=overrides, shape=args.shape, tensor_parallel_size=tp, commit=git_commit(), startup_s=startup,
                  out_tok_s=n_out / dt, total_tok_s=n_total / dt, seconds=dt)

    if not args.skip_latency:
        prompt = nano_workload(1, seed=2, in_range=(args.prompt_len, args.prompt_len))[0][0]

        def timed(n: int) -> float:  # best of 3 end-to-end runs of one request (as latency.py)
            sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
            runs = []
            for _ in range(4):
                t = time.perf_counter()
                llm.generate(as_prompts([prompt]), sp, use_tqdm=False)
                runs.append(time.perf_counter() - t)
            return min(runs[1:])

        ttft, total = timed(1), timed(args.output_len)
        # decode-only, as benchmarks/latency.py reports ours; end to end / n as the peer README's table
        result["batch1_ms_per_token"] = (total - ttft) / (args.output_len - 1) * 1e3
        result["batch1_e2e_ms_per_token"] = total / args.output_len * 1e3
        result["ttft_ms"] = ttft * 1e3
    del llm
    ceil = measure_ceilings()
    facts = shape_facts(args.shape)
    result["roofline_batch1_ms_per_token"] = facts.active_weight_bytes(1) / ceil["copy_bytes_per_s"] / tp * 1e3
    result["active_GB_per_step_batch1"] = facts.active_weight_bytes(1) / 1e9
    print_table(f"vLLM peer, {args.shape} (bf16 random weights){f', TP {tp}' if tp > 1 else ''}", [
        {k: result[k] for k in ("engine", "out_tok_s", "total_tok_s", "seconds", "startup_s")}
        | {"batch1_ms_per_token": result.get("batch1_ms_per_token", float("nan")),
           "batch1_e2e_ms_per_token": result.get("batch1_e2e_ms_per_token", float("nan")),
           "roofline_batch1_ms": result["roofline_batch1_ms_per_token"]}])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
