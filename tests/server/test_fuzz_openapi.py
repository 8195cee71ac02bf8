"""Acceptance 2 of issues 17 and 33: schemathesis generates requests from the server's own OpenAPI schema (valid
and invalid ones, EXAMPLES per operation and mode) against the shared server, then the hostile cases of
test_bad_input.py run again: no response is a 5xx, every 4xx carries the OpenAI error body, and the engine core
is never restarted (its pid and its "ready" log lines stay the same)."""
from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from conftest import http
from test_bad_input import CASES

EXAMPLES = 10  # per operation and mode: ~120 requests a mode, well under a minute on two cores


def assert_openai_error(status: int, text: str, where) -> None:
    assert status < 500, (where, status, text[:1000])
    if status >= 400:
        body = json.loads(text)
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, (where, body)
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], (where, body)


def ready_lines(server) -> int:
    server.log.flush()
    return server.log_path.read_text().count("ready (pid")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_server_errors(server, mode):
    pids, ready = server.engine_pids(), ready_lines(server)
    status, _ = http("GET", server.url + "/openapi.json")
    assert status == 200  # the shared server has no key
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert any(op.path == "/v1/chat/completions" for op in operations)
    fuzzed, calls = 0, 0
    for op in operations:
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            nonlocal calls
            response = case.call(timeout=60)
            calls += 1
            assert_openai_error(response.status_code, response.text, (op.label, case.body, case.query))

        try:
            check()
            fuzzed += 1
        except Unsatisfiable:  # negative mode: an operation without inputs has nothing to get wrong
            assert mode is GenerationMode.NEGATIVE
    assert fuzzed >= 4 and calls >= 4 * EXAMPLES
    for case in CASES:
        _, path, body, *_ = case
        raw = body if isinstance(body, bytes) else None
        status, resp = http("POST", server.url + path, None if raw else body, raw=raw)
        assert_openai_error(status, json.dumps(resp) if isinstance(resp, dict) else resp, case[0])
    assert server.health()[0] == 200
    assert server.engine_pids() == pids and ready_lines(server) == ready, "an engine core was restarted"
