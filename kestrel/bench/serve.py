"""Serving load benchmark: N streaming clients against an OpenAI-compatible server on loopback.

Random prompt and output lengths; a fraction of the clients disconnect mid-stream. Starts its own `kestrel serve`
unless --url is given. Prints requests/s and TTFT / ITL percentiles, then checks through /metrics that the engine
has no running request and that the KV pool is full again (the disconnected requests were aborted and freed).

  kestrel bench serve --model PATH --num-requests 64 --concurrency 16
  kestrel bench serve --url http://127.0.0.1:8000 --num-requests 32
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import time
import urllib.request

import httpx2

WORDS = ("the quick brown fox jumps over lazy dog hello world paris capital france kestrel serves models fast "
         "one gpu many cpu stop end add return").split()


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


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def latency_rows(res: dict) -> list[tuple[str, str]]:
    """Table rows of the TTFT, inter-token and end-to-end latency percentiles (res: seconds per kind)."""
    return [(f"{name} p50 / p90 / p99 (ms)", " / ".join(f"{pct(xs, p) * 1e3:.1f}" for p in (50, 90, 99)))
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


def parse_range(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition(":")
    return int(lo), int(hi or lo)


async def one_request(client: httpx2.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      disconnect_after: int | None, res: dict) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.8,
            "ignore_eos": True}
    t0 = time.perf_counter()
    last = None
    chunks = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            res["errors"].append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                res["errors"].append(obj["error"]["message"])
                return
            now = time.perf_counter()
            if not obj["choices"] or not (obj["choices"][0].get("text") or obj["choices"][0].get("finish_reason")):
                continue
            if last is None:
                res["ttft"].append(now - t0)
            else:
                res["itl"].append(now - last)
            last = now
            chunks += 1
            if disconnect_after is not None and chunks >= disconnect_after:
                res["disconnected"] += 1
                return  # leaving the context manager closes the connection mid-stream
    res["completed"] += 1
    res["latency"].append(time.perf_counter() - t0)


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


async def run(args, url: str) -> int:
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/models", headers=headers), timeout=10) as r:
        model = json.load(r)["data"][0]["id"]
    in_lo, in_hi = parse_range(args.input_len)
    out_lo, out_hi = parse_range(args.output_len)
    jobs = []
    for _ in range(args.num_requests):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(in_lo, in_hi)))
        mt = rng.randint(out_lo, out_hi)
        disc = rng.randint(1, max(1, mt // 2)) if rng.random() < args.disconnect_fraction else None
        jobs.append((prompt, mt, disc))
    res = {"ttft": [], "itl": [], "latency": [], "errors": [], "completed": 0, "disconnected": 0}
    elapsed = await run_clients(lambda client, job: one_request(client, url, model, *job, res), jobs, res,
                                args.concurrency, args.request_timeout, headers, keepalive=False)
    print(f"\nserve benchmark: {args.num_requests} requests, concurrency {args.concurrency}, "
          f"input {args.input_len} words, output {args.output_len} tokens, disconnect {args.disconnect_fraction:.0%}")
    rows = [("requests/s", f"{args.num_requests / elapsed:.2f}"),
            ("completed / disconnected / errors", f"{res['completed']} / {res['disconnected']} / {len(res['errors'])}"),
            ("output tokens/s (streamed chunks)", f"{(len(res['itl']) + len(res['ttft'])) / elapsed:.1f}"),
            ("wall time (s)", f"{elapsed:.2f}")] + latency_rows(res)
    w = max(len(r[0]) for r in rows)
    print("-" * (w + 24))
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print("-" * (w + 24))
    for e in res["errors"][:5]:
        print("error:", e)

    # the engine must be idle with the whole KV pool free again (disconnects aborted and freed)
    deadline = time.monotonic() + args.drain_timeout
    while True:
        m = metrics_totals(url, headers)
        running, waiting = m.get("vllm:num_requests_running", -1), m.get("vllm:num_requests_waiting", -1)
        free, total = m.get("kestrel_kv_blocks_free", -1), m.get("kestrel_kv_blocks_total", -2)
        if (running == 0 and waiting == 0 and free == total) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    print(f"after the run: running={running:.0f} waiting={waiting:.0f} kv_blocks_free={free:.0f}/{total:.0f}")
    assert running == 0 and waiting == 0, f"engine still has {running} running / {waiting} waiting requests"
    assert free == total, f"KV pool not back to full: {free} of {total} blocks free"
    if res["errors"]:
        print(f"FAILED: {len(res['errors'])} request errors")
        return 1
    print("OK: engine idle, KV pool full")
    return 0


def main(argv=None) -> int:
    import logging

    logging.getLogger("httpx2").setLevel(logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="server to load (default: start `kestrel serve` on a free port)")
    p.add_argument("--model", default=None, help="model for the server this script starts")
    p.add_argument("--server-args", default="", help="extra `kestrel serve` flags, e.g. '--num-kv-blocks 256'")
    p.add_argument("--server-log", default=None, help="file for the started server's log")
    p.add_argument("--api-key", default=os.environ.get("KESTREL_API_KEY"))
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", default="4:48", help="prompt length range in words, LO:HI")
    p.add_argument("--output-len", default="8:64", help="output length range in tokens, LO:HI")
    p.add_argument("--disconnect-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--drain-timeout", type=float, default=10.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        return asyncio.run(run(args, url.rstrip("/")))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
