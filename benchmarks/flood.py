"""Issue 33 item 2 at full size on the GPU: one API request of 12,800 sequences (100 prompts x n=128) is in flight
while a victim sends short requests one after another. Reports the victim's latency on the idle server and under
the flood (p50, p99, worst), the ratio of the p99s, every non-200 answer the victim got, and how long the engine
takes to drop the flood's sequences after its client disconnects.

    python -m benchmarks.flood [--shape qwen3-0.6b] [--victims 40] [--shares 0,-1] [--json flood.json]

The server runs `kestrel serve --load-format dummy` on the shape with a trained byte-level BPE tokenizer
(benchmarks/structured.py) and its default --max-seqs-per-request (half of --max-num-seqs). One case per
(--windows, --shares) pair: --shares are --contended-seqs-per-request values (the engine's fair share: 0 is its
default, a quarter of the window; -1 turns it off); each row counts the steps in which the rule paused sequences
and the preemptions in the run."""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time
import urllib.error
import urllib.request
from http.client import HTTPConnection
from types import SimpleNamespace
from urllib.parse import urlparse

from benchmarks.common import SHAPES, print_table
from kestrel.bench.serve import metrics_totals, start_server
from kestrel.bench.serve_metrics import percentile

C = "/v1/completions"


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, float]:
    req = urllib.request.Request(url + C, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    except OSError:
        status = -1  # refused or timed out
    return status, time.perf_counter() - t0


def victim(url: str, count: int, max_tokens: int) -> tuple[list[float], list[int]]:
    latencies, bad = [], []
    for i in range(count):
        status, s = post(url, {"prompt": f"victim request number {i}: tell me a story", "max_tokens": max_tokens,
                               "ignore_eos": True})
        (latencies if status == 200 else bad).append(s if status == 200 else status)
    return latencies, bad


def in_engine(url: str, totals: dict[str, float] | None = None) -> float:
    totals = totals or metrics_totals(url, {})
    return totals.get("vllm:num_requests_running", 0.0) + totals.get("vllm:num_requests_waiting", 0.0)


def summary(name: str, xs: list[float]) -> dict:
    return dict(phase=name, requests=len(xs), p50_ms=round(1000 * statistics.median(xs), 1),
                p99_ms=round(1000 * percentile(xs, 99), 1), worst_ms=round(1000 * max(xs), 1))


def run_case(folder, window: int, share: int, args) -> dict:
    server_args = (f"--load-format dummy --max-seqs-per-request {window} --contended-seqs-per-request {share} "
                   f"{args.server_args}")
    proc, url = start_server(SimpleNamespace(model=str(folder), server_args=server_args,
                                             server_log=f"{args.server_log}.w{window}.s{share}", startup_timeout=300))
    print(f"started kestrel serve {folder} {shlex.join(shlex.split(server_args))} at {url}", flush=True)
    try:
        victim(url, 5, args.victim_tokens)  # warm-up
        idle, idle_bad = victim(url, args.victims, args.victim_tokens)

        # the flood: one non-streamed request on its own connection, dropped (client gone) after the victims
        host = urlparse(url)
        conn = HTTPConnection(host.hostname, host.port, timeout=600)
        body = json.dumps({"prompt": [f"flood prompt {i} about the sea" for i in range(args.prompts)], "n": args.n,
                           "max_tokens": args.flood_tokens, "ignore_eos": True})
        conn.request("POST", C, body, {"Content-Type": "application/json"})
        t_flood = time.monotonic()
        while in_engine(url) < 1 and time.monotonic() - t_flood < 30:
            time.sleep(0.05)
        busy_at_start = in_engine(url)
        tokens0, t0 = metrics_totals(url, {}).get("vllm:iteration_tokens_total_sum", 0.0), time.monotonic()
        loaded, loaded_bad = victim(url, args.victims, args.victim_tokens)
        after = metrics_totals(url, {})  # one scrape: the server is loaded
        tok_s = (after.get("vllm:iteration_tokens_total_sum", 0.0) - tokens0) / (time.monotonic() - t0)
        paused_steps = after.get("kestrel_fair_share_paused_steps_total", 0.0)
        preemptions = after.get("vllm:num_preemptions_total", 0.0)
        busy_at_end = in_engine(url, after)
        flood_done = conn.sock is None  # the response came back already: the flood was too small
        conn.sock.close() if conn.sock else None
        t_drop = time.monotonic()
        while in_engine(url) > 0 and time.monotonic() - t_drop < 60:
            time.sleep(0.1)
        drained_s = time.monotonic() - t_drop
        left = in_engine(url)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    i, f = summary("idle", idle), summary("flood", loaded)
    return dict(window=window or "default", share="off" if share < 0 else share or "default",
                idle_p50_ms=i["p50_ms"], idle_p99_ms=i["p99_ms"], flood_p50_ms=f["p50_ms"],
                flood_p99_ms=f["p99_ms"], p99_ratio=round(f["p99_ms"] / i["p99_ms"], 2),
                engine_tok_s_under_flood=round(tok_s), paused_steps=round(paused_steps),
                preemptions=round(preemptions), non_200=len(idle_bad) + len(loaded_bad),
                in_engine=f"{busy_at_start:.0f}..{busy_at_end:.0f}", left_after_drop=f"{left:.0f} in {drained_s:.1f} s",
                flood_finished_early=flood_done)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=[*SHAPES, "smoke"], help="smoke: a tiny CPU check")
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--n", type=int, default=128, help="sequences per prompt of the flood request")
    ap.add_argument("--flood-tokens", type=int, default=64, help="max_tokens of each flood sequence")
    ap.add_argument("--victims", type=int, default=200,
                    help="victim requests per phase (p99 of fewer than 100 is the worst one)")
    ap.add_argument("--victim-tokens", type=int, default=16)
    ap.add_argument("--windows", default="0", help="comma-separated --max-seqs-per-request values (0: default)")
    ap.add_argument("--shares", default="0", help="comma-separated --contended-seqs-per-request values (0: default, "
                                                  "a quarter of the window; -1: the engine's fair share off)")
    ap.add_argument("--server-args", default="", help="extra `kestrel serve` flags")
    ap.add_argument("--server-log", default="flood-server.log")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from benchmarks.structured import SMOKE_SHAPE, model_dir

    folder = model_dir(args.shape, (SHAPES.get(args.shape) or SMOKE_SHAPE)["vocab_size"])
    rows = [run_case(folder, int(w), int(sh), args) for w in args.windows.split(",") for sh in args.shares.split(",")]
    print_table(f"victim latency, {args.shape}: {args.victim_tokens}-token completions one at a time, idle and "
                f"under a flood of {args.prompts} prompts x n={args.n} = {args.prompts * args.n} sequences x "
                f"{args.flood_tokens} tokens (bar: p99 ratio <= 2.0, no non-200, nothing left after the drop)", rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    ok = all(r["flood_p99_ms"] <= 2.0 * r["idle_p99_ms"] and not r["non_200"] and r["left_after_drop"].startswith("0 ") for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
