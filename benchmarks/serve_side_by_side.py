"""Online serving side by side (issue 32): `kestrel serve`, then `vllm serve`, on the same random-weight model
shape, each loaded by `kestrel bench serve` with the same seeded requests: one saturation run (every request at
once) and three Poisson request rates below it. Writes one JSON with every run, a markdown table with the
Kestrel / vLLM ratios, and a PNG of p99 TTFT vs request rate (matplotlib; without it the table says so and
--plot makes the PNG later from the JSON).

The model folder is the shape's config.json and a byte-level BPE trained here (benchmarks/structured.py), with
one added token per remaining model id, so that every token a random model samples streams as text. Requests are
random token-id prompts (--input-len, --output-len, --range-ratio) run to their length (ignore_eos): both servers
generate the same tokens. Rates: --rates, or by default the fractions --rate-fractions of the first server's
saturation request throughput (the same rates then go to the second server). Each rate run lasts about
--run-seconds. A run that would not finish within --budget-s (from the start of this command) is skipped and
listed, so the whole call stays inside one GPU call; vLLM's first start (torch.compile, graph capture) takes
90-230 s. vLLM 0.26 comes from shared/peers/vllm (installed into /tmp/site, on PYTHONPATH or --vllm-pythonpath).

    python -m benchmarks.serve_side_by_side --out gpu_out/serve              # llama-8b, both servers
    python -m benchmarks.serve_side_by_side --servers kestrel --rates 4,8,16  # Kestrel alone
    python -m benchmarks.serve_side_by_side --plot gpu_out/serve/serve_side_by_side.json docs/serve_ttft_p99.png
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.common import SHAPES, git_commit
from benchmarks.procs import start, stop
from kestrel.bench.serve import CLIENT_CPU_WARN, free_port

SERVERS = ("kestrel", "vllm")
TITLES = {"kestrel": "Kestrel", "vllm": "vLLM"}
# the columns of the markdown table: (result key, header)
COLUMNS = (("request_throughput", "req/s"), ("output_throughput", "out tok/s"), ("median_ttft_ms", "TTFT p50 ms"),
           ("p99_ttft_ms", "TTFT p99 ms"), ("median_itl_ms", "ITL p50 ms"), ("p99_itl_ms", "ITL p99 ms"),
           ("median_tpot_ms", "TPOT p50 ms"), ("median_e2el_ms", "E2E p50 ms"))
ACCEPTANCE_KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")  # issue 32, acceptance 4
RUN_TAIL_S = 15  # allowance per rate run beyond its arrival window: the last requests' own latency
SATURATION_S = 45  # allowance for the all-at-once run and its warm-ups


def server_argv(name: str, model: Path, port: int, args) -> list[str]:
    common = ["--load-format", "dummy", "--max-model-len", str(args.max_model_len), "--host", "127.0.0.1",
              "--port", str(port)]
    if name == "kestrel":
        return [sys.executable, "-m", "kestrel.cli", "serve", str(model), *common, *shlex.split(args.kestrel_args)]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--seed", "0",
            *common, *shlex.split(args.vllm_args)]


def server_env(name: str, args) -> dict[str, str]:
    env = dict(os.environ)
    if name == "vllm" and args.vllm_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.vllm_pythonpath, env.get("PYTHONPATH")) if p)
    return env


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> str | None:
    """None once url/health answers 200; otherwise why not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with code {proc.returncode} before it was ready"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return None
        except OSError:
            pass
        time.sleep(1)
    return f"not ready after {timeout:.0f} s"


