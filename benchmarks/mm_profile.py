"""Where an image workload's time goes, offline (no server): the LLaVA-NeXT-7B shape of mm_serve.py, N requests
with one image each, all added before the first step. Prints a table per workload:

  images, 64 tokens   the serving workload's GPU side (no HTTP, no streaming)
  images, 1 token     vision tower + merge + decoder prefill
  text, 1 token       decoder prefill alone on prompts of the same token counts (random ids)

with the CPU time of adding the requests (image processor + template), the step loop's wall time, the GPU time of
the vision encoder (CUDA events around embed_image) and the steps by kind; then the serving pattern without the
server (--concurrency requests in flight, the next admitted as one finishes, images processed beforehand): its
requests/s, TTFT and E2E are what the engine gives a server whose frontend costs nothing. --trace also prints the
top CUDA kernels of the 1-token image run (torch.profiler).

  python -m benchmarks.mm_profile --model-dir /tmp/llava-next-7b --num-requests 64
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import print_table
from benchmarks.mm_serve import images, write_llava_next_7b
from kestrel.bench.serve_metrics import percentile

PROMPT = "<|im_start|>user\n<image>\ndescribe the image in detail<|im_end|>\n<|im_start|>assistant\n"


def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class CpuEvent:
    """torch.cuda.Event's two calls, on the host clock (CPU runs of this script)."""

    def __init__(self, enable_timing=True):
        self.t = 0.0

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


class EncoderTimer:
    """CUDA-event time of every embed_image call (read after the run)."""

    def __init__(self, model):
        import torch
        self.pairs, self.model, self.orig = [], model, model.embed_image
        event = torch.cuda.Event if torch.cuda.is_available() else CpuEvent

        def timed(image):
            a, b = event(enable_timing=True), event(enable_timing=True)
            a.record()
            out = self.orig(image)
            b.record()
            self.pairs.append((a, b))
            return out
        model.embed_image = timed

    def total_ms(self) -> tuple[int, float]:
        sync()
        n, ms = len(self.pairs), sum(a.elapsed_time(b) for a, b in self.pairs)
        self.pairs.clear()
        return n, ms


def run(engine, prompts, params, label: str, timer, steps_of) -> dict:
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"{label}-{i}")
    t_add = time.perf_counter() - t0
    sync()
    kinds = Counter()
    t1 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    sync()
    wall = time.perf_counter() - t1
    for sched in steps_of:
        pre = sum(s.num_new_tokens for s in sched.scheduled if s.num_new_tokens > 1)
        kinds["prefill tokens"] += pre
        kinds["mixed steps" if pre and len(sched.scheduled) > 1 else "prefill steps" if pre else "decode steps"] += 1
    steps_of.clear()
    n_img, enc_ms = timer.total_ms()
    return {"workload": label, "requests": len(prompts), "add s": t_add, "steps s": wall,
            "req/s (steps)": len(prompts) / wall, "prefill tok/s": kinds["prefill tokens"] / wall,
            "encoder calls": n_img, "encoder GPU ms": enc_ms, **{k: kinds[k] for k in
                                                                ("prefill tokens", "prefill steps", "mixed steps",
                                                                 "decode steps")}}


def closed_loop(engine, prompts, params, concurrency: int, label: str, timer, steps_of) -> dict:
    """The serving pattern without the server: `concurrency` requests in flight, the next one admitted as one
    finishes. Images are processed before the clock starts (the server does it on render threads)."""
    rendered = [engine.input_processor.process_images(p) for p in prompts]
    sync()
    queue, start, first, done = list(enumerate(rendered)), {}, {}, {}
    t0 = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and len(start) - len(done) < concurrency:
            i, p = queue.pop(0)
            rid = f"{label}-{i}"
            start[rid] = time.perf_counter()
            engine.add_request(p, params, request_id=rid, stream=True)
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
    wall = time.perf_counter() - t0
    steps_of.clear()
    ttft = [first[r] - start[r] for r in start]
    e2e = [done[r] - start[r] for r in start]
    n_img, enc_ms = timer.total_ms()
    return {"workload": label, "requests": len(prompts), "steps s": wall, "req/s": len(prompts) / wall,
            "TTFT p50 ms": 1e3 * percentile(ttft, 50), "TTFT p90 ms": 1e3 * percentile(ttft, 90),
            "E2E p50 ms": 1e3 * percentile(e2e, 50), "encoder calls": n_img, "encoder GPU ms": enc_ms}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/llava-next-7b"))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=32, help="closed-loop workload (0: skip it)")
    ap.add_argument("--closed-loop-requests", type=int, default=128)
    ap.add_argument("--trace", action="store_true", help="torch.profiler top kernels of the 1-token image run")
    args = ap.parse_args(argv)

    import torch

    from kestrel.config import EngineConfig
    from kestrel.frontend.sync_engine import LLMEngine
    from kestrel.core.sampling_params import SamplingParams

    if not (args.model_dir / "config.json").exists():
        write_llava_next_7b(args.model_dir)
    opts = {"load_format": "dummy", "max_model_len": 4096}
    if args.max_num_batched_tokens:
        opts["max_num_batched_tokens"] = args.max_num_batched_tokens
    engine = LLMEngine(EngineConfig.create(model=str(args.model_dir), **opts), progress=False)
    core = engine.core
    timer = EncoderTimer(core.executor.runner.model)
    steps_of = []
    schedule = core.scheduler.schedule

    def recorded():
        s = schedule()
        if not s.is_empty:
            steps_of.append(s)
        return s
    core.scheduler.schedule = recorded

    imgs = images(args.num_requests, 0)
    img_prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in imgs]
    gen = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    run(engine, [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in images(4, seed=1)], gen, "warm-up",
        timer, steps_of)
    core.reset_prefix_cache()
    rows = [run(engine, img_prompts, gen, f"images, {args.output_len} tokens", timer, steps_of)]
    core.reset_prefix_cache()
    rows.append(run(engine, img_prompts, one, "images, 1 token", timer, steps_of))
    core.reset_prefix_cache()
    lengths = [len(engine.input_processor.process(f"len-{i}", p, one, 0)[0]) for i, p in enumerate(img_prompts)]
    g = torch.Generator().manual_seed(0)
    vocab = min(core.model_config.text.vocab_size, 32000)  # below LLaVA's added image token
    image_id = engine.input_processor.mm.image_token_id
    text = [{"prompt_token_ids": [t if t != image_id else image_id - 1 for t in
                                  torch.randint(vocab // 4, vocab, (n,), generator=g).tolist()]} for n in lengths]
    rows.append(run(engine, text, one, "text, 1 token (same lengths)", timer, steps_of))
    core.reset_prefix_cache()

    loop = []
    if args.concurrency:
        loop_prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}}
                        for im in images(args.closed_loop_requests, seed=2)]
        loop.append(closed_loop(engine, loop_prompts, gen, args.concurrency,
                                f"images closed loop c={args.concurrency}", timer, steps_of))
        core.reset_prefix_cache()

    print_table(f"LLaVA-NeXT-7B shape, {args.num_requests} requests, mean prompt {sum(lengths) / len(lengths):.0f} "
                f"tokens, max_num_batched_tokens {core.config.scheduler.max_num_batched_tokens}", rows)
    print_table(f"closed loop, {args.closed_loop_requests} requests", loop)

    if args.trace:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(engine, img_prompts[:16], one, "trace", timer, steps_of)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
