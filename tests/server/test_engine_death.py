"""Faults (own server): SIGKILL of the engine core mid-stream fails the stream in < 2 s, /health is 503 while no
engine can serve, the server restarts the engine (--engine-restart-limit) and it serves a new request within its
start-up time, /health 200 again. The API key guards everything but /health (key from KESTREL_API_KEY, the
documented fallback of --api-key)."""
from __future__ import annotations

import os
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
