"""Acceptance 2 of issues 17, 33 and 55: schemathesis generates requests from the server's own OpenAPI schema (valid
and invalid ones, EXAMPLES per operation and mode) against the shared server and its twin with n-gram speculation
on, then the hostile cases of test_bad_input.py run again: no response is a 5xx (nor a stream's error event), every
4xx carries the OpenAI error body, nothing is logged as failed, and the engine core is never restarted (its pid and
its "ready" log lines stay the same, /health answers 200 after).

KESTREL_FUZZ_EXAMPLES=N runs N examples per operation and mode (default 10, about 120 requests a mode and server,
seconds on two cores); a few hundred is the long run (100: about 4 minutes for both servers on two cores).
KESTREL_FUZZ_SEED=S draws other examples than the default run's fixed ones (hypothesis's seed S)."""
from __future__ import annotations

import json
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from conftest import http
from test_bad_input import CASES

EXAMPLES = int(os.environ.get("KESTREL_FUZZ_EXAMPLES", "10"))
SEED = os.environ.get("KESTREL_FUZZ_SEED")


def error_problem(status: int, text: str) -> str | None:
    """What is wrong with a response: a 5xx, a 4xx without the OpenAI error body, a stream's 5xx error event."""
    if status >= 500:
        return f"status {status}"
    if status >= 400:
        try:
            body = json.loads(text)
        except ValueError:
            return f"status {status} with a body that is not JSON"
        if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)
                and set(body["error"]) == {"message", "type", "param", "code"}):
            return f"status {status} without the OpenAI error body"
        if not (isinstance(body["error"]["message"], str) and body["error"]["message"]):
            return f"status {status} with an empty error message"
        return None
    for line in text.splitlines():  # a stream that failed after it started ends with an error event
        if line.startswith("data: {") and '"error"' in line:
            err = json.loads(line[6:]).get("error")
            if isinstance(err, dict) and (not isinstance(err.get("code"), int) or err["code"] >= 500):
                return f"stream error event {err}"
    return None


def log_text(server) -> str:
    server.log.flush()
    return server.log_path.read_text()


def failures_logged(text: str) -> int:
    return text.count("Traceback") + text.count("stream failed") + text.count(" failed: ")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_server_errors(any_server, mode):
    server = any_server
    pids, before = server.engine_pids(), log_text(server)
    status, _ = http("GET", server.url + "/openapi.json")
    assert status == 200  # the shared servers have no key
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert any(op.path == "/v1/chat/completions" for op in operations)
    fuzzed, calls, problems = 0, 0, []
    for op in operations:
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=SEED is None, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            nonlocal calls
            response = case.call(timeout=60)
            calls += 1
            problem = error_problem(response.status_code, response.text)
            if problem:  # collected, not raised: every finding is reported, and hypothesis does not shrink
                problems.append((op.label, problem, case.body, case.query, case.path_parameters,
                                 response.text[:500]))

        if SEED is not None:
            check = seed(int(SEED))(check)
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
        problem = error_problem(status, json.dumps(resp) if isinstance(resp, dict) else resp)
        if problem:
            problems.append((case[0], problem, body))
    assert not problems, "\n".join(map(repr, problems))
    assert server.health()[0] == 200
    after = log_text(server)
    assert after.startswith(before)
    assert failures_logged(after[len(before):]) == 0, after[len(before):][-3000:]
    assert server.engine_pids() == pids and after.count("ready (pid") == before.count("ready (pid"), \
        "an engine core was restarted"
