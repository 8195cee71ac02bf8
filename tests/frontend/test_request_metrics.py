"""RequestMetrics turns a request's clock readings into the sink's observations: TTFT from arrival to the first
token, inter-token latency spread over the tokens of a step, and a finished request's phases measured from its
first scheduling (the engine's clock reading of its earliest-scheduled sequence)."""
from __future__ import annotations

import pytest

from kestrel.engine.messages import EngineCoreOutput, EngineCoreOutputs
from kestrel.frontend.outputs import CompletionOutput, RequestOutput
from kestrel.frontend.request_metrics import RequestMetrics


class RecordingSink:
    def __init__(self):
        self.calls = []

    def on_routed(self, engine):
        self.calls.append(("routed", engine))

    def on_frontend(self, stage, seconds):
        self.calls.append(("frontend", stage, seconds))

    def on_first_token(self, engine, ttft_s):
        self.calls.append(("first", engine, ttft_s))

    def on_tokens(self, engine, itl_s, count):
        self.calls.append(("tokens", engine, itl_s, count))

    def on_finished(self, engine, done):
        self.calls.append(("finished", engine, done))

    def on_step(self, engine, stats):
        self.calls.append(("step", engine, stats))


def test_ttft_itl_and_finished_phases():
    sink = RecordingSink()
    metrics = RequestMetrics(sink)
    t = metrics.start("r", n=2, max_tokens=8)
    t.arrival, t.engine = 100.0, 1
    children = {"r#0": "r", "r#1": "r"}
    metrics.observe_engine(EngineCoreOutputs(1, [EngineCoreOutput("r#0", [5], scheduled_at=100.5),
                                                 EngineCoreOutput("r#1", [6], scheduled_at=100.25)]), children)
    assert t.scheduled == 100.25  # the earliest of its sequences
    metrics.observe_progress([("r", 3)], now=101.0)  # first step: 3 tokens (two sequences, one of them 2)
    metrics.observe_progress([("r", 2)], now=101.5)
    metrics.observe_progress([("other", 4)], now=101.6)  # not a running request here: nothing
    out = RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, token_ids=[5, 7, 9], finish_reason="length"),
                                               CompletionOutput(1, token_ids=[6, 8], finish_reason="stop")], True)
    metrics.observe_finished(out, now=102.0)
    (_, _, done), = [c for c in sink.calls if c[0] == "finished"]
    assert sink.calls[:3] == [("first", 1, 1.0), ("tokens", 1, 0.0, 2), ("tokens", 1, 0.25, 2)]
    assert (done.e2e, done.queued, done.prefill, done.decode, done.inference) == pytest.approx(
        (2.0, 0.25, 0.75, 1.0, 1.75))
    assert (done.prompt_tokens, done.generation_tokens, done.max_generation_tokens, done.n, done.max_tokens,
            done.finish_reason) == (3, 5, 3, 2, 8, "length")
    metrics.end("r")
    assert metrics.timing == {}


def test_without_a_sink_timings_are_kept_and_nothing_is_observed():
    metrics = RequestMetrics(None)
    t = metrics.start("r", n=1, max_tokens=None)
    metrics.observe_engine(EngineCoreOutputs(0, [EngineCoreOutput("r", [5], scheduled_at=1.0)]), {"r": "r"})
    metrics.observe_progress([("r", 1)], now=2.0)
    metrics.observe_finished(RequestOutput("r", None, [1], [CompletionOutput(0, token_ids=[5])], True), now=3.0)
    assert metrics.timing == {"r": t} and t.scheduled is None and t.first is None
