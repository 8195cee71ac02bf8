"""Pooling, an engine add-on: a pooling request's result (its pooled vector, from the runner's pooler) rides on its
one output (whose token is a placeholder)."""
from __future__ import annotations

from kestrel.core.engine_addon import EngineAddon
from kestrel.core.pooling import pooling_task


class Pooling(EngineAddon):
    name = "pooling"

    @classmethod
    def build(cls, core) -> "Pooling | None":
        m = core.config.model
        return cls() if pooling_task(core.model_config.architecture, m.runner, m.convert) is not None else None

    def outputs(self, outs: list, result) -> None:
        pooled = result.pooled
        if pooled:
            for o in outs:
                o.pooled = pooled.get(o.request_id)
