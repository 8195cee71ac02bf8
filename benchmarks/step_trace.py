"""Where the time of a throughput (or latency) run goes, step by step, on the GPU.

Runs the nano-vllm workload (or batch-1 decode with --latency) and records for every launched step: the host
time spent launching it, the GPU time from its first to its last queued op (CUDA events), the GPU interval to
the next step's start (includes idle gaps), its batch, tokens and the KV context it reads. Prints totals by step
kind and batch bucket, with the achieved KV-read bandwidth of decode steps, and each bucket's own roofline (weights
+ KV reads at the measured copy rate, prefill FLOPs at the measured bf16 rate; the same law as throughput.py) so
every bucket prints how far it is from its floor.

    python -m benchmarks.step_trace --shape qwen3-0.6b [--latency] [--json trace.json]"""
from __future__ import annotations

import argparse
import json
import time

from benchmarks.common import SHAPES, measure_ceilings, nano_workload, print_table, shape_facts, write_shape


def step_roofline_s(rec: dict, facts, ceil: dict) -> float:
    """One step's floor: the weights it reads (MoE: the experts its tokens are expected to hit) and its decode
    rows' KV context at the copy rate, plus its prefill tokens' matmul FLOPs at the bf16 rate."""
    prefill_tokens = rec["tokens"] - rec["decodes"]
    read = (facts.active_weight_bytes(rec["tokens"]) + rec["decode_ctx"] * facts.kv_bytes_per_token
            + 2 * rec["decodes"] * facts.state_bytes_per_seq)
    return read / ceil["copy_bytes_per_s"] + prefill_tokens * facts.flops_per_token / ceil["bf16_flops_per_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--latency", action="store_true", help="batch 1, prompt 128, 256 greedy output tokens")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from kestrel import LLM, SamplingParams

    facts = shape_facts(args.shape)
    ceil = measure_ceilings()
    llm = LLM(str(write_shape(args.shape)), load_format="dummy", dtype="bfloat16", max_num_seqs=256,
              max_num_batched_tokens=16384, enable_prefix_caching=False, progress=False,
              enforce_eager=args.enforce_eager)
    runner = llm.engine.core.executor.runner
    if args.latency:
        prompts = nano_workload(1, seed=2, in_range=(128, 128))[0]
        params = [SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)]
    else:
        prompts, outs = nano_workload(args.num_requests)
        params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, detokenize=False) for o in outs]
    llm.generate([p[:64] for p in prompts[:8]], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)

    recs = []
    orig_launch, orig_collect = runner.launch, runner.collect

    def launch(step, prev=None, *args, **kwargs):  # the executor passes sample and before_forward too
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        inf = orig_launch(step, prev, *args, **kwargs)
        end.record()
        t1 = time.perf_counter()
        s = step.chunks
        n_tok = sum(x.num_new_tokens for x in s)
        dec = sum(1 for x in s if x.num_new_tokens == 1)
        ctx = sum(x.num_computed_tokens + x.num_new_tokens for x in s if x.num_new_tokens == 1)
        recs.append(dict(t0=t0, host_ms=(t1 - t0) * 1e3, reqs=len(s), decodes=dec, tokens=n_tok, decode_ctx=ctx,
                         _start=start, _end=end, wait_ms=0.0))
        inf._rec = recs[-1]
        return inf

    def collect(inf):
        t = time.perf_counter()
        out = orig_collect(inf)
        rec = getattr(inf, "_rec", None)
        if rec is not None:
            rec["wait_ms"] = (time.perf_counter() - t) * 1e3
        return out

    runner.launch, runner.collect = launch, collect
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    for i, r in enumerate(recs):
        r["gpu_ms"] = r["_start"].elapsed_time(r["_end"])
        r["interval_ms"] = r["_start"].elapsed_time(recs[i + 1]["_start"]) if i + 1 < len(recs) else r["gpu_ms"]
        r["host_interval_ms"] = ((recs[i + 1]["t0"] - r["t0"]) * 1e3) if i + 1 < len(recs) else r["host_ms"]
    for r in recs:
        del r["_start"], r["_end"]

    def bucket(r):
        if r["tokens"] > r["reqs"]:
            return "prefill/mixed"
        b = r["reqs"]
        for lo, hi in [(1, 1), (2, 16), (17, 64), (65, 128), (129, 192), (193, 256)]:
            if lo <= b <= hi:
                return f"decode {lo}-{hi}"
        return "decode >256"

    groups: dict[str, list] = {}
    for r in recs:
        groups.setdefault(bucket(r), []).append(r)
    rows = []
    for name in sorted(groups, key=lambda k: (k != "prefill/mixed", int(k.split()[1].split("-")[0]) if k != "prefill/mixed" else 0)):
        g = groups[name]
        interval = sum(r["interval_ms"] for r in g)
        gpu = sum(r["gpu_ms"] for r in g)
        kv = sum(r["decode_ctx"] for r in g) * facts.kv_bytes_per_token + len(g) * facts.weight_bytes
        roof_ms = sum(step_roofline_s(r, facts, ceil) for r in g) * 1e3
        rows.append(dict(kind=name, steps=len(g), total_s=interval / 1e3, ms_per_step=interval / len(g),
                         gpu_ms_per_step=gpu / len(g), host_launch_ms=sum(r["host_ms"] for r in g) / len(g),
                         host_interval_ms=sum(r["host_interval_ms"] for r in g) / len(g),
                         wait_ms=sum(r["wait_ms"] for r in g) / len(g),
                         mean_batch=sum(r["reqs"] for r in g) / len(g),
                         bytes_GB_per_s=kv / (interval / 1e3) / 1e9,
                         roofline_ms_per_step=roof_ms / len(g), frac_own_roofline=f"{roof_ms / interval:.0%}"))
    total_roof = sum(step_roofline_s(r, facts, ceil) for r in recs)
    print(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), read-only "
          f"{ceil['read_bytes_per_s'] / 1e12:.2f} TB/s, bf16 {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s; "
          f"run at {total_roof / wall:.0%} of its step-by-step roofline ({total_roof:.2f} s)")
    print_table(f"Step trace, {args.shape}, {'latency' if args.latency else 'throughput'} "
                f"({'eager' if args.enforce_eager else 'graphs'}): wall {wall:.2f} s, {len(recs)} steps", rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(wall_s=wall, rows=rows, steps=recs), f)


if __name__ == "__main__":
    main()
