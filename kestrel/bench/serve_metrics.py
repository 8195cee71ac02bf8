"""What `kestrel bench serve` reports, from per-request timings: the same keys and definitions as vLLM's
`vllm bench serve` result file, so that the two tools' JSON files compare key by key.

- TTFT: from sending the request to the first streamed chunk that carries text.
- ITL: the gaps between consecutive text chunks (every request's gaps pooled).
- TPOT: per request, (E2E - TTFT) / (output tokens - 1); requests of one output token have none.
- E2E: from sending the request to its last text chunk.
Percentiles interpolate linearly between the two nearest samples (numpy's default); an empty list reports 0,
as vLLM's does."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

METRICS = ("ttft", "tpot", "itl", "e2el")
TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
          "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestResult:
    """One request's outcome, times in seconds from its send (start_time: perf_counter at the send)."""
    prompt_len: int
    expected_output_len: int
    start_time: float = 0.0
    success: bool = False
    disconnected: bool = False  # the client closed it on purpose (--disconnect-fraction): neither success nor failure
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0  # usage.completion_tokens; 0 when the server sent no usage
    generated_text: str = ""
    error: str = ""


def percentile(xs: list[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation between closest ranks; 0.0 for no samples."""
    if not xs:
        return 0.0
    s = sorted(xs)
    pos = p / 100 * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def std(xs: list[float]) -> float:
    """Population standard deviation (numpy's default, ddof=0)."""
    if not xs:
        return 0.0
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def output_len(r: RequestResult) -> int:
    """Output tokens of a finished request: the server's usage count, else one per text chunk."""
    return r.output_tokens or (len(r.itl) + 1 if r.ttft else 0)


def metric_samples(results: list[RequestResult]) -> dict[str, list[float]]:
    """Seconds per metric over the successful requests."""
    ok = [r for r in results if r.success]
    tpots = [(r.latency - r.ttft) / (output_len(r) - 1) for r in ok if output_len(r) > 1]
    return {"ttft": [r.ttft for r in ok], "tpot": tpots, "itl": [x for r in ok for x in r.itl],
            "e2el": [r.latency for r in ok]}


def summarize(results: list[RequestResult], duration: float,
              percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> dict:
    """vLLM's result keys: counts, totals, throughputs, and mean/median/std/pNN of each metric in ms."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(output_len(r) for r in ok)
    out = {"duration": duration, "completed": len(ok),
           "failed": sum(1 for r in results if not r.success and not r.disconnected),
           "total_input_tokens": total_in, "total_output_tokens": total_out,
           "request_throughput": len(ok) / duration, "request_goodput": None,
           "output_throughput": total_out / duration, "total_token_throughput": (total_in + total_out) / duration,
           "max_concurrent_requests": peak_concurrency(ok)}
    for name, xs in metric_samples(results).items():
        out[f"mean_{name}_ms"] = mean(xs) * 1e3
        out[f"median_{name}_ms"] = percentile(xs, 50) * 1e3
        out[f"std_{name}_ms"] = std(xs) * 1e3
        for p in percentiles:
            out[f"p{percentile_word(p)}_{name}_ms"] = percentile(xs, p) * 1e3
    return out


def percentile_word(p: float) -> str:
    """99 -> '99', 99.9 -> '99.9' (the key spelling vLLM uses)."""
    return str(int(p)) if int(p) == p else str(p)


def peak_concurrency(results: list[RequestResult]) -> int:
    """The most requests in flight at one time, from their [start, start + latency) intervals."""
    events = sorted([(r.start_time, 1) for r in results] + [(r.start_time + r.latency, -1) for r in results])
    now = peak = 0
    for _, delta in events:  # at equal times the end (-1) sorts before the start (+1)
        now += delta
        peak = max(peak, now)
    return peak


def table_lines(summary: dict, percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> list[str]:
    """The result as the fixed-width table `vllm bench serve` prints."""
    def row(label: str, value) -> str:
        return f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}"

    lines = [" Serving Benchmark Result ".center(50, "="),
             row("Successful requests:", summary["completed"]), row("Failed requests:", summary["failed"])]
    if summary.get("max_concurrency") is not None:
        lines.append(row("Maximum request concurrency:", summary["max_concurrency"]))
    if summary.get("request_rate", "inf") != "inf":
        lines.append(row("Request rate configured (RPS):", float(summary["request_rate"])))
    lines += [row("Benchmark duration (s):", summary["duration"]),
              row("Total input tokens:", summary["total_input_tokens"]),
              row("Total generated tokens:", summary["total_output_tokens"]),
              row("Request throughput (req/s):", summary["request_throughput"]),
              row("Output token throughput (tok/s):", summary["output_throughput"]),
              row("Total token throughput (tok/s):", summary["total_token_throughput"]),
              row("Peak concurrent requests:", summary["max_concurrent_requests"])]
    for name in METRICS:
        label = name.upper()
        lines.append(f" {TITLES[name]} ".center(50, "-"))
        lines.append(row(f"Mean {label} (ms):", summary[f"mean_{name}_ms"]))
        lines.append(row(f"Median {label} (ms):", summary[f"median_{name}_ms"]))
        for p in percentiles:
            lines.append(row(f"P{percentile_word(p)} {label} (ms):", summary[f"p{percentile_word(p)}_{name}_ms"]))
    lines.append("=" * 50)
    return lines
