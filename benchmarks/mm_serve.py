"""Image chat benchmark: N streaming chat clients, one image per request (base64 PNG in an image_url part), against
an OpenAI-compatible server. Prints requests/s, TTFT and ITL percentiles.

By default it writes a LLaVA-NeXT-7B-shaped checkpoint folder (llava-v1.6-vicuna-7b: CLIP ViT-L/14-336 tower, the
anyres pinpoints up to 672x672, a 32-layer 4096-wide Llama decoder; config + processor + a small tokenizer with
the image token, no weights) and starts `kestrel serve --load-format dummy` on it. The same folder serves vLLM
for the side-by-side (`vllm serve FOLDER --load-format dummy`, then `--url`).

  python -m benchmarks.mm_serve --num-requests 128 --concurrency 32            # starts kestrel on the 7B shape
  python -m benchmarks.mm_serve --write-model /tmp/llava7b                      # only write the folder
  python -m benchmarks.mm_serve --url http://127.0.0.1:8000 --model-dir /tmp/llava7b
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import re
import shlex
import sys
import time
import urllib.request
from pathlib import Path

from kestrel.bench.serve import latency_rows, run_clients, start_server

PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
IMAGE_SIZES = [(640, 480), (800, 600), (336, 336), (1024, 768), (480, 640)]  # (width, height)


def write_llava_next_7b(out: Path) -> Path:
    """config.json + processor files of the LLaVA-NeXT-7B shape (weights: --load-format dummy)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from kestrel.bench.tiny_tokenizer import LLAVA_CHAT_TEMPLATE, tokenizer_with_image_token

    tok = tokenizer_with_image_token()
    # one token string per id of the 7B vocabulary: random weights sample any id, and ids the tiny tokenizer lacks
    # would decode to nothing (no streamed delta: output tokens and inter-token gaps would go uncounted)
    tok.add_tokens([f" w{i}" for i in range(32064 - len(tok))])
    tok.chat_template = LLAVA_CHAT_TEMPLATE
    image_proc = LlavaNextImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                            image_grid_pinpoints=PINPOINTS)
    proc = LlavaNextProcessor(image_processor=image_proc, tokenizer=tok, patch_size=14,
                              vision_feature_select_strategy="default", image_token="<image>",
                              num_additional_image_tokens=1, chat_template=LLAVA_CHAT_TEMPLATE)
    text = LlamaConfig(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                       rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu")
    cfg = LlavaNextConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_grid_pinpoints=PINPOINTS,
                          vision_feature_layer=-2, vision_feature_select_strategy="default",
                          image_token_index=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    cfg.architectures = ["LlavaNextForConditionalGeneration"]
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    proc.save_pretrained(out)
    return out


def write_qwen2_5_vl_7b(out: Path) -> Path:
    """config.json + processor files of the Qwen2.5-VL-7B shape (weights: --load-format dummy): Qwen2.5-VL-7B-
    Instruct's text and vision dimensions, its image processor's pixel bounds, the tiny tokenizer padded to its
    152,064 ids with its four vision tokens."""
    from tokenizers import AddedToken
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from kestrel.bench.tiny_tokenizer import QWEN_VL_CHAT_TEMPLATE, QWEN_VL_TOKENS, make_tokenizer

    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, normalized=False, special=True)
                                                          for t in QWEN_VL_TOKENS]})
    tok.add_tokens([f" w{i}" for i in range(152064 - len(tok))])
    tok.chat_template = QWEN_VL_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_TOKENS}
    image_proc = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2,
                                          merge_size=2)
    text = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                  out_hidden_size=3584, hidden_act="silu")
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    tok.save_pretrained(out)
    image_proc.save_pretrained(out)
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 14, "temporal_patch_size": 2,
             "merge_size": 2, "size": {"shortest_edge": 3136, "longest_edge": 12845056}}
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    return out


WRITERS = {"llava_next": write_llava_next_7b, "qwen2_5_vl": write_qwen2_5_vl_7b}


