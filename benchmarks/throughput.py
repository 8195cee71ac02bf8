"""Offline throughput: nano-vllm's workload (256 requests, prompt and output lengths uniform in [100, 1024],
random token ids, ignore_eos) on a random-weight model shape; transformers' continuous batching
(generate_batch, paged|sdpa) on the same model in the same run; the roofline beside both.

    python -m benchmarks.throughput --shape qwen3-0.6b [--hf-requests 64] [--sweep] [--quantization fp8]
    python -m benchmarks.throughput --shape llama-8b --hf-requests 0 --kv-cache-dtype fp8   (FP8 KV cache)
    python -m benchmarks.throughput --shape llama-70b --tensor-parallel-size 4 --hf-requests 0"""
from __future__ import annotations

import time

T_PROCESS = time.perf_counter()  # noqa: E402  (start-up is measured from here)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402

from benchmarks.common import (  # noqa: E402
    SHAPES, git_commit, measure_ceilings, nano_workload, print_table, shape_facts, write_shape)


def roofline_seconds(facts, prompts, outs, steps: int, ceil: dict, tp: int = 1, kv_bytes: float = 1.0) -> float:
    """Decode: weights once per step (MoE: the active experts) + every token's KV context read; prefill: matmul
    FLOPs. Tensor parallel over `tp` GPUs: each reads 1/tp of the weights and KV and does 1/tp of the FLOPs at
    the same time, so the time divides by tp (the ceilings are one GPU's; all-reduces are not counted). `kv_bytes`:
    the KV cache's bytes per element relative to bf16 (0.5: an FP8 cache). A recurrent-state model (KDA) also reads
    and writes each sequence's state once a decode step."""
    kv_reads = sum(len(p) * o + o * (o - 1) / 2 for p, o in zip(prompts, outs)) * facts.kv_bytes_per_token * kv_bytes
    kv_reads += 2 * sum(outs) * facts.state_bytes_per_seq  # a recurrent state: read and written every decode step
    mean_batch = sum(outs) / max(steps, 1)  # MoE: the experts a step of this many tokens hits
    decode = (kv_reads + steps * facts.active_weight_bytes(mean_batch)) / ceil["copy_bytes_per_s"]
    prefill = sum(len(p) for p in prompts) * facts.flops_per_token / ceil["bf16_flops_per_s"]
    return (decode + prefill) / tp


def step_split(log) -> list[dict]:
    """Wall time between consecutive schedules, by the kind of step: with prefill tokens, or pure decode by
    batch size (pipelined, a step's gap is about its device time)."""
    groups = {}
    for (t0, pre, dec), (t1, _, _) in zip(log, log[1:]):
        key = "prefill+decode" if pre else f"decode {next(b for b in (1, 8, 32, 64, 128, 192, 256, 1 << 20) if dec <= b)}"
        g = groups.setdefault(key, dict(steps=0, seconds=0.0, tokens=0))
        g["steps"] += 1
        g["seconds"] += t1 - t0
        g["tokens"] += pre + dec
    return [dict(kind=k, steps=g["steps"], seconds=g["seconds"], ms_per_step=g["seconds"] / g["steps"] * 1e3,
                 tokens=g["tokens"]) for k, g in sorted(groups.items())]


