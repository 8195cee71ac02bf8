"""Issue 33 item 2: one request of many sequences must not make the engine unreachable for others. A prompt list
fanned out to many sequences (scaled down for the CPU) is in flight while a victim sends short requests: no 503,
and its worst latency stays within a bound of an idle server's; when the big client disconnects, every one of
its sequences leaves the engine (waiting + running back to 0).

The second case has the default admission window: the big request's 128 sequences are all inside the engine
when the victims come, so only the scheduler's fair share (--contended-seqs-per-request, engine/scheduler.py)
keeps the victim's steps small. On the CPU a step's time grows with its rows (tiny model: 1.6 ms at 1 row, 7.5
ms at 33, 22 ms at 128), so the share there is 4, not the default 32, and the bound is loose: a victim still
lands in one full-batch step when it arrives (the share applies from the next step). Measured on a shared
2-core machine: victims' p99 ratio 2.8-4.7 with the share, 13 without it (--contended-seqs-per-request -1). The
GPU measure is benchmarks/flood.py.

Both servers here speculate (n-gram drafts, issue 55 acceptance 2): the first test's 16 sequences and the
victims draft (at most 32 running: disable_by_batch_size), its disconnect aborts sequences with drafts in flight;
the second's 128 run past 32, so speculation switches off under the flood and on again for the victims. The
same behaviour without speculation: the window and its cancellation in tests/frontend/test_request_window.py,
the fair share in tests/engine/test_fair_share.py, the beam timeout in tests/frontend/test_beam_admission.py,
an abort freeing its KV over the server in test_hardening.py (test_request_timeout_aborts_and_frees_kv[plain])."""
from __future__ import annotations

import json
import statistics
import threading
import time
from http.client import HTTPConnection

import pytest

from conftest import NGRAM_SPEC, Server, http
from kestrel.bench.serve_metrics import percentile

pytestmark = pytest.mark.serial  # latency ratios: make test runs these alone

C = "/v1/completions"
PROMPTS, N = 20, 32  # 640 sequences
WINDOW = 16  # --max-seqs-per-request: small, so that on the CPU (where a step's time grows with the batch)
# the victim's steps cost about what they cost on an idle server; on a GPU the default (half of --max-num-seqs)


def metric(url: str, name: str) -> float:
    _, text = http("GET", url + "/metrics")
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def in_engine(url: str) -> float:
    return metric(url, "vllm:num_requests_running") + metric(url, "vllm:num_requests_waiting")


def victim_latencies(url: str, count: int, tokens: int = 4) -> list[float]:
    out = []
    for i in range(count):
        t0 = time.monotonic()
        s, r = http("POST", url + C, {"prompt": f"victim {i}", "max_tokens": tokens, "ignore_eos": True}, timeout=60)
        assert s == 200, r  # before the fix: 503 "engine core 0 is unreachable: Resource temporarily unavailable"
        assert r["usage"]["completion_tokens"] == tokens
        out.append(time.monotonic() - t0)
    return out


def serve(server_model, tmp_path_factory, *flags):
    """Both servers speculate (n-gram drafts: issue 55 wants the hostile cases with speculation on and off)."""
    s = Server(server_model, tmp_path_factory.mktemp("big") / "server.log",
               extra=["--num-kv-blocks", "2048", "--speculative-config", json.dumps(NGRAM_SPEC), *flags])
    yield s.wait_ready()
    s.stop()


@pytest.fixture(scope="module")
def big_server(server_model, tmp_path_factory):
    yield from serve(server_model, tmp_path_factory, "--max-seqs-per-request", str(WINDOW))


SHARE = 4  # --contended-seqs-per-request on the CPU (module docstring)
FLOOD_PROMPTS, FLOOD_N, FLOOD_TOKENS = 8, 16, 200  # 128 sequences: the default window (half of 256) takes them all


@pytest.fixture(scope="module")
def share_server(server_model, tmp_path_factory):
    yield from serve(server_model, tmp_path_factory, "--contended-seqs-per-request", str(SHARE))


