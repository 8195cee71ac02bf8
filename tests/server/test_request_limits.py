"""Issue 55: every request parameter that grows with the request has a documented limit (a 400 naming it), and
its per-item work runs off the event loop. Before, 32,000 bad_words stopped /health for 29 s (tokenized and
de-duplicated by a list scan on the event loop). Each runs with n-gram speculation off and on (any_server)."""
from __future__ import annotations

import threading
import time

import pytest

from conftest import http
from kestrel.core.sampling_params import MAX_BAD_WORDS, MAX_LOGIT_BIAS

C = "/v1/completions"


def health_latencies_while(server, work) -> list[float]:
    """/health round trips (seconds) while `work()` runs on a thread, and for at least a second."""
    done = threading.Event()

    def run():
        try:
            work()
        finally:
            done.set()

    t = threading.Thread(target=run)
    t.start()
    latencies = []
    end = time.monotonic() + 1.0
    while not done.is_set() or time.monotonic() < end:
        t0 = time.perf_counter()
        assert server.health()[0] == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.02)
    t.join(120)
    return sorted(latencies)


@pytest.mark.serial  # health latency: make test runs it alone
def test_health_answers_while_a_huge_bad_words_list_is_refused(any_server):
    results = []
    words = [f"w{i}x" for i in range(48_000)]
    lat = health_latencies_while(any_server, lambda: results.append(
        http("POST", any_server.url + C, {"prompt": "hi", "max_tokens": 2, "bad_words": words}, timeout=120)))
    (s, r), = results
    assert s == 400 and r["error"]["param"] == "bad_words", r
    assert f"at most {MAX_BAD_WORDS}" in r["error"]["message"]
    assert lat[len(lat) // 2] < 0.1 and lat[-1] < 0.5, lat[-5:]
    # the most words allowed: tokenized on a render thread, served
    words = words[:MAX_BAD_WORDS]
    results.clear()
    lat = health_latencies_while(any_server, lambda: results.append(
        http("POST", any_server.url + C, {"prompt": "hi", "max_tokens": 2, "bad_words": words}, timeout=120)))
    (s, r), = results
    assert s == 200 and r["usage"]["completion_tokens"] >= 1, r
    assert lat[len(lat) // 2] < 0.1 and lat[-1] < 0.5, lat[-5:]


def test_logit_bias_size_is_capped(any_server):
    s, r = http("POST", any_server.url + C, {"prompt": "hi", "max_tokens": 1,
                                         "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}})
    assert s == 400 and r["error"]["param"] == "logit_bias" and f"at most {MAX_LOGIT_BIAS}" in r["error"]["message"]


def test_bad_words_ids_in_order_without_repeats(tiny_tokenizer):
    from kestrel.frontend.processor import InputProcessor

    ip = InputProcessor(tiny_tokenizer, 512, 1000)
    out = ip.bad_words_token_ids(["hello", " hello", "world", "hello"])
    assert len(out) == len({tuple(x) for x in out})
    assert out[0] == tiny_tokenizer.encode("hello", add_special_tokens=False)


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_with_a_constraint_are_finite_json(any_server, route, stream):
    """Issue 55: a constrained (or banned) token's logprob is -inf: the whole answer was a 500 (-inf is not JSON)
    and a stream sent -Infinity. Now -9999.0, as vLLM sends it."""
    import json as _json
    import urllib.request

    body = {"max_tokens": 3, "temperature": 0, "stream": stream, "structured_outputs": {"choice": ["yes", "no"]}}
    if route == "chat":
        body.update(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=5)
    else:
        body.update(prompt="hi", logprobs=5)
    path = "/v1/chat/completions" if route == "chat" else C
    req = urllib.request.Request(any_server.url + path, _json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        text = r.read().decode()
    assert "Infinity" not in text and "NaN" not in text
    payloads = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ") and ln != "data: [DONE]"] \
        if stream else [text]
    values = []
    for p in payloads:
        d = _json.loads(p)
        for ch in d["choices"]:
            lp = ch.get("logprobs")
            if not lp:
                continue
            if route == "chat":
                values += [e["logprob"] for e in lp["content"]] + [t["logprob"] for e in lp["content"]
                                                                    for t in e["top_logprobs"]]
            else:
                values += [v for v in lp["token_logprobs"] if v is not None]
                values += [v for top in lp["top_logprobs"] if top for v in top.values()]
    assert values and min(values) == -9999.0, values


@pytest.mark.parametrize("path", ["/invocations", C, "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_post_bodies_must_be_json(any_server, path, kind):
    """Issue 55: /invocations ran a text/plain body, which a browser sends across origins without a CORS
    preflight. Every POST with a body must be JSON now (415 otherwise)."""
    import json as _json
    import urllib.error
    import urllib.request

    body = _json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    req = urllib.request.Request(any_server.url + path, body, {"Content-Type": kind}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    assert status == 415 and _json.loads(text)["error"]["type"] == "invalid_request_error", (status, text)


def test_allowed_token_ids_are_capped_at_the_vocabulary_size(any_server):
    """Issue 55 item 8: allowed_token_ids had no cap (2M ids x n 64 grew the engine by 2.4 GB)."""
    s, r = http("POST", any_server.url + C, {"prompt": "hi", "max_tokens": 1, "allowed_token_ids": [1] * 385})
    assert s == 400 and r["error"]["param"] == "allowed_token_ids", r
    assert "at most 384" in r["error"]["message"], r
    s, r = http("POST", any_server.url + C, {"prompt": "hi", "max_tokens": 2, "n": 3, "temperature": 1,
                                         "allowed_token_ids": [7, 7, 9] * 100})
    assert s == 200 and all(c["text"] is not None for c in r["choices"]), r