def run_kestrel(model_dir, prompts, outs, args):
    import torch

    from kestrel import LLM, SamplingParams

    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.9,
              quantization=args.quantization, enable_prefix_caching=False, progress=False, pdl=not args.no_pdl,
              kv_cache_dtype=args.kv_cache_dtype,
              tensor_parallel_size=args.tensor_parallel_size,
              **({"max_model_len": args.max_model_len} if args.max_model_len else {}))
    startup = time.perf_counter() - T_PROCESS
    core = llm.engine.core
    # warm-up: a few short requests through prefill and decode (JIT, allocator)
    llm.generate([p[:64] for p in prompts[:8]], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    # token ids only, like transformers' generate_batch (detokenizing costs ~5 us per token on the host)
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, detokenize=False) for o in outs]
    steps = 0
    orig_step = core.step

    def counting_step():
        nonlocal steps
        steps += 1
        return orig_step()

    core.step = counting_step
    cpu = {"schedule": 0.0, "prepare": 0.0, "update": 0.0, "outputs": 0.0}

    def timed(obj, name, key):
        fn = getattr(obj, name)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                cpu[key] += time.perf_counter() - t0
        setattr(obj, name, wrapper)

    timed(core.scheduler, "schedule", "schedule")
    step_log = []  # (time at schedule, prefill tokens, decode rows): the gaps say where the run's time goes
    sched_fn = core.scheduler.schedule

    def logged_schedule():
        out = sched_fn()
        if not out.is_empty:
            pre = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
            step_log.append((time.perf_counter(), pre, sum(1 for s in out.scheduled if s.num_new_tokens == 1)))
        return out
    core.scheduler.schedule = logged_schedule
    runner = getattr(core.executor, "runner", None)
    if runner is not None:  # tensor parallel: the workers prepare the inputs (not timed here)
        timed(runner, "_prepare", "prepare")
    timed(core.scheduler, "on_launch", "update")
    timed(core.scheduler, "on_result", "update")
    timed(llm.engine.output_processor, "process", "outputs")
    torch.cuda.synchronize()
    from kestrel.kernels.triton_ops.precompile import CompileCounter

    mem0 = torch.cuda.memory_stats()
    t = time.perf_counter()
    # a Triton compilation inside the measured run is start-up work leaking (tensor parallel: the workers'
    # compilations and allocations are not seen from this process)
    with CompileCounter() as compiles:
        res = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    n_out = sum(len(r.outputs[0].token_ids) for r in res)
    assert n_out == sum(outs), (n_out, sum(outs))
    step_log.append((t + dt, 0, 0))
    gaps = sorted(((t1 - t0) * 1e3, pre, dec) for (t0, pre, dec), (t1, _, _) in zip(step_log, step_log[1:]))
    mem1 = torch.cuda.memory_stats()
    during = dict(triton_compiles=compiles.count, **{k: mem1.get(k, 0) - mem0.get(k, 0) for k in (
        "num_alloc_retries", "num_device_alloc", "num_device_free")})  # cudaMalloc/cudaFree inside the run
    print("during the run: " + ", ".join(f"{k} {v}" for k, v in during.items())
          + "; longest steps (ms, prefill tokens, decode rows): "
          + ", ".join(f"({ms:.0f}, {pre}, {dec})" for ms, pre, dec in gaps[-6:]))
    info = dict(during=during, longest_steps=gaps[-6:], step_split=step_split(step_log), startup_s=startup,
                blocks=core.kv.num_blocks,
                graphs=core.executor.runner.graph_capture_seconds if core.executor.runner is not None else float("nan"),
                cpu_ms_per_step={k: v / max(steps, 1) * 1e3 for k, v in cpu.items()}, step_ms=dt / max(steps, 1) * 1e3)
    core.shutdown()  # tensor parallel: the workers exit and free their GPUs
    del llm, core
    gc.collect()
    torch.cuda.empty_cache()
    return dt, n_out, steps, info


