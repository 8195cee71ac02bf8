"""Request latency metrics: each running request's timing (arrival, first token, last token, first scheduling) and
the observations AsyncEngine hands a RequestMetricsSink from it (TTFT, inter-token latency, a finished request's
phases). The server's sink is kestrel/server/metrics.py."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from kestrel.engine.messages import EngineCoreOutputs, SchedulerStats
from kestrel.frontend.outputs import RequestOutput


@dataclass
class FinishedRequest:
    """A finished request's sizes and phases (seconds; None where the request never got that far): queued from
    its arrival to its first scheduling, prefill from then to its first token, decode from its first token to
    its end, inference from its first scheduling to its end."""
    e2e: float
    queued: float | None
    prefill: float | None
    decode: float | None
    inference: float | None
    prompt_tokens: int
    generation_tokens: int  # all its sequences
    max_generation_tokens: int  # its longest sequence
    n: int
    max_tokens: int | None  # the request's max_tokens parameter (None: not given)
    finish_reason: str | None


class RequestMetricsSink(Protocol):
    """Request latency hooks; ``engine`` is the index of the engine core that served the request."""

    def on_routed(self, engine: int) -> None: ...
    def on_frontend(self, stage: str, seconds: float) -> None: ...
    def on_first_token(self, engine: int, ttft_s: float) -> None: ...
    def on_tokens(self, engine: int, itl_s: float, count: int) -> None: ...
    def on_finished(self, engine: int, done: FinishedRequest) -> None: ...
    def on_step(self, engine: int, stats: SchedulerStats) -> None: ...


class RequestTiming:
    """One running request's clock readings (time.monotonic()) and the engine core it went to."""
    __slots__ = ("arrival", "first", "last", "engine", "scheduled", "n", "max_tokens")

    def __init__(self, n: int = 1, max_tokens: int | None = None):
        self.arrival = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.scheduled: float | None = None  # its first sequence's first scheduling (the engine's clock)
        self.engine = 0
        self.n, self.max_tokens = n, max_tokens


class RequestMetrics:
    """The timings of the running requests, by request id, and what they tell `sink` (None: no metrics; the
    timings are still kept, as they record which engine core a request went to)."""

    def __init__(self, sink: RequestMetricsSink | None):
        self.sink = sink
        self.timing: dict[str, RequestTiming] = {}

    def start(self, request_id: str, n: int, max_tokens: int | None) -> RequestTiming:
        timing = self.timing[request_id] = RequestTiming(n, max_tokens)
        return timing

    def end(self, request_id: str) -> None:
        self.timing.pop(request_id, None)

    def observe_engine(self, outs: EngineCoreOutputs, child_to_parent: dict[str, str]) -> None:
        """The step's token counts, and when the requests that got their first token were first scheduled."""
        if self.sink is None:
            return
        if outs.stats is not None and outs.stats.step_tokens:
            self.sink.on_step(outs.engine_index, outs.stats)
        for o in outs.outputs:
            if o.scheduled_at:
                t = self.timing.get(child_to_parent.get(o.request_id))
                if t is not None and (t.scheduled is None or o.scheduled_at < t.scheduled):
                    t.scheduled = o.scheduled_at

    def observe_progress(self, progress: list[tuple[str, int]], now: float) -> None:
        """`progress`: (request id, tokens gained) of each request this step moved (OutputProcessor.progress)."""
        if self.sink is not None:
            for request_id, new in progress:
                self._observe_tokens(request_id, new, now)

    def _observe_tokens(self, request_id: str, new: int, now: float) -> None:
        t = self.timing.get(request_id)
        if t is None:
            return
        if new:
            if t.first is None:
                t.first = now
                self.sink.on_first_token(t.engine, now - t.arrival)
                if new > 1:
                    self.sink.on_tokens(t.engine, 0.0, new - 1)
            else:
                self.sink.on_tokens(t.engine, (now - t.last) / new, new)
            t.last = now

    def observe_finished(self, ro: RequestOutput, now: float) -> None:
        t = self.timing.get(ro.request_id)
        if t is not None and self.sink is not None:
            reason = ro.outputs[0].finish_reason if ro.outputs else None
            lens = [len(c.token_ids) for c in ro.outputs]
            sched, first = t.scheduled, t.first
            self.sink.on_finished(t.engine, FinishedRequest(
                now - t.arrival, sched - t.arrival if sched else None,
                first - sched if sched and first else None, now - first if first else None,
                now - sched if sched else None, len(ro.prompt_token_ids), sum(lens), max(lens, default=0), t.n,
                t.max_tokens, reason))
