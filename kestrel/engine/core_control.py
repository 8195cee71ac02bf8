"""The engine core's own utility methods, callable over the wire by name (CORE_UTILITY_METHODS;
ipc/core_proc.run_utility): stats, the prefix cache, sleep and pause (stop stepping; asleep, the prefix cache is
dropped too), health. EngineCore (core.py) takes them from here; its add-ons add theirs."""
from __future__ import annotations

CORE_UTILITY_METHODS = frozenset({"get_stats", "reset_prefix_cache", "sleep", "wake_up", "is_sleeping", "pause",
                                  "resume", "is_paused", "ping"})


class CoreControl:
    """Reads the core's stats(), kv, executor and its _sleeping / _paused flags (step() honours them)."""

    def get_stats(self) -> dict:
        return self.stats().as_dict()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def sleep(self, level: int = 1) -> bool:
        """Stop stepping and drop the prefix cache (weights stay; a GPU build could offload them here)."""
        self._sleeping = True
        return self.kv.reset_prefix_cache() or True

    def wake_up(self) -> bool:
        self._sleeping = False
        return True

    def is_sleeping(self) -> bool:
        return self._sleeping

    def pause(self) -> bool:
        self._paused = True
        return True

    def resume(self) -> bool:
        self._paused = False
        return True

    def is_paused(self) -> bool:
        return self._paused

    def ping(self) -> str:
        self.executor.check_health()
        return "pong"