def wait_gpu_released(timeout: float = 60) -> None:
    """After a server stops, until the GPU's memory is (nearly) free again, so the next one sizes its KV cache on
    the whole GPU; no-op without nvidia-smi."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            return
        if not out.strip() or max(int(x) for x in out.split()) < 2048:
            return
        time.sleep(1)


def bench_run(url: str, rate: float, num_prompts: int, args, result_file: Path, warmups: int) -> dict:
    """One `kestrel bench serve` run in this process; its result dict (vLLM's keys) plus its exit status."""
    from kestrel.bench.serve import main as bench_main

    argv = ["--base-url", url, "--num-prompts", str(num_prompts), "--request-rate", str(rate),
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--random-range-ratio", str(args.range_ratio), "--seed", str(args.seed), "--num-warmups", str(warmups),
            "--result-file", str(result_file), "--no-idle-check", "--client-processes", str(args.client_processes)]
    rc = bench_main(argv)
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    return result | {"exit_status": rc}


def rate_runs(rates: list[float], args) -> list[tuple[float, int]]:
    """(request rate, prompts) of each rate run: about --run-seconds of arrivals each."""
    return [(r, max(args.min_prompts, round(r * args.run_seconds))) for r in sorted(rates)]


def auto_rates(saturation: dict, fractions: list[float]) -> list[float]:
    x = saturation.get("request_throughput") or 0.0
    return sorted({max(0.1, round(f * x, 1)) for f in fractions})


def serve_and_measure(name: str, model: Path, args, rates: list[float] | None, t0: float, record: dict,
                      notes: list[str], save) -> list[float] | None:
    """Starts one server, runs the saturation run and the rate runs against it into record ("startup_s", "runs"),
    calling save() after each, and stops it. Returns the rates (on the first server, derived from its saturation
    run unless given)."""
    out = Path(args.out)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    left = args.budget_s - (time.monotonic() - t0)
    ready_timeout = min(args.startup_timeout, left - 60)
    if ready_timeout < 30:
        notes.append(f"{name}: not started, {left:.0f} s of the budget left")
        return rates
    print(f"\n=== {TITLES[name]}: starting ({shlex.join(server_argv(name, model, port, args))})", flush=True)
    t_start = time.monotonic()
    proc = start(server_argv(name, model, port, args), cwd=Path.cwd(), env=server_env(name, args),
                 output=out / f"{name}_serve.log")
    try:
        problem = wait_healthy(proc, url, ready_timeout)
        if problem:
            notes.append(f"{name}: server {problem} (log: {name}_serve.log)")
            return rates
        record["startup_s"] = time.monotonic() - t_start
        print(f"=== {TITLES[name]}: ready in {record['startup_s']:.0f} s", flush=True)

        def measure(rate: float, n: int, warmups: int) -> dict | None:
            need = (SATURATION_S if math.isinf(rate) else n / rate + RUN_TAIL_S)
            if time.monotonic() - t0 + need > args.budget_s:
                notes.append(f"{name}: rate {rate} ({n} prompts) skipped: over the {args.budget_s:.0f} s budget")
                return None
            print(f"\n--- {TITLES[name]}: request rate {rate}, {n} prompts", flush=True)
            label = "inf" if math.isinf(rate) else f"{rate:g}"
            res = bench_run(url, rate, n, args, out / f"{name}_rate_{label}.json", warmups) | {"server": name}
            record["runs"].append(res)
            save()
            return res

        saturation = measure(math.inf, args.saturation_prompts, args.warmups)
        if rates is None:  # the first server: rates from its saturation throughput
            rates = record["auto_rates"] = auto_rates(saturation, args.rate_fractions) if saturation else []
        for rate, n in rate_runs(rates, args):
            measure(rate, n, 0)
        return rates
    finally:
        stop(proc, grace_s=20)
        wait_gpu_released()


def fmt(x) -> str:
    return "-" if x is None else f"{x:,.0f}" if abs(x) >= 100 else f"{x:.2f}"


def run_key(run: dict) -> str:
    return str(run.get("request_rate"))


def markdown(result: dict) -> str:
    """The table: per load, each server's row and the Kestrel / vLLM ratio row; then acceptance 4's verdicts."""
    by = {s: {run_key(r): r for r in result["servers"].get(s, {}).get("runs", [])} for s in SERVERS}
    loads = sorted({k for runs in by.values() for k in runs}, key=lambda k: math.inf if k == "inf" else float(k))
    head = "| request rate | server | " + " | ".join(h for _, h in COLUMNS) + " |"
    lines = [f"{result['shape']}, random-weight bf16, input {result['input_len']} (range ratio {result['range_ratio']}),"
             f" output {result['output_len']} tokens, ignore_eos; commit {result['commit']}", "", head,
             "|" + "---|" * (len(COLUMNS) + 2)]
    verdicts = []
    for load in loads:
        label = "saturation (all at once)" if load == "inf" else f"{float(load):g} req/s"
        for s in SERVERS:
            if load in by[s]:
                lines.append(f"| {label} | {TITLES[s]} | " + " | ".join(fmt(by[s][load].get(k)) for k, _ in COLUMNS)
                             + " |")
        if load in by["kestrel"] and load in by["vllm"]:
            k, v = by["kestrel"][load], by["vllm"][load]
            ratios = [k[key] / v[key] if v.get(key) else None for key, _ in COLUMNS]
            lines.append(f"| {label} | Kestrel / vLLM | " + " | ".join("-" if r is None else f"{r:.2f}x"
                                                                        for r in ratios) + " |")
            if load == "inf":
                ok = k["request_throughput"] >= v["request_throughput"]
                verdicts.append(f"- saturation throughput at least vLLM's: {'yes' if ok else 'no'} "
                                f"({k['request_throughput']:.2f} vs {v['request_throughput']:.2f} req/s)")
            else:
                worse = [key for key in ACCEPTANCE_KEYS if k[key] > v[key]]
                verdicts.append(f"- {label}: TTFT and ITL p50/p99 at or below vLLM's: "
                                + ("yes" if not worse else "no (" + ", ".join(worse) + ")"))
    busy = [f"{TITLES[r['server']]} at {r['request_rate']}" for rec in result["servers"].values() for r in rec["runs"]
            if r.get("client_cpu_share", 0) > CLIENT_CPU_WARN]
    if busy:
        verdicts.append(f"- the client used over {CLIENT_CPU_WARN:.0%} of a core in: {', '.join(busy)} "
                        "(its timestamps lag there; latencies overstated)")
    lines += ["", "Lower is better for the latencies, higher for req/s and tok/s.", "", *verdicts]
    if result["notes"]:
        lines += ["", "Notes:", *(f"- {n}" for n in result["notes"])]
    return "\n".join(lines) + "\n"


def plot(result: dict, png: Path) -> str:
    """p99 TTFT vs request rate per server (the saturation run at its achieved rate, hollow); a line saying what
    was written or why not."""
    try:
        import matplotlib
    except ImportError:
        return (f"no PNG: matplotlib is not installed here (python -m benchmarks.serve_side_by_side --plot JSON "
                f"{png.name} where it is)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for s in SERVERS:
        runs = result["servers"].get(s, {}).get("runs", [])
        rated = sorted((float(r["request_rate"]), r["p99_ttft_ms"]) for r in runs if r.get("request_rate") != "inf"
                       and "p99_ttft_ms" in r)
        if not rated:
            continue
        line, = ax.plot(*zip(*rated), marker="o", label=TITLES[s])
        for r in runs:
            if r.get("request_rate") == "inf" and "p99_ttft_ms" in r:
                ax.plot([r["request_throughput"]], [r["p99_ttft_ms"]], marker="o", markerfacecolor="none",
                        color=line.get_color(), linestyle="none", label=f"{TITLES[s]} saturation (achieved req/s)")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (req/s, Poisson arrivals)")
    ax.set_ylabel("p99 time to first token (ms)")
    ax.set_title(f"{result['shape']} on one GPU: p99 TTFT vs request rate")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return f"wrote {png}"


def write_outputs(result: dict, out: Path, final: bool) -> None:
    """The JSON and the table (after each server, so that a later failure keeps what was measured); at the end
    also the PNG, and the table printed."""
    (out / "serve_side_by_side.json").write_text(json.dumps(result, indent=1))
    (out / "serve_side_by_side.md").write_text(markdown(result))
    if final:
        print("\n" + markdown(result))
        print(plot(result, out / "serve_ttft_p99.png"))


def parse_floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-8b", choices=[*SHAPES, "smoke"], help="smoke: a tiny CPU check")
    ap.add_argument("--servers", default="kestrel,vllm", help="which servers, in this order (kestrel, vllm)")
    ap.add_argument("--out", default="gpu_out/serve", help="folder for the JSON, table, PNG and server logs")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform in [L*(1-r), L*(1+r)]")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--saturation-prompts", type=int, default=400, help="prompts of the all-at-once run")
    ap.add_argument("--rates", type=parse_floats, default=None, help="request rates, e.g. 5,10,20 (default: auto)")
    ap.add_argument("--rate-fractions", type=parse_floats, default=[0.25, 0.5, 0.75],
                    help="auto rates: these fractions of the first server's saturation req/s")
    ap.add_argument("--run-seconds", type=float, default=15, help="arrival window of each rate run")
    ap.add_argument("--min-prompts", type=int, default=50, help="fewest prompts of a rate run")
    ap.add_argument("--warmups", type=int, default=16, help="warm-up requests before each server's first run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client-processes", type=int, default=4, help="client processes of each run (a saturation run "
                    "streams thousands of chunks a second: one Python process would lag)")
    ap.add_argument("--budget-s", type=float, default=500, help="seconds from the start: a run that would end "
                    "later is skipped (the whole call then stays under 9 minutes)")
    ap.add_argument("--startup-timeout", type=float, default=300, help="most seconds a server may take to start")
    ap.add_argument("--tokenizer-vocab", type=int, default=None, help="BPE size to train (default: the model's)")
    ap.add_argument("--kestrel-args", default="", help="extra `kestrel serve` flags")
    ap.add_argument("--vllm-args", default="", help="extra vLLM server flags")
    ap.add_argument("--vllm-pythonpath", default=None, help="put first on the vLLM server's PYTHONPATH")
    ap.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"), help="only draw the PNG from a result JSON")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(json.loads(Path(args.plot[0]).read_text()), Path(args.plot[1])))
        return 0
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not servers or set(servers) - set(SERVERS):
        ap.error(f"--servers: a comma list of {', '.join(SERVERS)}, got {args.servers!r}")

    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks.structured import SMOKE_SHAPE, model_dir

    vocab = (SHAPES.get(args.shape) or SMOKE_SHAPE)["vocab_size"]
    model = model_dir(args.shape, args.tokenizer_vocab or min(vocab, 3000 if args.shape == "smoke" else vocab),
                      fill_vocab=True)
    print(f"model folder {model} ready after {time.monotonic() - t0:.0f} s", flush=True)
    result = {"shape": args.shape, "commit": git_commit(), "input_len": args.input_len, "output_len": args.output_len,
              "range_ratio": args.range_ratio, "max_model_len": args.max_model_len, "seed": args.seed,
              "kestrel_args": args.kestrel_args, "vllm_args": args.vllm_args, "servers": {}, "notes": []}
    rates = args.rates
    for name in servers:
        record = result["servers"][name] = {"runs": []}
        rates = serve_and_measure(name, model, args, rates, t0, record, result["notes"],
                                  lambda: write_outputs(result, out, final=False))
    result["rates"] = rates
    result["total_s"] = time.monotonic() - t0
    write_outputs(result, out, final=True)
    print(f"total {result['total_s']:.0f} s")
    failed = [f"{r['server']} rate {r.get('request_rate')}" for rec in result["servers"].values()
              for r in rec["runs"] if r.get("exit_status") or r.get("failed")]
    if failed or result["notes"]:
        print("incomplete: " + "; ".join(failed + result["notes"]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
