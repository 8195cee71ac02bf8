"""Engine CPU time per decode step at batch 256 with the model replaced by a stub (no device work), so what
is left is scheduling, input preparation, sampling bookkeeping and output processing.

    python benchmarks/cpu_overhead.py [--batch 256]"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch

from common import SHAPES, nano_workload

from kestrel import LLM, SamplingParams


class StubModel(torch.nn.Module):
    def __init__(self, real, vocab):
        super().__init__()
        self.real, self.vocab = real, vocab

    def forward(self, input_ids, positions, ctx, inputs_embeds=None):
        return torch.zeros(input_ids.shape[0], 8)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], self.vocab)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--detokenize", action="store_true", help="also stream text (off: token ids, as the "
                    "throughput benchmark)")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp())
    cfg = dict(SHAPES["qwen3-0.6b"], num_hidden_layers=1, hidden_size=64, intermediate_size=64, vocab_size=512,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, bos_token_id=1, eos_token_id=2)
    (d / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(d), load_format="dummy", progress=False, max_num_batched_tokens=16384, num_kv_blocks=40000,
              enable_prefix_caching=False, async_scheduling="on")
    eng = llm.engine
    runner = eng.core.runner
    runner.model = StubModel(runner.model, 512)
    prompts, _ = nano_workload(args.batch, vocab_cap=512)
    for p in prompts:
        # greedy: on the CPU a sampling step's random draw would dominate what this measures
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True,
                                          detokenize=args.detokenize))
    while eng.core.scheduler.num_waiting or any(r.in_prefill for r in eng.core.scheduler.running):
        eng.step()
    for _ in range(5):
        eng.step()
    n = 50
    t = time.perf_counter()
    for _ in range(n):
        eng.step()
    dt = (time.perf_counter() - t) / n
    print(f"CPU time per decode step at batch {args.batch}: {dt * 1e3:.2f} ms ({dt / args.batch * 1e6:.1f} us/request)")
    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            eng.step()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
