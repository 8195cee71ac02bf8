"""The interface of an engine add-on: one feature's part of the engine core's loop (LoRA control, grammars,
speculation, pooling), the engine's twin of the runner's StepAddon (kestrel/worker/addons/base.py).

EngineCore names no feature: it builds the add-ons of its table (kestrel/engine/addons/__init__.py) and calls
each hook of every add-on that overrides it, in table order. An add-on is reached as `core.<name>`, and its
`utility_methods` are callable over the wire by name like the core's own. It lives here, below every package,
so that a feature's package (spec_decode/, ...) can hold its own engine add-on without importing the engine."""
from __future__ import annotations

# the hooks the core calls through per-hook lists (build and check_config are class methods, asked once)
HOOKS = ("admit", "hold", "release", "held", "abort", "can_schedule", "allows_pipelining", "propose",
         "samples_later", "sample", "after_launch", "after_collect", "outputs", "stats", "shutdown")


class EngineAddon:
    name: str = ""  # the core's attribute for it (core.<name>)
    utility_methods: tuple[str, ...] = ()  # its methods callable over the wire (ipc/core_proc.run_utility)
    lookahead_slots: int = 0  # KV slots a request needs past a step's tokens (the scheduler holds them)

    @classmethod
    def check_config(cls, config) -> None:
        """Before the model loads: raise ConfigError on what this feature refuses in the EngineConfig."""

    @classmethod
    def build(cls, core) -> "EngineAddon | None":
        """The add-on for this engine (`core`: its config, executor, tokenizer, model_config), or None where the
        feature is off. The scheduler does not exist yet: reach it later as core.scheduler."""
        return cls()

    # ---- requests in
    def admit(self, req) -> str | None:
        """Why the request cannot run (it ends as "abort" with that reason), or None."""
        return None

    def hold(self, req) -> bool:
        """Take the request before the scheduler sees it (True); `release` hands it over once ready."""
        return False

    def release(self, idle: bool) -> list[tuple[str, str]]:
        """Before each step: hand the held requests that are ready to core.scheduler; returns (request id,
        reason) of those that failed. `idle` (nothing else to do): it may wait a moment instead of spinning."""
        return []

    def held(self) -> list:
        """The requests it holds (live, not yet in the scheduler)."""
        return []

    def abort(self, ids: set[str]) -> list[str]:
        """Drop the held requests among `ids`; returns their ids."""
        return []

    # ---- scheduling
    def can_schedule(self, req, running: list) -> bool:
        """May the waiting request `req` join `running` now (False: it and those behind it wait)?"""
        return True

    def allows_pipelining(self) -> bool:
        """May step N+1 launch before step N's tokens are read?"""
        return True

    def propose(self, running: list) -> dict[str, list[int]]:
        """Tokens proposed past the known ones of running requests, verified by the step's sampling."""
        return {}

    # ---- launch and collect
    def samples_later(self, sched) -> bool:
        """Does the launched step sample only once `sample` is called (its logits wait for host work)?"""
        return False

    def sample(self, inf) -> None:
        """Queue the late sampling of a launched step (no-op where it sampled at launch)."""

    def after_launch(self, sched, inf) -> None:
        """A synchronous step was launched (sched: the SchedulerOutput, inf: the executor's handle)."""

    def after_collect(self, sched, result, pending) -> None:
        """A step's RunnerOutput was collected, before the scheduler reads it. `pending`: (sched, handle) of the
        step launched meanwhile (pipelined), or None."""

    def outputs(self, outs: list, result) -> None:
        """Complete the step's EngineCoreOutputs from its RunnerOutput in place."""

    def stats(self, stats) -> None:
        """Fill this feature's fields of SchedulerStats."""

    def shutdown(self) -> None:
        """Stop the feature's threads."""


def overriding(addons: list[EngineAddon], hook: str) -> list:
    """The bound `hook` methods of the add-ons that override it: the core's loops skip the rest."""
    return [getattr(a, hook) for a in addons if getattr(type(a), hook) is not getattr(EngineAddon, hook)]
