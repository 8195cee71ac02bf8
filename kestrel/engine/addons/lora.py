"""LoRA control, an engine add-on: the adapters every rank of this engine holds (add/remove/list_loras, callable
over the wire; the executor's control call reaches every tensor-parallel rank), a request whose adapter is gone
ends as "abort" (an unload can race the request), and a waiting request whose adapter needs a device slot that
running requests hold waits (at most --max-loras distinct adapters in one batch)."""
from __future__ import annotations

import logging

from kestrel.core.engine_addon import EngineAddon
from kestrel.errors import InvalidRequest
from kestrel.executor import ControlCallError

logger = logging.getLogger(__name__)


class LoRAControl(EngineAddon):
    name = "lora_control"
    utility_methods = ("add_lora", "remove_lora", "list_loras")

    def __init__(self, core):
        self.core = core
        self.enabled = core.config.lora.enable_lora
        self.max_loras = core.config.lora.max_loras if self.enabled else 0  # distinct adapters in one batch
        self.loras: dict[int, str] = {}  # lora id -> name: the adapters every rank holds (set when call_all succeeds)
        self.paths: dict[int, str] = {}  # lora id -> the folder it was loaded from

    @classmethod
    def build(cls, core) -> "LoRAControl":
        return cls(core)  # also when off: list_loras answers [] and add_lora says how to turn it on

    def admit(self, req) -> str | None:
        if req.lora_id and req.lora_id not in self.loras:
            # unloaded while the request was on its way: end it (the frontend sees "abort"), never hang it
            return f"LoRA adapter id {req.lora_id} is not loaded"
        return None

    def can_schedule(self, req, running: list) -> bool:
        if not req.lora_id:
            return True
        loras = {r.lora_id for r in running if r.lora_id}
        # its adapter needs a device slot that running requests hold: wait for them
        return req.lora_id in loras or len(loras) < self.max_loras

    def stats(self, stats) -> None:
        """The adapters in use, by name (vLLM's lora_requests_info): of the running requests and of the others
        (waiting, or held by an add-on before scheduling)."""
        if not self.loras:
            return
        sched = self.core.scheduler
        running = {r.lora_id for r in sched.running if r.lora_id}
        running_ids = {r.request_id for r in sched.running}
        held = (r for h in self.core.addons.hooks["held"] for r in h())
        waiting = {r.lora_id for r in (*sched.requests.values(), *held) if r.lora_id and r.request_id not in running_ids}
        stats.running_loras = sorted(self.loras.get(i, str(i)) for i in running)
        stats.waiting_loras = sorted(self.loras.get(i, str(i)) for i in waiting)

    # ---- utility methods (the frontend fans them out to every engine core)
    def _check_enabled(self) -> None:
        if not self.enabled:
            raise InvalidRequest("LoRA is not enabled on this engine (start it with --enable-lora)")

    def add_lora(self, lora_id: int, name: str, path: str) -> bool:
        """Every rank reads its shard of the adapter; where some rank failed, the ranks that loaded it drop it."""
        self._check_enabled()
        executor = self.core.executor
        try:
            added = executor.call_all("add_lora", lora_id, name, path)
        except ControlCallError as e:
            if lora_id not in self.loras and any(o is True for o in e.outcomes):
                self._undo_add(lora_id)
            raise
        self.loras[lora_id], self.paths[lora_id] = name, path
        return added[0]

    def _undo_add(self, lora_id: int) -> None:
        try:
            self.core.executor.call_all("remove_lora", lora_id)
        except ControlCallError as e:
            logger.error("LoRA id %d: could not drop it from the ranks that loaded it: %s", lora_id, e)

    def remove_lora(self, lora_id: int) -> bool:
        """Refused while a request of this engine uses the adapter (its KV and device slot depend on it), counting
        requests that add-ons still hold (not yet scheduled)."""
        self._check_enabled()
        core = self.core
        held = (r for h in core.addons.hooks["held"] for r in h())
        users = sum(1 for r in (*core.scheduler.requests.values(), *held) if r.lora_id == lora_id)
        if users:
            raise InvalidRequest(f"LoRA id {lora_id} is in use by {users} request(s) on engine {core.engine_index}")
        removed = self.core.executor.call_all("remove_lora", lora_id)
        self.loras.pop(lora_id, None)
        self.paths.pop(lora_id, None)
        return removed[0]

    def list_loras(self) -> list[list]:
        """[[lora id, name], ...] of the adapters loaded on this engine, asked of every rank (they must agree)."""
        if not self.enabled:
            return []
        per_rank = self.core.executor.call_all("list_loras")
        if any(r != per_rank[0] for r in per_rank):
            raise RuntimeError(f"the tensor-parallel ranks hold different adapters: {per_rank}")
        return per_rank[0]
