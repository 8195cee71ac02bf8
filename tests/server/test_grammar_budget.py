"""Issue 33: output constraints are parsed off the event loop and within --grammar-parse-timeout. Before, one
41-byte schema stalled /health for 5.5 s and four of them every client for 43 s.

The budget server speculates (n-gram drafts; issue 55 wants the hostile cases with speculation on and off): a
constrained request is never drafted for, and the one that passes here runs beside speculation. The refusals
run on it and on the shared server without speculation; the budget's timing without speculation is the lanes'
own (tests/structured_output/test_compile_lanes.py: parses never reach the engine, where speculation lives)."""
from __future__ import annotations

import json
import threading
import time

import pytest

from conftest import NGRAM_SPEC, Server, http

C = "/v1/completions"
BUDGET = 0.5


def slow_schema(tag: str) -> dict:
    """Within the repeat limit, yet ~2 s for xgrammar to parse on this machine (12 patterns x ~0.15 s)."""
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string", "pattern": "(a|b){1000}"}
                                             for i in range(12)}}


@pytest.fixture(scope="module")
def budget_server(server_model, tmp_path_factory):
    s = Server(server_model, tmp_path_factory.mktemp("logs") / "grammar.log",
               ["--grammar-parse-timeout", str(BUDGET), "--speculative-config", json.dumps(NGRAM_SPEC)]).wait_ready()
    yield s
    s.stop()


@pytest.fixture(params=["ngram", "plain"])
def refusing_server(request):
    """The budget server (speculating), then the shared one (no speculation): the refusals need no budget."""
    return request.getfixturevalue("budget_server" if request.param == "ngram" else "server")


def test_a_huge_repeat_count_is_refused_at_once(refusing_server):
    t0 = time.monotonic()
    s, r = http("POST", refusing_server.url + C, {
        "prompt": "hi", "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "a{1000000}"}}}})
    assert s == 400 and r["error"]["param"] == "response_format" and "at most 1000" in r["error"]["message"]
    assert time.monotonic() - t0 < 1.0


@pytest.mark.serial  # health latency: make test runs it alone
def test_health_answers_while_hostile_schemas_parse(budget_server):
    results, latencies = [], []

    def hostile(i):
        results.append(http("POST", budget_server.url + C, {
            "prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": slow_schema(f"p{i}_")}}, timeout=60))

    clients = [threading.Thread(target=hostile, args=(i,)) for i in range(4)]
    for t in clients:
        t.start()
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        t0 = time.perf_counter()
        assert budget_server.health()[0] == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.02)
    for t in clients:
        t.join(60)
    # A parse on the event loop, or one holding the GIL, stalls health for ~2 s; a loaded 2-core CI machine alone
    # has been seen at 0.18 s for one answer, so the bar is on the median and a wide maximum.
    latencies.sort()
    assert len(latencies) > 20 and latencies[len(latencies) // 2] < 0.1 and latencies[-1] < 0.5, latencies[-5:]
    assert len(results) == 4
    for s, r in results:
        assert s == 400 and r["error"]["param"] == "structured_outputs", r
        assert f"within the {BUDGET:g} s budget (--grammar-parse-timeout)" in r["error"]["message"]
    # the same schema again: refused at once, from memory
    t0 = time.monotonic()
    s, r = http("POST", budget_server.url + C, {"prompt": "hi", "max_tokens": 2,
                                                "structured_outputs": {"json": slow_schema("p0_")}})
    assert s == 400 and "budget" in r["error"]["message"] and time.monotonic() - t0 < 0.3
    # and a plain structured request still works
    s, r = http("POST", budget_server.url + C, {"prompt": "hi", "max_tokens": 3, "temperature": 0,
                                                "structured_outputs": {"choice": ["yes", "no"]}})
    assert s == 200 and r["choices"][0]["text"] in ("yes", "no"), r


def test_remote_ref_and_tool_schema_limits(refusing_server):
    s, r = http("POST", refusing_server.url + C, {"prompt": "hi", "max_tokens": 2, "guided_json": json.dumps(
        {"type": "object", "properties": {"a": {"$ref": "http://169.254.169.254/latest/meta-data"}}})})
    assert s == 400 and r["error"]["param"] == "guided_json" and "points outside the schema" in r["error"]["message"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "z{99999}"}}}}}]
    s, r = http("POST", refusing_server.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools, "tool_choice": "required"})
    assert s == 400 and r["error"]["param"] == "tools" and "repeats 99999 times" in r["error"]["message"]
