"""Online-serving benchmark in the shape of vLLM's `vllm bench serve`: streaming completions against an
OpenAI-compatible server (Kestrel's or vLLM's), sent at a request rate or a concurrency, from a dataset with a
length distribution. Prints request and token throughput and TTFT / TPOT / ITL / E2E latency (mean, median and
the --metric-percentiles) as a table; --result-file writes them with the keys vLLM's result file uses.

How requests go out:
  --request-rate R    R requests/s on average, gaps drawn from a gamma distribution (--burstiness 1: a Poisson
                      process; < 1 burstier, > 1 more even); inf (default): all at once.
  --max-concurrency C at most C requests in flight; a request whose time has come waits for a free slot (with
                      --request-rate inf this is a closed loop of C clients).
What they ask:
  --dataset-name random    prompts of random token ids (sent as token ids: the same length on every server),
                           lengths uniform in [L(1-r), L(1+r)] for --random-input-len / --random-output-len L and
                           --random-range-ratio r. Every request runs to its output length (ignore_eos), so two
                           servers generate the same number of tokens.
  --dataset-name sharegpt  --dataset-path FILE (ShareGPT JSON): first turn = prompt, second turn's length = output
                           length (or --sharegpt-output-len); --ignore-eos to make them exact.
The tokenizer (for the random vocabulary and ShareGPT lengths) is --tokenizer, else the server's model folder.
Without --base-url it starts `kestrel serve --model PATH` on a free port and stops it after. Against Kestrel it
then checks through /metrics that no request is left and the KV pool is free again (--disconnect-fraction makes
some clients hang up mid-stream, which must free their blocks too).

  kestrel bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 --result-file r.json
  kestrel bench serve --base-url http://127.0.0.1:8000 --max-concurrency 32 --random-input-len 1024
  kestrel bench serve --model PATH --num-prompts 64 --max-concurrency 16 --disconnect-fraction 0.2
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import json
import math
import os
import random
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx2

from kestrel.bench.serve_client import run_load
from kestrel.bench.serve_data import SampleRequest, arrival_times, random_requests, sharegpt_requests
from kestrel.bench.serve_metrics import RequestResult, percentile, summarize, table_lines

CLIENT_CPU_WARN = 0.7  # share of one core above which the latencies are the client's as much as the server's


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kestrel.cli", "serve", "--port", str(port), "--host", "127.0.0.1"]
    if args.model:
        cmd += ["--model", args.model]
    cmd += shlex.split(args.server_args)
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with code {proc.returncode} (command: {shlex.join(cmd)})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server not healthy after {args.startup_timeout} s")


def latency_rows(res: dict) -> list[tuple[str, str]]:
    """Table rows of the TTFT, inter-token and end-to-end latency percentiles (res: seconds per kind)."""
    return [(f"{name} p50 / p90 / p99 (ms)", " / ".join(f"{percentile(xs, p) * 1e3:.1f}" for p in (50, 90, 99)))
            for name, xs in (("TTFT", res["ttft"]), ("ITL", res["itl"]), ("E2E", res["latency"]))]


async def run_clients(send, jobs: list, res: dict, concurrency: int, request_timeout: float,
                      headers: dict | None = None, keepalive: bool = True) -> float:
    """Awaits `send(client, job)` for every job, at most `concurrency` at once, over one HTTP client; a job that
    raises is counted in res["errors"]. keepalive=False: a fresh connection per request. Returns the wall time."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx2.Limits(max_connections=concurrency + 4, **({} if keepalive else {"max_keepalive_connections": 0}))
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(request_timeout), limits=limits,
                                  headers=headers) as client:
        async def guarded(job):
            async with sem:
                try:
                    await send(client, job)
                except Exception as e:  # noqa: BLE001 - counted as an error
                    res["errors"].append(f"{type(e).__name__}: {e}")

        t0 = time.perf_counter()
        await asyncio.gather(*(guarded(j) for j in jobs))
        return time.perf_counter() - t0


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def server_model(url: str, headers: dict) -> tuple[str, str]:
    """(id, root) of the server's first model."""
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/models", headers=headers), timeout=30) as r:
        card = json.load(r)["data"][0]
    return card["id"], card.get("root") or card["id"]


