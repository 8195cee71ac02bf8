"""Issue 17 on the shared server (default flags): no request can touch another's, admin endpoints are off, no
tracebacks or internals in error bodies, huge inputs neither stall the server nor pass the body limit, request
timeouts free the KV cache, prompt_logprobs as offline. Each runs with n-gram speculation off and on (any_server:
the shared server, then its twin; issue 55)."""
from __future__ import annotations

import asyncio
import threading
import time
from http.client import HTTPConnection

import openai
import pytest

from conftest import http
from kestrel.core.sampling_params import SamplingParams

C = "/v1/completions"


def metric(url: str, name: str) -> float:
    _, text = http("GET", url + "/metrics")
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + "{"))


async def test_client_request_id_never_addresses_another_request(any_server):
    """Two requests with the same client id run side by side, each with its own tokens (before: the second one
    was refused or took over the first one's stream); the id is only echoed."""
    c = openai.AsyncOpenAI(base_url=any_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    victim = await c.completions.create(model="llama", prompt="Hello", max_tokens=40, stream=True,
                                        extra_body={"ignore_eos": True, "request_id": "victim"})
    first = await victim.__anext__()
    attacker = c.completions.create(model="llama", prompt="The quick brown fox", max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True, "request_id": "victim"})
    a = await asyncio.wait_for(attacker, 30)
    assert a.id == "cmpl-victim" and a.usage.completion_tokens == 3
    rest = [ch async for ch in victim]
    assert first.id == "cmpl-victim" and rest[-1].choices[0].finish_reason == "length"
    assert len("".join(ch.choices[0].text for ch in [first, *rest])) > 0
    s, r = http("POST", any_server.url + C, {"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "from-header"})
    assert s == 200 and r["id"] == "cmpl-from-header"
    await c.close()


def test_admin_endpoints_off_by_default_and_health_shows_no_pids(any_server):
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("POST", "/reset_prefix_cache"),
                         ("GET", "/is_sleeping")):
        s, body = http(method, any_server.url + path)
        assert s == 404 and "--enable-admin-api" in body["error"]["message"], (path, body)
    s, body = any_server.health()
    assert s == 200 and "pid" not in str(body)


@pytest.mark.parametrize("body", [{"chat_template": "{{ messages }}"},
                                  {"chat_template_kwargs": {"chat_template": "{{ messages }}"}}])
def test_request_chat_template_refused_without_trust(any_server, body):
    s, r = http("POST", any_server.url + "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
    assert s == 400 and r["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in r["error"]["message"]


def test_huge_prompt_does_not_stall_other_clients(any_server):
    """A 5 MB prompt takes seconds to tokenize; it runs off the event loop, so /health answers meanwhile."""
    prompt = "Paris is the capital of France. " * 160_000  # 5.1 MB, about 7 s of tokenizing on this machine
    result = {}
    t = threading.Thread(target=lambda: result.update(r=http("POST", any_server.url + C, {"prompt": prompt,
                                                                                      "max_tokens": 1}, timeout=120)))
    t.start()
    time.sleep(0.5)
    worst = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert any_server.health()[0] == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.1)
    t.join()
    s, body = result["r"]
    assert s == 400 and body["error"]["code"] == "context_length_exceeded"
    assert worst < 2.5, worst  # before: the whole tokenizing time (about 7 s)


def test_request_body_limit(any_server):
    conn = HTTPConnection("127.0.0.1", any_server.port, timeout=30)  # refused by its Content-Length
    conn.putrequest("POST", C)
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(9 * 2**20))
    conn.endheaders(b'{"prompt": "')
    r = conn.getresponse()
    assert r.status == 413 and b"--max-request-body-bytes" in r.read()
    conn.close()
    # without a Content-Length (chunked), the limit holds while the body streams in
    conn = HTTPConnection("127.0.0.1", any_server.port, timeout=30)
    chunks = (b"a" * 2**20 for _ in range(10))
    conn.request("POST", C, body=chunks, headers={"Content-Type": "application/json"}, encode_chunked=True)
    assert conn.getresponse().status == 413
    conn.close()
    assert http("POST", any_server.url + C, {"prompt": "hi", "max_tokens": 1})[0] == 200


def test_request_timeout_aborts_and_frees_kv(any_server):
    s, r = http("POST", any_server.url + C, {"prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "timeout": 0.01})
    assert s == 200, r
    ch = r["choices"][0]
    assert (ch["finish_reason"], ch["stop_reason"]) == ("abort", "timeout")
    assert r["usage"]["completion_tokens"] < 480
    deadline = time.monotonic() + 10
    while metric(any_server.url, "kestrel_kv_blocks_free") != metric(any_server.url, "kestrel_kv_blocks_total"):
        assert time.monotonic() < deadline, "KV blocks of the timed-out request were not freed"
        time.sleep(0.1)
    assert metric(any_server.url, "vllm:num_requests_running") == 0


def test_prompt_logprobs_as_offline(any_server, offline_llm):
    s, r = http("POST", any_server.url + C, {"prompt": "The quick brown fox", "max_tokens": 1, "prompt_logprobs": 2})
    assert s == 200, r
    got = r["choices"][0]["prompt_logprobs"]
    ref = offline_llm.generate(["The quick brown fox"], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert got[0] is None and len(got) == len(ref.prompt_token_ids)
    for pos, (entry, want) in enumerate(zip(got[1:], ref.prompt_logprobs[1:]), start=1):
        tok = str(ref.prompt_token_ids[pos])
        assert entry[tok]["logprob"] == pytest.approx(want[int(tok)].logprob, abs=1e-4)
        assert {int(t) for t in entry} == set(want)


def test_internal_errors_do_not_echo_exception_text():
    """Any other exception in request handling: a 500 with the OpenAI error body and nothing of the exception."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kestrel.server.app import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("secret /internal/path and state")

    r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "internal_error" and "secret" not in r.text