def images(n: int, seed: int) -> list:
    """n random-pixel PIL images cycling through IMAGE_SIZES."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for w, h in (IMAGE_SIZES[i % len(IMAGE_SIZES)] for i in range(n))]


def image_urls(n: int, seed: int) -> list[str]:
    urls = []
    for im in images(n, seed):
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return urls


def request_body(model: str, image: str, text: str, max_tokens: int) -> bytes:
    """The JSON body of one request, encoded before the run: json.dumps of a megabytes-long data URL blocks the
    client's event loop for tens of milliseconds, which would delay every other stream's timestamps."""
    return json.dumps({"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                                 {"type": "text", "text": text}]}]}).encode()


async def one_request(client, url: str, body: bytes, res: dict) -> None:
    t0 = time.perf_counter()
    last = None
    async with client.stream("POST", url + "/v1/chat/completions", content=body,
                             headers={"Content-Type": "application/json"}) as r:
        if r.status_code != 200:
            res["errors"].append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line[6:] == "[DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                res["errors"].append(obj["error"]["message"])
                return
            if obj.get("usage"):
                res["completion_tokens"] += obj["usage"]["completion_tokens"]
            if not obj["choices"] or "content" not in obj["choices"][0].get("delta", {}) and \
                    not obj["choices"][0].get("finish_reason"):
                continue
            now = time.perf_counter()
            if last is None:
                res["ttft"].append(now - t0)
            else:
                res["itl"].append(now - last)
            last = now
    res["latency"].append(time.perf_counter() - t0)


def server_means(url: str) -> dict:
    """Mean server-side TTFT (ms) from the vllm:time_to_first_token_seconds histogram on /metrics (empty when the
    server has no such metric); both servers start that clock after the prompt is rendered."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    sums = {}
    for m in re.finditer(r'^(vllm:time_to_first_token_seconds|kestrel_request_frontend_seconds)_(sum|count)'
                         r'\{([^}]*)\} (\S+)$', text, re.M):
        stage = re.search(r'stage="(\w+)"', m[3])
        name = stage[1] if stage else "ttft"
        sums[name, m[2]] = sums.get((name, m[2]), 0.0) + float(m[4])
    return {name: 1e3 * sums[name, "sum"] / n for (name, key), n in sums.items() if key == "count" and n}


async def run(args, url: str) -> int:
    rng = random.Random(args.seed)
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        model = json.load(r)["data"][0]["id"]
    images = image_urls(min(args.num_requests, args.distinct_images), args.seed)
    words = ["describe", "the", "image", "in", "detail", "what", "is", "shown"]
    jobs = [request_body(model, images[i % len(images)], " ".join(rng.choice(words) for _ in range(12)),
                         args.output_len) for i in range(args.num_requests)]
    res = {"ttft": [], "itl": [], "latency": [], "errors": [], "completion_tokens": 0}
    elapsed = await run_clients(lambda client, body: one_request(client, url, body, res), jobs, res,
                                args.concurrency, args.request_timeout)
    print(f"\nimage chat benchmark: {args.num_requests} requests, concurrency {args.concurrency}, one image each "
          f"({len(images)} distinct, sizes {IMAGE_SIZES}), {args.output_len} output tokens")
    rows = [("requests/s", f"{args.num_requests / elapsed:.2f}"),
            ("errors", str(len(res["errors"]))),
            ("output tokens/s (usage)", f"{res['completion_tokens'] / elapsed:.1f}"),
            ("streamed deltas/s", f"{(len(res['itl']) + len(res['ttft'])) / elapsed:.1f}")] + latency_rows(res)
    server = server_means(url)
    if server:
        client_ttft = 1e3 * sum(res["ttft"]) / max(1, len(res["ttft"]))
        rows.append(("mean TTFT client / server (ms)", f"{client_ttft:.1f} / {server['ttft']:.1f}"
                     "  (server: from the request's admission after rendering)"))
        stages = [f"{k} {server[k]:.1f}" for k in ("receive", "render_wait", "render", "resume") if k in server]
        if stages:
            rows.append(("frontend stage means (ms)", ", ".join(stages)))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    for e in res["errors"][:5]:
        print("error:", e)
    return 1 if res["errors"] else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="server to load (default: start kestrel on --model-dir)")
    p.add_argument("--model-dir", default="/tmp/kestrel-llava-next-7b", help="the 7B-shaped folder (written if absent)")
    p.add_argument("--write-model", default=None, help="write the 7B-shaped folder here and exit")
    p.add_argument("--arch", choices=list(WRITERS), default="llava_next",
                   help="the 7B shape --write-model (or an absent --model-dir) is written as")
    p.add_argument("--server-args", default="--load-format dummy --max-model-len 4096",
                   help="extra `kestrel serve` flags")
    p.add_argument("--server-log", default=None)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--distinct-images", type=int, default=1000, help="fewer than requests: repeats hit the cache")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.write_model:
        print(WRITERS[args.arch](Path(args.write_model)))
        return 0
    proc = None
    url = args.url
    if url is None:
        folder = Path(args.model_dir)
        if not (folder / "config.json").exists():
            WRITERS[args.arch](folder)
        args.model = str(folder)
        proc, url = start_server(args)
        print(f"started kestrel serve {folder} {shlex.join(shlex.split(args.server_args))} at {url}")
    try:
        return asyncio.run(run(args, url))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
