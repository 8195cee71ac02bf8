"""Issue 55 item 5: the grammar lanes' budget counts from submission (once MAX_OVERDUE runaways held their
threads, twelve salted slow schemas left new parses queued without any timer), and queued parses start a client
at a time in turn."""
from __future__ import annotations

import threading
import time

import pytest

from kestrel.structured_output.compile_lanes import CompileLanes, CompileTimeout


def test_a_queued_compile_fails_at_its_budget_while_runaways_hold_the_lanes():
    lanes = CompileLanes(0.3, lanes=1, max_overdue=1)
    release = threading.Event()
    try:
        runaway = lanes.submit(release.wait)  # overdue after 0.3 s; then the one overdue slot is full
        with pytest.raises(CompileTimeout):
            runaway.result(timeout=5)
        t0 = time.monotonic()
        queued = lanes.submit(lambda: "parsed")
        with pytest.raises(CompileTimeout, match="0.3 s budget"):
            queued.result(timeout=5)  # before: waited for the runaway to end (here: forever)
        assert time.monotonic() - t0 < 2
        release.set()
        assert lanes.submit(lambda: "parsed").result(timeout=5) == "parsed"  # the lane is free again
    finally:
        release.set()
        lanes.shutdown()


def test_queued_compiles_start_a_client_at_a_time():
    lanes = CompileLanes(10, lanes=1)
    gate, order = threading.Event(), []

    def job(name):
        order.append(name)
        return name

    try:
        first = lanes.submit(gate.wait, client="flood")
        flood = [lanes.submit(job, f"flood{i}", client="flood") for i in range(3)]
        other = lanes.submit(job, "other", client="other")
        gate.set()
        assert first.result(timeout=5) is True
        assert other.result(timeout=5) == "other" and [f.result(timeout=5) for f in flood]
        assert order.index("other") == 1, order  # before: behind the whole flood
    finally:
        gate.set()
        lanes.shutdown()
