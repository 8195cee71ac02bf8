"""The image server's frontend alone, no model: how many image chat requests per second the render threads turn
into engine requests (base64 + PNG decode, chat template, the HF image processor, content hash + wire tensors),
as the server runs them (kestrel/server/chat.py: resolve_image_parts -> render_chat -> process_images).

Per configuration (render threads x torch threads in this process, with or without the start-up warm-up) a fresh
processor takes a first wave of requests (what the first users after start-up see) and then the rest; the table
gives both rates and the CPU time one request costs, split by stage. Uses mm_serve.py's LLaVA-NeXT-7B-shaped
folder and images (written if absent; no weights are read).

  python -m benchmarks.mm_render --threads 1,4,8 --torch-threads default,1 --requests 96
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.mm_serve import image_urls, write_llava_next_7b

STAGES = ("decode", "template", "processor")


def make_input_processor(folder: Path, pixel_dtype: str = "bfloat16"):
    import torch
    from transformers import AutoTokenizer

    from kestrel.config import EngineConfig
    from kestrel.frontend.processor import InputProcessor, make_mm_processor
    from kestrel.loader import load_hf_config

    config = EngineConfig()
    config.model.model = str(folder)
    hf = load_hf_config(str(folder))
    mm = make_mm_processor(config, hf)
    mm.pixel_dtype = getattr(torch, pixel_dtype)  # what a GPU server sets (the engine's model dtype)
    return InputProcessor(AutoTokenizer.from_pretrained(folder), 4096, hf.text_config.vocab_size, mm=mm), config


def render_one(inp, config, url: str, cpu: dict, lock: threading.Lock) -> int:
    from kestrel.frontend.media import resolve_image_parts

    t0 = time.thread_time()
    messages = resolve_image_parts([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                                 {"type": "text", "text": "describe the image"}]}],
                                   config.multimodal)
    t1 = time.thread_time()
    prompt = inp.render_chat(messages)
    t2 = time.thread_time()
    processed = inp.process_images(prompt)
    t3 = time.thread_time()
    with lock:
        for k, v in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2)):
            cpu[k] += v
    return len(processed.token_ids)


def run_config(folder: Path, urls: list[str], threads: int, torch_threads: str, warm: bool, first_wave: int,
               pixel_dtype: str) -> dict:
    import torch

    before = torch.get_num_threads()
    if torch_threads != "default":
        torch.set_num_threads(int(torch_threads))
    try:
        inp, config = make_input_processor(folder, pixel_dtype)
        cpu, lock = defaultdict(float), threading.Lock()
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            if warm:  # what AsyncEngine does at start-up: one small image on every render thread
                barrier = threading.Barrier(threads)
                list(pool.map(lambda _: (barrier.wait(), inp.mm.warm_up()), range(threads)))
            t_warm = time.perf_counter() - t0
            t0 = time.perf_counter()
            list(pool.map(lambda u: render_one(inp, config, u, cpu, lock), urls[:first_wave]))
            t_first = time.perf_counter() - t0
            t0 = time.perf_counter()
            rest = urls[first_wave:]
            list(pool.map(lambda u: render_one(inp, config, u, cpu, lock), rest))
            t_rest = time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)
    n = len(urls)
    return {"threads": threads, "torch_threads": torch_threads, "warm_up": warm, "warm_up_s": t_warm,
            "first_wave_req_s": first_wave / t_first, "steady_req_s": len(rest) / t_rest,
            **{f"cpu_ms_{k}": 1e3 * cpu[k] / n for k in STAGES}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="/tmp/kestrel-llava-next-7b", help="the 7B-shaped folder (written if absent)")
    p.add_argument("--threads", default="1,4,8", help="render thread counts to try")
    p.add_argument("--torch-threads", default="default,1", help="torch intra-op threads in this process to try")
    p.add_argument("--requests", type=int, default=96, help="requests per configuration (distinct images)")
    p.add_argument("--first-wave", type=int, default=32, help="requests counted as the first wave")
    p.add_argument("--pixel-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the dtype pixels travel in (a GPU server: its model dtype)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    folder = Path(args.model_dir)
    if not (folder / "config.json").exists():
        write_llava_next_7b(folder)
    import os

    import torch

    print(f"{os.cpu_count()} CPUs, torch {torch.__version__} default threads {torch.get_num_threads()}; "
          f"making {args.requests} images ...", flush=True)
    urls = image_urls(args.requests, 0)
    inp, _ = make_input_processor(folder, args.pixel_dtype)
    print("image processor:", type(inp.mm.processor.image_processor).__name__)
    rows = []
    for tt in args.torch_threads.split(","):
        for th in (int(x) for x in args.threads.split(",")):
            for warm in (False, True):
                rows.append(run_config(folder, urls, th, tt, warm, min(args.first_wave, args.requests // 2),
                                       args.pixel_dtype))
                r = rows[-1]
                print(f"threads {th} torch {tt} warm {warm}: first wave {r['first_wave_req_s']:.1f} req/s, "
                      f"steady {r['steady_req_s']:.1f} req/s", flush=True)
    print("\n| render threads | torch threads | warm-up | warm-up s | first wave req/s | steady req/s | "
          "CPU ms/request: decode | template | image processor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['threads']} | {r['torch_threads']} | {'yes' if r['warm_up'] else 'no'} | {r['warm_up_s']:.2f} | "
              f"{r['first_wave_req_s']:.1f} | {r['steady_req_s']:.1f} | {r['cpu_ms_decode']:.1f} | "
              f"{r['cpu_ms_template']:.1f} | {r['cpu_ms_processor']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
