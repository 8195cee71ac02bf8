"""Multi-LoRA throughput: the 256-request offline workload (nano-vllm's: prompt and output lengths uniform in
[100, 1024], random token ids, ignore_eos) on a random-weight model shape, run twice on the same shape: without
LoRA, and with --enable-lora and 4 random rank-16 PEFT adapters (q/k/v/o/gate/up/down) spread over the requests
(request i uses adapter i % 4). Prints both output tokens/s and their ratio (target >= 75%).

    python -m benchmarks.lora_throughput --shape qwen3-0.6b [--num-adapters 4 --rank 16] [--json out.json]"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import SHAPES, git_commit, nano_workload, print_table, write_shape

from kestrel.bench.lora_adapters import write_random_adapter


def write_adapter(folder: Path, shape: dict, rank: int, seed: int) -> Path:
    """A PEFT adapter folder with random bf16 weights for every attention and MLP projection of every layer."""
    import torch

    return write_random_adapter(folder, shape, rank, seed, a_scale=None, b_scale=0.01, dtype=torch.bfloat16)


def run(model_dir, prompts, outs, args, adapters: list[Path] | None):
    import torch

    from kestrel import LLM, SamplingParams

    lora = dict(enable_lora=True, max_lora_rank=args.rank, max_loras=len(adapters)) if adapters else {}
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.9,
              enable_prefix_caching=False, progress=False, **lora)
    loras = [llm.load_lora(f"adapter{i}", str(p)) for i, p in enumerate(adapters or [])]
    per_request = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    warm = [p[:64] for p in prompts[:8]]
    llm.generate(warm, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False,
                 lora_request=per_request[:8] if per_request else None)
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, detokenize=False) for o in outs]
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False, lora_request=per_request)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    n_out = sum(len(r.outputs[0].token_ids) for r in res)
    assert n_out == sum(outs), (n_out, sum(outs))
    graphs = llm.engine.core.executor.runner.graphs is not None
    llm.shutdown()
    return dt, n_out, graphs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()

    model_dir = write_shape(args.shape)
    prompts, outs = nano_workload(args.num_requests)
    root = Path(tempfile.mkdtemp(prefix="kestrel-loras-"))
    adapters = [write_adapter(root / f"adapter{i}", SHAPES[args.shape], args.rank, seed=i)
                for i in range(args.num_adapters)]
    base_dt, base_n, base_graphs = run(model_dir, prompts, outs, args, None)
    lora_dt, lora_n, lora_graphs = run(model_dir, prompts, outs, args, adapters)
    ratio = (lora_n / lora_dt) / (base_n / base_dt)
    rows = [dict(engine="kestrel, no LoRA", requests=len(prompts), seconds=base_dt, out_tok_s=base_n / base_dt,
                 cuda_graphs=base_graphs),
            dict(engine=f"kestrel, {args.num_adapters} adapters rank {args.rank}", requests=len(prompts),
                 seconds=lora_dt, out_tok_s=lora_n / lora_dt, cuda_graphs=lora_graphs)]
    print_table(f"Multi-LoRA throughput, {args.shape} (bf16 random weights), commit {git_commit()}", rows)
    print(f"\nLoRA / no-LoRA output tokens/s: {ratio:.1%} (target >= 75%)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(shape=args.shape, commit=git_commit(), base_out_tok_s=base_n / base_dt,
                                                   lora_out_tok_s=lora_n / lora_dt, ratio=ratio,
                                                   num_adapters=args.num_adapters, rank=args.rank), indent=1))


if __name__ == "__main__":
    main()
