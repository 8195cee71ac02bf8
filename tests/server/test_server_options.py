"""`kestrel serve` options of issue 17 on one server: --enable-admin-api with an API key (from --api-key-file:
issue 33), --chat-template FILE, --trust-request-chat-template, --generation-config, --max-logprobs,
--default-max-tokens, --allowed-origins."""
from __future__ import annotations

import json

import pytest

from conftest import Server, http

KEY = "opts-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


@pytest.fixture(scope="module")
def opts_server(server_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("opts")
    (tmp / "template.jinja").write_text(TEMPLATE)
    gen = tmp / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"top_k": 1, "max_new_tokens": 3}))
    (tmp / "key").write_text(KEY + "\n")
    s = Server(server_model, tmp / "server.log", extra=[
        "--enable-admin-api", "--api-key-file", str(tmp / "key"), "--chat-template", str(tmp / "template.jinja"),
        "--trust-request-chat-template", "--generation-config", str(gen), "--max-logprobs", "30",
        "--default-max-tokens", "5", "--allowed-origins", "http://example.com"])
    yield s.wait_ready()
    s.stop()


def test_admin_api_needs_the_key(opts_server):
    u = opts_server.url
    assert http("POST", u + "/sleep")[0] == 401
    assert http("POST", u + "/sleep", headers=AUTH) == (200, {"ok": True})
    assert http("GET", u + "/is_sleeping", headers=AUTH) == (200, {"is_sleeping": True})
    assert http("POST", u + "/wake_up", headers=AUTH) == (200, {"ok": True})
    assert http("POST", u + "/reset_prefix_cache", headers=AUTH) == (200, {"ok": True})
    s, r = http("POST", u + "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers=AUTH)
    assert s == 200 and r["usage"]["completion_tokens"] == 2


def test_key_from_a_file_is_not_in_the_process_list_and_guards_the_docs(opts_server):
    """Issue 33: the key was only on the command line (visible in ps) and /docs, /openapi.json answered anyone."""
    import psutil

    assert not any(KEY in " ".join(p.cmdline()) for p in [psutil.Process(opts_server.proc.pid),
                                                          *psutil.Process(opts_server.proc.pid).children(True)])
    assert http("GET", opts_server.url + "/redoc")[0] == 404  # not served
    for path in ("/docs", "/openapi.json", "/v1/models"):
        s, r = http("GET", opts_server.url + path)
        assert s == 401 and r["error"]["code"] == "invalid_api_key", (path, r)
    s, schema = http("GET", opts_server.url + "/openapi.json", headers=AUTH)
    assert s == 200 and "/v1/chat/completions" in schema["paths"] and "/docs" not in schema["paths"]
    s, page = http("GET", opts_server.url + "/docs", headers=AUTH)
    assert s == 200 and "swagger-ui" in page and "/openapi.json" in page
    assert http("GET", opts_server.url + "/health")[0] == 200  # the probe stays open


@pytest.mark.serial  # health latency: make test runs it alone
def test_sleep_with_queued_requests_idles_the_engine(opts_server):
    """Issue 33: put to sleep with requests in it, the engine core spun, sending empty outputs as fast as it could
    (/health took 30 s). Now it idles, the server answers at once, and the requests finish after /wake_up. (A
    request that arrives while the server sleeps gets a 503 at once: test_data_parallel.)"""
    import threading
    import time

    import psutil

    u = opts_server.url
    results = []
    body = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True}
    clients = [threading.Thread(target=lambda: results.append(http("POST", u + "/v1/completions", body,
                                                                   headers=AUTH, timeout=120)))
               for _ in range(6)]
    for t in clients:
        t.start()
    time.sleep(0.2)  # in the engine
    assert http("POST", u + "/sleep", headers=AUTH) == (200, {"ok": True})
    core = psutil.Process(opts_server.engine_pids()[-1])
    core.cpu_percent()
    worst = 0.0
    for _ in range(20):
        t0 = time.perf_counter()
        opts_server.health()
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.05)
    assert core.cpu_percent() < 30 and worst < 0.1, worst  # spinning took a whole core
    assert not results  # nothing finished while asleep
    assert http("POST", u + "/wake_up", headers=AUTH) == (200, {"ok": True})
    for t in clients:
        t.join(120)
    assert [s for s, _ in results] == [200] * 6 and all(r["usage"]["completion_tokens"] == 400 for _, r in results)


def test_server_and_trusted_request_chat_templates(opts_server):
    u = opts_server.url
    msgs = [{"role": "user", "content": "hi"}, {"role": "user", "content": "there"}]
    s, r = http("POST", u + "/tokenize", {"messages": msgs}, headers=AUTH)
    assert s == 200
    assert http("POST", u + "/detokenize", {"tokens": r["tokens"]}, headers=AUTH)[1]["prompt"] == "<<hi>><<there>>"
    s, r = http("POST", u + "/tokenize", {"messages": msgs, "chat_template": "[{{ messages[1]['content'] }}]"},
                headers=AUTH)
    assert s == 200
    assert http("POST", u + "/detokenize", {"tokens": r["tokens"]}, headers=AUTH)[1]["prompt"] == "[there]"


def test_generation_config_and_default_max_tokens(opts_server):
    u = opts_server.url
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "ignore_eos": True}
    greedy = http("POST", u + "/v1/completions", {**body, "temperature": 0}, headers=AUTH)[1]["choices"][0]["text"]
    # top_k=1 from generation_config.json applies where the request is silent: sampling becomes greedy
    for seed in (1, 2):
        r = http("POST", u + "/v1/completions", {**body, "seed": seed}, headers=AUTH)[1]
        assert r["choices"][0]["text"] == greedy
    r = http("POST", u + "/v1/completions", {**body, "seed": 1, "top_k": 0, "temperature": 5.0}, headers=AUTH)[1]
    assert r["choices"][0]["text"] != greedy  # a request's own value wins
    # chat without max_tokens: min(--default-max-tokens 5, max_new_tokens 3)
    s, r = http("POST", u + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "ignore_eos": True}, headers=AUTH)
    assert s == 200 and r["usage"]["completion_tokens"] == 3


def test_max_logprobs(opts_server):
    u = opts_server.url
    s, r = http("POST", u + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                      "logprobs": True, "top_logprobs": 25}, headers=AUTH)
    assert s == 200 and len(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 25
    s, r = http("POST", u + "/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": 31}, headers=AUTH)
    assert s == 400 and r["error"]["param"] == "logprobs" and "30" in r["error"]["message"]


def test_cors_only_when_allowed(opts_server, server):
    pre = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
    import urllib.request

    def preflight(url):
        req = urllib.request.Request(url + "/v1/completions", method="OPTIONS", headers=pre)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.headers.get("access-control-allow-origin")
        except urllib.error.HTTPError as e:
            return e.headers.get("access-control-allow-origin")

    assert preflight(opts_server.url) == "http://example.com"
    assert preflight(server.url) is None  # off by default