def run_hf(model_dir, prompts, outs):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="paged|sdpa").eval()
    mean_out = round(sum(outs) / len(outs))
    gen = GenerationConfig(max_new_tokens=mean_out, do_sample=True, temperature=0.6, eos_token_id=None,
                           pad_token_id=0)
    model.generate_batch(inputs=[p[:64] for p in prompts[:4]], generation_config=GenerationConfig(
        max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0))
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = model.generate_batch(inputs=prompts, generation_config=gen)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    n_out = sum(len(r.generated_tokens) for r in res.values())
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return dt, n_out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--hf-requests", type=int, default=64, help="transformers runs this many of the requests "
                    "(0 = skip); its tokens/s is the comparison")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--quantization", default=None, choices=[None, "fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                    help="the engine's KV cache: auto (bf16) or float8 (twice the tokens, half the KV reads)")
    ap.add_argument("--sweep", action="store_true", help="also measure throughput vs concurrency 1..256 (PNG)")
    ap.add_argument("--no-pdl", action="store_true", help="turn programmatic dependent launch off")
    ap.add_argument("--max-model-len", type=int, default=None, help="cap the context (vLLM's peer runs use 4096)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is split over")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()

    model_dir = write_shape(args.shape)
    facts = shape_facts(args.shape)
    prompts, outs = nano_workload(args.num_requests)
    dt, n_out, steps, info = run_kestrel(model_dir, prompts, outs, args)
    ceil = measure_ceilings()  # after the engine, so that start-up counts the engine alone
    n_total = n_out + sum(len(p) for p in prompts)
    tp = args.tensor_parallel_size
    roof = roofline_seconds(facts, prompts, outs, steps, ceil, tp, 1.0 if args.kv_cache_dtype == "auto" else 0.5)
    kv_label = "" if args.kv_cache_dtype == "auto" else f" kv {args.kv_cache_dtype}"
    rows = [dict(engine=f"kestrel{' fp8' if args.quantization else ''}{kv_label}", requests=len(prompts), seconds=dt,
                 out_tok_s=n_out / dt, total_tok_s=n_total / dt, roofline_out_tok_s=n_out / roof,
                 frac_roofline=f"{roof / dt:.0%}")]
    result = dict(shape=args.shape, tensor_parallel_size=tp, kv_cache_dtype=args.kv_cache_dtype, commit=git_commit(),
                  kestrel_out_tok_s=n_out / dt, kestrel_total_tok_s=n_total / dt,
                  roofline_out_tok_s=n_out / roof, steps=steps, startup_s=info["startup_s"],
                  graph_capture_s=info["graphs"], kv_blocks=info["blocks"],
                  copy_TBps=ceil["copy_bytes_per_s"] / 1e12, read_TBps=ceil["read_bytes_per_s"] / 1e12,
                  bf16_TFLOPs=ceil["bf16_flops_per_s"] / 1e12)
    if args.hf_requests:
        hp = prompts[: args.hf_requests]
        hdt, hn = run_hf(model_dir, hp, outs[: args.hf_requests])
        htotal = hn + sum(len(p) for p in hp)
        rows.append(dict(engine="transformers generate_batch (paged|sdpa)", requests=len(hp), seconds=hdt,
                         out_tok_s=hn / hdt, total_tok_s=htotal / hdt, roofline_out_tok_s=float("nan"),
                         frac_roofline="-"))
        result.update(hf_out_tok_s=hn / hdt, hf_requests=len(hp), ratio=(n_out / dt) / (hn / hdt))
    print_table(f"Throughput, {args.shape} (bf16 random weights){f', TP {tp}' if tp > 1 else ''}, "
                f"commit {result['commit']}", rows)
    print(f"\nstart-up (process start -> ready, CUDA graphs included): {info['startup_s']:.1f} s "
          f"(graph capture {info['graphs']:.1f} s); KV blocks {info['blocks']}; engine steps {steps}")
    print("CPU time per step (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in info["cpu_ms_per_step"].items())
          + f"; mean step {info['step_ms']:.2f} ms")
    print_table("Where the run's time goes (wall between schedules; decode rows up to N)", info["step_split"])
    result["step_split"] = info["step_split"]
    result["during_run"] = info["during"]
    result["longest_steps"] = info["longest_steps"]
    result["cpu_ms_per_step"] = info["cpu_ms_per_step"]
    result["step_ms"] = info["step_ms"]
    kv, llama_kv = facts.kv_bytes_per_token, shape_facts("llama-8b").kv_bytes_per_token
    print(f"KV cache bytes per token (all layers, bf16): {args.shape} {kv:,}; llama-8b {llama_kv:,} "
          f"({llama_kv / kv:.1f}x as many tokens of {args.shape} fit in the same memory)")
    result["kv_bytes_per_token"] = kv
    print(f"ceilings: copy {result['copy_TBps']:.2f} TB/s, read-only {result['read_TBps']:.2f} TB/s, "
          f"bf16 matmul {result['bf16_TFLOPs']:.0f} TFLOP/s")
    if "ratio" in result:
        print(f"Kestrel / transformers output tokens/s: {result['ratio']:.1f}x")
    if args.sweep:
        from kestrel import LLM, SamplingParams
        import torch
        sweep = []
        llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_num_seqs=256,
                  max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False, progress=False,
                  tensor_parallel_size=args.tensor_parallel_size)
        for c in [1, 2, 4, 8, 16, 32, 64, 128, 256]:
            ps, os_ = nano_workload(c, seed=1, out_range=(256, 256))
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate(ps, [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.6) for o in os_], use_tqdm=False)
            torch.cuda.synchronize()
            sweep.append(dict(concurrency=c, out_tok_s=sum(os_) / (time.perf_counter() - t)))
        print_table("Throughput vs concurrent requests (prompt 100..1024, output 256)", sweep)
        result["sweep"] = sweep
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
