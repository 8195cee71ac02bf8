"""Issue 33 item 2 with the default admission window: a request of 128 sequences is all inside the engine when a
victim arrives, so only the scheduler's fair share (--contended-seqs-per-request, engine/scheduler.py) keeps the
victim's steps small. The victim gets no 503 and its p99 latency stays within a loose bound of an idle server's;
the big request still finishes, every sequence with all its tokens.

On the CPU a step's time grows with its rows (tiny model: 1.6 ms at 1 row, 7.5 ms at 33, 22 ms at 128), so the
share here is 4, not the default 32, and the bound is loose: a victim still lands in one full-batch step when it
arrives (the share applies from the next step). Measured on a shared 2-core machine: p99 ratio 2.8-4.7 with the
share, 13 without it (--contended-seqs-per-request -1). The GPU measure is benchmarks/flood.py."""
from __future__ import annotations

import json
import statistics
import threading
import time

import pytest

from conftest import Server, http
from kestrel.bench.serve_metrics import percentile

C = "/v1/completions"
PROMPTS, N, FLOOD_TOKENS = 8, 16, 200  # 128 sequences: the default window (half of --max-num-seqs 256) takes all
SHARE, VICTIMS = 4, 20


def victim_latencies(url: str, count: int) -> list[float]:
    out = []
    for i in range(count):
        t0 = time.monotonic()
        s, r = http("POST", url + C, {"prompt": f"victim {i}", "max_tokens": 8, "ignore_eos": True}, timeout=60)
        assert s == 200, r
        assert r["usage"]["completion_tokens"] == 8
        out.append(time.monotonic() - t0)
    return out


def metric(url: str, name: str) -> float:
    _, text = http("GET", url + "/metrics")
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def running(url: str) -> float:
    return metric(url, "vllm:num_requests_running")


@pytest.fixture(scope="module")
def flood_server(server_model, tmp_path_factory):
    s = Server(server_model, tmp_path_factory.mktemp("flood") / "server.log", extra=["--num-kv-blocks", "2048", "--contended-seqs-per-request", str(SHARE)])
    yield s.wait_ready()
    s.stop()


def test_victims_of_a_request_inside_the_engine_keep_their_latency(flood_server):
    url = flood_server.url
    victim_latencies(url, 3)  # warm-up
    idle = victim_latencies(url, VICTIMS)

    result = {}

    def flood():
        body = {"prompt": [f"flood prompt {i}" for i in range(PROMPTS)], "n": N, "max_tokens": FLOOD_TOKENS,
                "ignore_eos": True}
        result["answer"] = http("POST", url + C, body, timeout=300)

    big = threading.Thread(target=flood)
    big.start()
    deadline = time.monotonic() + 30
    while running(url) < PROMPTS * N:  # all of it inside the engine before the first victim
        assert time.monotonic() < deadline, "the big request did not reach the engine"
        time.sleep(0.05)
    loaded = victim_latencies(url, VICTIMS)
    assert big.is_alive(), "the big request finished before the victims: make it longer"
    assert metric(url, "kestrel_fair_share_paused_steps_total") > 0
    big.join(300)
    status, answer = result["answer"]
    assert status == 200, answer
    assert len(answer["choices"]) == PROMPTS * N and answer["usage"]["completion_tokens"] == PROMPTS * N * FLOOD_TOKENS
    ratio = percentile(loaded, 99) / percentile(idle, 99)
    print(f"victim p99 idle {percentile(idle, 99):.3f} s, beside {PROMPTS * N} running sequences "
          f"{percentile(loaded, 99):.3f} s (ratio {ratio:.2f}); medians {statistics.median(idle):.3f} / "
          f"{statistics.median(loaded):.3f} s (ratio {statistics.median(loaded) / statistics.median(idle):.2f})")
    assert ratio < 8, (idle, loaded)
    assert metric(url, "vllm:num_preemptions_total") == 0  # slots and blocks were free: the excess only paused
