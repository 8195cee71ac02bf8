"""Acceptance 4 (own server): killing the engine-core process during a stream fails the stream promptly and turns
/health into 503; the API key guards everything but /health (key from KESTREL_API_KEY)."""
from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from conftest import Server, http

KEY = "test-key-123"


@pytest.fixture(scope="module")
def lone_server(server_model, tmp_path_factory):
    s = Server(server_model, tmp_path_factory.mktemp("death") / "server.log", env={"KESTREL_API_KEY": KEY})
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


def test_kill_engine_core_during_stream(lone_server):
    c = openai.OpenAI(base_url=lone_server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    (pid,) = lone_server.engine_pids()
    stream = c.completions.create(model="llama", prompt="Hello", max_tokens=480, stream=True,
                                  extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    next(it)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as ei:
        for _ in it:
            pass
    elapsed = time.monotonic() - t0
    assert elapsed < 5, elapsed
    assert "engine core 0" in str(ei.value) and "died" in str(ei.value)
    deadline = time.monotonic() + 5
    while lone_server.health()[0] != 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    status, body = lone_server.health()
    assert status == 503 and body["error"]["type"] == "engine_dead"
    assert body["engines"] == [{"index": 0, "pid": pid, "alive": False, "error": body["engines"][0]["error"]}]
    s, r = http("POST", lone_server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                headers={"Authorization": f"Bearer {KEY}"})
    assert s == 503 and r["error"]["type"] == "engine_dead" and "engine core 0" in r["error"]["message"]
