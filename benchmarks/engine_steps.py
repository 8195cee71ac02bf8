"""Stepping an offline engine by hand, for benchmarks that time decode steps on their own: prefill every queued
request first, then time decode steps one by one (synchronised), so a figure never mixes the two kinds of step
nor depends on two prefills taking the same time."""
from __future__ import annotations

import time

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prefill_all(eng) -> tuple[float, int]:
    """Steps until no request waits or is still in its prefill: (seconds, steps)."""
    scheduler = eng.core.scheduler
    t, steps = time.perf_counter(), 0
    while scheduler.num_waiting or any(r.in_prefill for r in scheduler.running):
        eng.step()
        steps += 1
    sync()
    return time.perf_counter() - t, steps


def decode_ms_per_step(eng, steps: int, warm_up: int = 3) -> float:
    """Mean milliseconds of `steps` decode steps after `warm_up` untimed ones (every request must have room for
    warm_up + steps more tokens)."""
    for _ in range(warm_up):
        eng.step()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    return (time.perf_counter() - t) / steps * 1e3
