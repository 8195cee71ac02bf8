"""Faults (own server): SIGKILL of the engine core mid-stream fails the stream in < 2 s, /health is 503 while no
engine can serve, the server restarts the engine (--engine-restart-limit) and it serves a new request within its
start-up time, /health 200 again. With --tensor-parallel-size 2, SIGKILL of one worker fails the stream in < 5 s
naming the rank, the engine core and its workers are all gone, and the restarted engine serves with new workers.
The API key guards everything but /health (key from KESTREL_API_KEY, the documented fallback of --api-key)."""
from __future__ import annotations

import os
import re
import signal
import time

import openai
import pytest

from conftest import Server, http

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def lone_server(server_model, tmp_path_factory):
    s = Server(server_model, tmp_path_factory.mktemp("death") / "server.log", env={"KESTREL_API_KEY": KEY},
               extra=["--engine-restart-limit", "1"])
    yield s.wait_ready()
    s.stop()


def test_api_key_required(lone_server):
    s, body = http("POST", lone_server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert s == 401 and body["error"]["type"] == "authentication_error" and body["error"]["message"]
    s, _ = http("GET", lone_server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert s == 401
    assert lone_server.health()[0] == 200  # /health stays open
    c = openai.OpenAI(base_url=lone_server.url + "/v1", api_key=KEY, max_retries=0)
    assert c.completions.create(model="llama", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_kill_engine_core_during_stream_then_restart(lone_server):
    c = openai.OpenAI(base_url=lone_server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    (pid,) = lone_server.engine_pids()
    it = iter(c.completions.create(model="llama", prompt="Hello", max_tokens=480, stream=True,
                                   extra_body={"ignore_eos": True}))
    next(it)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as ei:
        for _ in it:
            pass
    assert time.monotonic() - t0 < 2.0
    assert "engine core 0" in str(ei.value) and "died" in str(ei.value)

    # while it restarts: 503 for /health and for requests, and no live-engine metrics
    status, body = lone_server.health()
    assert status == 503 and body["error"]["type"] == "engine_dead"
    assert body["engines"] == [{"index": 0, "state": "restarting", "error": body["engines"][0]["error"]}]
    s, r = http("POST", lone_server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers=AUTH)
    assert s == 503 and r["error"]["type"] == "engine_dead" and "restarting" in r["error"]["message"]
    _, text = http("GET", lone_server.url + "/metrics", headers=AUTH)
    assert 'kestrel_engine_alive{engine="0",model_name="llama"} 0.0' in text
    assert "vllm:num_requests_running{" not in text

    deadline = time.monotonic() + 120  # the engine's start-up time, with room for a loaded CI machine
    while lone_server.health()[0] != 200:
        assert time.monotonic() < deadline, "the engine core did not come back"
        time.sleep(0.2)
    assert lone_server.health()[1]["engines"] == [{"index": 0, "state": "ready"}]
    (new_pid,) = lone_server.engine_pids()
    assert new_pid != pid
    assert c.completions.create(model="llama", prompt="hi", max_tokens=3).usage.completion_tokens == 3

    # --engine-restart-limit 1: the second death is final
    os.kill(new_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while lone_server.health()[1]["engines"][0]["state"] != "dead":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1.5)  # longer than the first back-off: no restart was scheduled
    assert lone_server.health()[1]["engines"][0]["state"] == "dead"
    assert "stays down" in lone_server.log_path.read_text()


def worker_pids(server) -> dict[int, int]:
    """rank -> pid of the newest tensor-parallel workers, from their "worker rank R ready (pid P)" log lines."""
    server.log.flush()
    return {int(r): int(p) for r, p in re.findall(r"tensor-parallel worker rank (\d+) ready \(pid (\d+)\)",
                                                   server.log_path.read_text())}


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie is a process that has exited
    except (FileNotFoundError, ProcessLookupError):
        return True


def live_workers_of(server) -> list[int]:
    """Live worker processes (python -m kestrel.executor.worker --parent-pid P) of any engine core this server
    ever started, started or not when it died."""
    engines = set(re.findall(r"engine core \d+ ready \(pid (\d+)\)", server.log_path.read_text()))
    found = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except (OSError, ValueError):
            continue
        if "kestrel.executor.worker" in argv and "--parent-pid" in argv:
            if argv[argv.index("--parent-pid") + 1] in engines and not gone(int(d)):
                found.append(int(d))
    return found


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_kill_tp_worker_during_stream(server_model, tmp_path):
    s = Server(server_model, tmp_path / "server.log", extra=["--tensor-parallel-size", "2"])
    try:
        s.wait_ready()
        (engine_pid,) = s.engine_pids()
        workers = worker_pids(s)
        assert sorted(workers) == [0, 1] and sorted(live_workers_of(s)) == sorted(workers.values())
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=30)
        it = iter(c.completions.create(model="llama", prompt="Hello", max_tokens=480, stream=True,
                                       extra_body={"ignore_eos": True}))
        next(it)
        os.kill(workers[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(openai.APIError) as ei:
            for _ in it:
                pass
        assert time.monotonic() - t0 < 5.0
        assert "engine core 0 failed" in str(ei.value) and "rank 1" in str(ei.value), str(ei.value)
        # the process tree is cleaned up: the engine core reported, stopped rank 0 and exited
        wait_until(lambda: all(gone(p) for p in (engine_pid, *workers.values())), 10,
                   "the engine core or a worker outlived the failure")

        # the restart applies as for any engine death: a new engine core with new workers serves
        wait_until(lambda: s.health()[0] == 200, 120, "the engine core did not come back")
        new_workers = worker_pids(s)
        assert not set(new_workers.values()) & set(workers.values())
        assert c.completions.create(model="llama", prompt="hi", max_tokens=3).usage.completion_tokens == 3

        # a worker that dies while the engine is idle is reported within the engine's idle poll (1 s)
        os.kill(new_workers[0], signal.SIGKILL)
        wait_until(lambda: s.health()[0] == 503, 5, "an idle engine did not notice its dead worker")
        assert "rank 0" in s.health()[1]["engines"][0]["error"]
    finally:
        s.stop()
    wait_until(lambda: not live_workers_of(s), 10, "a tensor-parallel worker outlived the server")