def test_many_sequences_leave_others_served_and_go_when_the_client_does(big_server):
    url = big_server.url
    victim_latencies(url, 3)  # warm-up
    idle = victim_latencies(url, 10)

    conn = HTTPConnection("127.0.0.1", big_server.port, timeout=120)
    body = {"prompt": [f"big prompt {i}" for i in range(PROMPTS)], "n": N, "max_tokens": 400, "ignore_eos": True}
    conn.request("POST", C, body=json.dumps(body), headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while in_engine(url) < WINDOW:
        assert time.monotonic() < deadline, "the big request did not reach the engine"
        time.sleep(0.2)

    loaded = victim_latencies(url, 10)
    assert in_engine(url) <= WINDOW  # the rest of the 640 wait in the server
    print(f"victim latency idle: median {statistics.median(idle):.3f} s, worst {max(idle):.3f} s; "
          f"beside {PROMPTS * N} sequences: median {statistics.median(loaded):.3f} s, worst {max(loaded):.3f} s")
    assert max(loaded) < 2 * max(idle) + 0.5, (idle, loaded)
    assert metric(url, "vllm:spec_decode_num_draft_tokens_total") > 0  # the sequences speculate

    conn.sock.close()  # the big client goes away: all of its sequences are aborted
    conn.close()
    deadline = time.monotonic() + 20
    while in_engine(url) > 0:
        assert time.monotonic() < deadline, "the big request's sequences stayed in the engine"
        time.sleep(0.2)
    assert metric(url, "kestrel_kv_blocks_free") == metric(url, "kestrel_kv_blocks_total")


def test_victims_of_sequences_already_inside_the_engine_keep_their_latency(share_server):
    url = share_server.url
    victim_latencies(url, 3, 8)  # warm-up
    idle = victim_latencies(url, 20, 8)
    result = {}

    def flood():
        body = {"prompt": [f"flood prompt {i}" for i in range(FLOOD_PROMPTS)], "n": FLOOD_N,
                "max_tokens": FLOOD_TOKENS, "ignore_eos": True}
        result["answer"] = http("POST", url + C, body, timeout=300)

    big = threading.Thread(target=flood)
    big.start()
    deadline = time.monotonic() + 30
    while metric(url, "vllm:num_requests_running") < FLOOD_PROMPTS * FLOOD_N:  # all inside before the victims
        assert time.monotonic() < deadline, "the big request did not reach the engine"
        time.sleep(0.05)
    loaded = victim_latencies(url, 20, 8)
    assert big.is_alive(), "the big request finished before the victims: make it longer"
    assert metric(url, "kestrel_fair_share_paused_steps_total") > 0
    big.join(300)
    status, answer = result["answer"]
    assert status == 200, answer  # nothing lost: every sequence with all its tokens
    assert len(answer["choices"]) == FLOOD_PROMPTS * FLOOD_N
    assert answer["usage"]["completion_tokens"] == FLOOD_PROMPTS * FLOOD_N * FLOOD_TOKENS
    assert metric(url, "vllm:num_preemptions_total") == 0  # slots and blocks were free: the excess only paused
    ratio = percentile(loaded, 99) / percentile(idle, 99)
    print(f"victim p99 idle {percentile(idle, 99):.3f} s, beside {FLOOD_PROMPTS * FLOOD_N} sequences "
          f"{percentile(loaded, 99):.3f} s (ratio {ratio:.2f}); medians {statistics.median(idle):.3f} / "
          f"{statistics.median(loaded):.3f} s")
    assert ratio < 8, (idle, loaded)



def test_a_beam_search_honours_its_timeout(big_server):
    """Issue 55 item 6: a beam chat with `timeout` 1 ran 180 s. Now the timeout ends the search: its live beams so
    far come back as a timed-out request's do (abort, timeout), and its step requests leave the engine. (The
    window and the fair share: tests/frontend/test_beam_admission.py.)"""
    url = big_server.url
    for path, extra in ((C, {"prompt": "hi"}), ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                                         "content": "hi"}]})):
        t0 = time.monotonic()
        s, r = http("POST", url + path, {**extra, "n": 2, "max_tokens": 400, "ignore_eos": True,
                                         "use_beam_search": True, "timeout": 1}, timeout=120)
        took = time.monotonic() - t0
        assert s == 200, r
        assert [(c["finish_reason"], c["stop_reason"]) for c in r["choices"]] == [("abort", "timeout")] * 2, r
        assert took < 5, took
    deadline = time.monotonic() + 10
    while in_engine(url) > 0:
        assert time.monotonic() < deadline, "the beam search's step requests stayed in the engine"
        time.sleep(0.2)