def build_requests(args, tokenizer) -> list[SampleRequest]:
    if args.dataset_name == "random":
        if args.dataset_path:
            raise SystemExit("--dataset-path is for --dataset-name sharegpt; the random dataset needs no file")
        return random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.seed)
    if not args.dataset_path:
        raise SystemExit("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT-format JSON list)")
    return sharegpt_requests(tokenizer, args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed)


def request_body(args, model: str) -> dict:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos or args.dataset_name == "random":  # random: always run to the length (as vLLM does)
        body["ignore_eos"] = True
    if args.temperature is not None:
        body["temperature"] = args.temperature
    return body | (json.loads(args.extra_body) if args.extra_body else {})


def result_header(args, model: str, tokenizer_id: str) -> dict:
    """The run's settings under vLLM's result-file keys."""
    return {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": "openai",
            "backend": "openai", "label": args.label, "model_id": model, "tokenizer_id": tokenizer_id,
            "num_prompts": args.num_prompts,
            "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency}


def details(results: list[RequestResult]) -> dict:
    """The per-request lists vLLM writes with --save-detailed."""
    return {"input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "start_times": [r.start_time for r in results], "generated_texts": [r.generated_text for r in results],
            "errors": [r.error for r in results]}


async def benchmark(args, url: str, headers: dict) -> dict:
    """Runs the whole benchmark against url; returns the result (vLLM's keys)."""
    model, root = server_model(url, headers)
    tokenizer_id = args.tokenizer or (args.model if args.model and Path(args.model).is_dir() else root)
    tokenizer = load_tokenizer(tokenizer_id)
    requests = build_requests(args, tokenizer)
    arrivals = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed + 1)
    pick = random.Random(args.seed + 2)
    disconnects = [pick.randint(1, max(1, r.expected_output_len // 2)) if pick.random() < args.disconnect_fraction
                   else None for r in requests]
    body = request_body(args, args.served_model_name or model)
    if args.num_warmups:
        warm = SampleRequest(requests[0].prompt, requests[0].prompt_len, min(16, requests[0].expected_output_len))
        await run_load(url, headers, body, [warm] * args.num_warmups, [0.0] * args.num_warmups, None,
                       [None] * args.num_warmups, args.request_timeout, processes=1)
    results, duration, client_cpu = await run_load(url, headers, body, requests, arrivals, args.max_concurrency,
                                                   disconnects, args.request_timeout, args.client_processes)
    result = result_header(args, body["model"], tokenizer_id) | summarize(results, duration, args.percentiles)
    # a client process near one busy core timestamps chunks late: its ITL/TTFT figures then measure itself
    result["client_cpu_share"] = client_cpu / duration
    result["client_processes"] = args.client_processes
    result["disconnected"] = sum(r.disconnected for r in results)
    result["first_errors"] = [r.error for r in results if r.error][:5]
    if args.save_detailed:
        result |= details(results)
    return result


def metrics_totals(url: str, headers: dict) -> dict[str, float]:
    req = urllib.request.Request(url + "/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def check_idle(url: str, headers: dict, drain_timeout: float) -> str | None:
    """On a Kestrel server: waits until no request runs or waits and the KV pool is whole again; a message when
    that does not happen, None when it does or the server is not Kestrel (no kestrel_kv_blocks_* metrics)."""
    deadline = time.monotonic() + drain_timeout
    while True:
        m = metrics_totals(url, headers)
        if "kestrel_kv_blocks_total" not in m:
            print("idle check: skipped (not a Kestrel server: no kestrel_kv_blocks_* metrics)")
            return None
        running, waiting = m.get("vllm:num_requests_running", -1), m.get("vllm:num_requests_waiting", -1)
        free, total = m["kestrel_kv_blocks_free"], m["kestrel_kv_blocks_total"]
        if (running == 0 and waiting == 0 and free == total) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    print(f"after the run: running={running:.0f} waiting={waiting:.0f} kv_blocks_free={free:.0f}/{total:.0f}")
    if running or waiting:
        return f"engine still has {running:.0f} running / {waiting:.0f} waiting requests"
    if free != total:
        return f"KV pool not back to full: {free:.0f} of {total:.0f} blocks free"
    print("OK: engine idle, KV pool full")
    return None


async def run(args, url: str) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    result = await benchmark(args, url, headers)
    print("\n".join(table_lines(result, args.percentiles)))
    if result["disconnected"]:
        print(f"disconnected on purpose: {result['disconnected']}")
    print(f"client CPU: {result['client_cpu_share']:.0%} of one core over the run")
    if result["client_cpu_share"] > CLIENT_CPU_WARN:
        print("WARNING: the client was this busy: its timestamps lag, so its latencies overstate the server's")
    for e in result["first_errors"]:
        print("error:", e)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.result_file}")
    problem = await check_idle(url, headers, args.drain_timeout) if args.idle_check else None
    if problem:
        print(f"FAILED: {problem}")
        return 1
    if result["failed"]:
        print(f"FAILED: {result['failed']} request errors")
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kestrel bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--base-url", "--url", dest="base_url", default=None,
                   help="the server to load, e.g. http://127.0.0.1:8000 (default: start `kestrel serve`)")
    g.add_argument("--model", default=None, help="the model folder of the server this command starts (and the "
                   "tokenizer's default); requests name the server's first /v1/models entry")
    g.add_argument("--served-model-name", default=None, help="the model name to put in requests instead")
    g.add_argument("--tokenizer", default=None, help="tokenizer name or folder (default: --model, else the "
                   "`root` of the server's /v1/models entry)")
    g.add_argument("--server-args", default="", help="extra `kestrel serve` flags, e.g. '--num-kv-blocks 256'")
    g.add_argument("--server-log", default=None, help="file for the started server's log")
    g.add_argument("--api-key", default=os.environ.get("KESTREL_API_KEY"))
    g.add_argument("--startup-timeout", type=float, default=300.0)
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", "--num-requests", dest="num_prompts", type=int, default=1000)
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second on average; inf (default): all sent at time 0")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps between requests: 1 = Poisson process, < 1 burstier, > 1 more even")
    g.add_argument("--max-concurrency", "--concurrency", dest="max_concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no limit)")
    g.add_argument("--num-warmups", type=int, default=0, help="short requests sent (at once) before the timed run")
    g.add_argument("--client-processes", type=int, default=1,
                   help="spread the requests over this many client processes (round robin, the concurrency limit "
                   "split between them), for loads whose streamed chunks would keep one Python process busy")
    g.add_argument("--seed", type=int, default=0, help="seeds the prompts, lengths, arrival times and disconnects")
    g.add_argument("--disconnect-fraction", type=float, default=0.0,
                   help="share of clients that hang up mid-stream (counted apart; a Kestrel server must free them)")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=("random", "sharegpt"), default="random")
    g.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file")
    g.add_argument("--random-input-len", "--input-len", dest="random_input_len", type=int, default=1024)
    g.add_argument("--random-output-len", "--output-len", dest="random_output_len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L*(1-r), L*(1+r)]; 0: every request the same length")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length for sharegpt")
    g.add_argument("--ignore-eos", action="store_true", help="generate to max_tokens (always on for random)")
    g.add_argument("--temperature", type=float, default=None, help="sent when set (default: the server's)")
    g.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    g = p.add_argument_group("results")
    g.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated percentiles to report")
    g.add_argument("--result-file", default=None, help="write the result as JSON (vLLM's result-file keys)")
    g.add_argument("--save-detailed", action="store_true", help="add the per-request lists to the result file")
    g.add_argument("--label", default=None, help="a label stored in the result file")
    g.add_argument("--request-timeout", type=float, default=3600.0)
    g.add_argument("--no-idle-check", dest="idle_check", action="store_false",
                   help="skip the check (Kestrel servers only) that the engine is idle and its KV pool free after")
    g.add_argument("--drain-timeout", type=float, default=10.0)
    return p


def main(argv=None) -> int:
    import logging

    logging.getLogger("httpx2").setLevel(logging.WARNING)
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.percentiles = tuple(float(x) for x in args.metric_percentiles.split(","))
    except ValueError:
        p.error(f"--metric-percentiles: comma-separated numbers, got {args.metric_percentiles!r}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.client_processes < 1:
        p.error("--client-processes must be >= 1")
    proc = None
    url = args.base_url
    if url is None:
        proc, url = start_server(args)
    try:
        return asyncio.run(run(args, url.rstrip("/")))
    except (ValueError, OSError) as e:  # bad dataset/arrival arguments, an unreachable server, no tokenizer
        print(f"kestrel bench serve: {e}", file=sys.stderr)
        return 2
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
