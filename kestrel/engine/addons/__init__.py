"""Engine add-ons: the engine core's parts of features (kestrel/core/engine_addon.py has the interface). A new
engine-side feature is one file and one line of ENGINE_ADDONS; EngineCore calls the hooks in this order."""
from __future__ import annotations

from kestrel.core.engine_addon import HOOKS, EngineAddon, overriding
from kestrel.engine.addons.allowed_ids import SharedAllowedIds
from kestrel.engine.addons.grammars import Grammars
from kestrel.engine.addons.kv_offload import KVOffload
from kestrel.engine.addons.lora import LoRAControl
from kestrel.engine.addons.pooling import Pooling
from kestrel.spec_decode.speculation import Speculation

ENGINE_ADDONS: list[type[EngineAddon]] = [
    SharedAllowedIds,
    LoRAControl,
    Grammars,
    Speculation,
    Pooling,
    KVOffload,
]


def check_config(config) -> None:
    """Before the model loads: each add-on refuses what its feature does not support."""
    for cls in ENGINE_ADDONS:
        cls.check_config(config)


class EngineAddons:
    """The add-ons of one engine core: `hooks[name]` the overriding methods per hook, `get(name)` an add-on by its
    name (None where its feature is off), `utility` its utility methods by name."""

    def __init__(self, core):
        self.table = list(ENGINE_ADDONS)
        self.addons = [a for a in (cls.build(core) for cls in self.table) if a is not None]
        self.hooks = {h: overriding(self.addons, h) for h in HOOKS}
        self.utility = {m: getattr(a, m) for a in self.addons for m in a.utility_methods}
        self.lookahead_slots = max((a.lookahead_slots for a in self.addons), default=0)
        self._by_name = {a.name: a for a in self.addons}

    def get(self, name: str):
        if name in self._by_name:
            return self._by_name[name]
        if name in self.utility:
            return self.utility[name]
        if any(cls.name == name for cls in self.table):
            return None  # the feature is off
        raise AttributeError(f"the engine core has no attribute or add-on {name!r}")


__all__ = ["ENGINE_ADDONS", "HOOKS", "EngineAddon", "EngineAddons", "check_config", "overriding"]
