"""The periodic stats line that vLLM prints while it is busy, per engine core:

    Engine 000: Avg prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s, Running: N reqs,
    Waiting: M reqs, GPU KV cache usage: P%, Prefix cache hit rate: H%

Throughputs are the prompt tokens computed (prefix-cache hits excluded) and the tokens generated since the last
line; the hit rate is over every prefix-cache query since the engine started. An idle server logs it at DEBUG
only (a line with no throughput after one with none). Off with --disable-log-stats."""
from __future__ import annotations

import asyncio
import logging
import time

from kestrel.engine.messages import SchedulerStats

logger = logging.getLogger(__name__)


class StatsLog:
    def __init__(self, client, interval: float):
        """`client`: the engine-core client (its `stats` hold each engine's latest scheduler stats)."""
        self.client, self.interval = client, interval
        self._tokens: dict[int, list[int]] = {}  # engine -> [prompt, generation] tokens since the last line
        self._busy: dict[int, bool] = {}  # engine -> the last line had throughput
        self._since = time.monotonic()

    def on_step(self, engine: int, stats: SchedulerStats) -> None:
        t = self._tokens.setdefault(engine, [0, 0])
        t[0] += stats.step_prompt_tokens
        t[1] += stats.step_generation_tokens

    def lines(self, now: float | None = None) -> list[tuple[int, str]]:
        """(log level, line) per live engine, for the time since the last call (which starts a new interval)."""
        now = time.monotonic() if now is None else now
        span, self._since = max(now - self._since, 1e-9), now
        out = []
        for i, s in enumerate(self.client.stats):
            if s is None:
                continue
            prompt, gen = self._tokens.pop(i, (0, 0))
            busy = bool(prompt or gen)
            level = logging.INFO if busy or self._busy.get(i) else logging.DEBUG
            self._busy[i] = busy
            hit_rate = s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0
            out.append((level, f"Engine {i:03d}: Avg prompt throughput: {prompt / span:.1f} tokens/s, "
                               f"Avg generation throughput: {gen / span:.1f} tokens/s, Running: {s.num_running} "
                               f"reqs, Waiting: {s.num_waiting} reqs, GPU KV cache usage: {s.kv_usage * 100:.1f}%, "
                               f"Prefix cache hit rate: {hit_rate * 100:.1f}%"))
        return out

    async def run(self) -> None:
        self._since = time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            for level, line in self.lines():
                logger.log(level, line)
