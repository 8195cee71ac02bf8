"""A hung engine core is noticed. Server: the engine core stopped with SIGSTOP makes /health 503 ("unresponsive")
within 10 s and new requests 503; after --engine-hang-timeout it is killed and restarted, and the server serves
again. Unit (no processes, an explicit clock): the liveness rule of MPClient._check_engines, which tells silence
(no heartbeat) from a loop stuck on one step, and does not trip on a step shorter than the time-out.

The server speculates (n-gram drafts; issue 55 wants the hostile cases with speculation on and off): the core that
replaces the stopped one comes up speculating and serves. Without speculation: the watchdog's rule in the unit
tests below (it reads heartbeats, never the engine's features), and a core's restart over the server in
test_engine_death.py (test_kill_engine_core_during_stream_then_restart)."""
from __future__ import annotations

import json
import os
import signal
import time

import openai

from conftest import NGRAM_SPEC, Server, http
from kestrel.config import EngineConfig
from kestrel.ipc.core_client import HEALTH_STALE_S, WATCH_INTERVAL_S, MPClient


def test_stopped_engine_core_is_unhealthy_then_replaced(server_model, tmp_path):
    s = Server(server_model, tmp_path / "server.log",
               extra=["--engine-hang-timeout", "8", "--speculative-config", json.dumps(NGRAM_SPEC)]).wait_ready()
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        assert c.completions.create(model="llama", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        (pid,) = s.engine_pids()
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        while s.health()[0] == 200:
            assert time.monotonic() - t0 < 10, "/health still 200 10 s after the engine core stopped"
            time.sleep(0.2)
        status, body = s.health()
        if status == 503 and body["engines"][0]["state"] == "unresponsive":  # not replaced yet
            assert "not responding" in body["engines"][0]["error"]
            code, r = http("POST", s.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert code == 503 and "not responding" in r["error"]["message"]

        deadline = time.monotonic() + 120  # hang time-out, back-off and the engine's start-up on a loaded machine
        while s.health()[0] != 200:
            assert time.monotonic() < deadline, "the hung engine core was not replaced"
            time.sleep(0.3)
        (new_pid,) = s.engine_pids()
        assert new_pid != pid
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        # the new core speculates: a repetitive prompt and a greedy decode of 12 tokens give it drafts to verify
        assert c.completions.create(model="llama", prompt="a b a b a b a b", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True}).usage.completion_tokens == 12
        _, metrics = http("GET", s.url + "/metrics")
        assert sum(float(ln.split()[-1]) for ln in metrics.splitlines()
                   if ln.startswith("vllm:spec_decode_num_draft_tokens_total")) > 0
        assert "sent no heartbeat" in s.log_path.read_text()
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except (ProcessLookupError, UnboundLocalError):
            pass
        s.stop()


class FakeSupervisor:
    def __init__(self):
        self.replaced: list[tuple[int, str]] = []

    def replace(self, i, why):
        self.replaced.append((i, why))


def client(timeout: float = 30.0) -> tuple[MPClient, FakeSupervisor]:
    c = MPClient(EngineConfig.create(engine_hang_timeout=timeout), 2)
    c.sup = FakeSupervisor()
    return c, c.sup


def tick(c: MPClient, now: float) -> None:
    c._last_check = now - WATCH_INTERVAL_S  # the watch ran on time
    c._check_engines(now)


def test_silence_marks_stalled_then_replaces():
    c, sup = client()
    t = 1000.0
    c._last_seen = [t, t]
    c._progress = [(0, t), (0, t)]
    tick(c, t + HEALTH_STALE_S - 1)
    assert c.stalled == {} and c.live_engines == [0, 1]
    c._last_seen[1] = t + HEALTH_STALE_S  # engine 1 keeps beating; engine 0 is silent
    tick(c, t + HEALTH_STALE_S + 1)
    assert list(c.stalled) == [0] and c.live_engines == [1] and not c.is_dead
    assert c.engine_state(0) == "unresponsive" and "not responding" in str(c.stalled[0])
    c._last_seen[0] = t + HEALTH_STALE_S + 1  # it answers again (SIGCONT): back in service
    tick(c, t + HEALTH_STALE_S + 1.5)
    assert c.stalled == {} and sup.replaced == []
    c._last_seen[1] = t + 36
    tick(c, t + 37)  # engine 0 silent for 31 s > 30 s
    assert [i for i, _ in sup.replaced] == [0] and "no heartbeat for 31 s" in sup.replaced[0][1]


def test_a_long_step_is_not_a_hang_but_a_stuck_loop_is():
    c, sup = client(timeout=30.0)
    t = 1000.0
    c.request_engine = {"r0": 0}  # engine 0 has work; engine 1 is idle
    c._progress = [(5, t), (0, t)]
    for dt in range(1, 30):  # heartbeats keep coming, its step count stays at 5: a 29 s step
        c._last_seen = [t + dt, t + dt]
        tick(c, t + dt)
    assert sup.replaced == [] and c.stalled == {}
    c._last_seen = [t + 31, t + 31]
    tick(c, t + 31)
    assert sup.replaced == [(0, "finished no step and did no work for 31 s while it had requests "
                                "(--engine-hang-timeout)")]


def test_a_long_step_that_works_is_not_a_hang():
    """Issue 55: a 7,000-token prefill is one step of more than 30 s on the CPU; its heartbeats' work count (the
    runner's module forwards) moves, so it is not replaced. The same step with the work standing still is."""
    c, sup = client(timeout=30.0)
    t = 1000.0
    c.request_engine = {"r0": 0}
    c._progress = [((5, 100), t), ((0, 0), t)]
    for dt in range(1, 100):  # a 99 s step: no step finishes, the work moves every second
        c._last_seen = [t + dt, t + dt]
        c._on_heartbeat(0, 5, 100 + dt, t + dt)
        c._on_heartbeat(1, 0, 0, t + dt)
        tick(c, t + dt)
    assert sup.replaced == [] and c.stalled == {}
    for dt in range(100, 131):  # then stuck: heartbeats, no work
        c._last_seen = [t + dt, t + dt]
        c._on_heartbeat(0, 5, 199, t + dt)
        tick(c, t + dt)
    assert [i for i, _ in sup.replaced] == [0] and "did no work for 31 s" in sup.replaced[0][1]


def test_a_blocked_event_loop_is_not_taken_for_silent_engines():
    c, sup = client(timeout=30.0)
    t = 1000.0
    c._last_seen = [t, t]
    c._progress = [(0, t), (0, t)]
    c._last_check = t
    c._check_engines(t + 40)  # the watch itself ran 40 s late: the heartbeats wait unread in the socket
    assert sup.replaced == [] and c.stalled == {}
