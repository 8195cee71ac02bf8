"""The frontend's LoRA adapters by name. Loading and unloading go to every engine core through the utility fan-out
(kestrel/ipc/utility.py): all engines settle, and a change that failed somewhere is undone where it succeeded, so
an adapter is either loaded on every engine or on none; the error names the engines that failed and why. An
operation runs to its end even if its caller goes away (a cancelled HTTP request must not leave engines half
changed), and operations run one at a time. An engine core that the server restarts comes back empty: `restore`
loads every adapter of the registry into it (same ids) before it serves, one operation like the others, so no load
or unload can slip between the restore and the engine joining the live ones."""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
from dataclasses import dataclass

from kestrel.errors import ConfigError, InvalidRequest, KestrelError, ModelNotFound
from kestrel.ipc.utility import UtilityCallError, UtilityError, UtilityFanoutError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRARequest:
    name: str
    lora_id: int
    path: str


class LoRAFanoutError(KestrelError):
    """A load or unload that did not succeed on every engine core (and was undone where it did)."""

    error_type = "lora_error"

    def __init__(self, err: UtilityFanoutError):
        super().__init__(str(err))
        self.failed_engines = err.failed_engines
        # the adapter itself is bad when it failed everywhere (400); one engine failing is the server's (500)
        self.status_code = 400 if not err.result.ok_engines() else 500


def parse_lora_modules(cfg) -> list[tuple[str, str]]:
    """--lora-modules name=path ... (or vLLM's JSON form '{"name": ..., "path": ...}') -> [(name, path), ...]
    (they need --enable-lora)."""
    if cfg.lora_modules and not cfg.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    out = []
    for spec in cfg.lora_modules or []:
        name, sep, path = _json_lora_module(spec) if spec.lstrip().startswith("{") else spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules expects name=path or {{\"name\": ..., \"path\": ...}}, got {spec!r}")
        out.append((name, path))
    return out


def _json_lora_module(spec: str) -> tuple[str, str, str]:
    try:
        module = json.loads(spec)
    except ValueError:
        return "", "", ""
    if not isinstance(module, dict):
        return "", "", ""
    return str(module.get("name") or ""), "=", str(module.get("path") or "")


class LoRARegistry:
    def __init__(self, client, base_model_name: str | None = None):
        self.client = client  # the AsyncEngine: call_utility(_all, _all_or_undo)
        self.base_model_name = base_model_name
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    async def load(self, name: str, path: str) -> LoRARequest:
        return await self._shielded(self._load(name, path))

    async def unload(self, name: str) -> LoRARequest:
        return await self._shielded(self._unload(name))

    async def _shielded(self, coro):
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return await asyncio.shield(task)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the caller may have gone away

    async def restore(self, engine: int, serve) -> None:
        """Load every adapter the server has (from --lora-modules and load calls, minus unloads) into a restarted
        engine core, then let it serve (`serve()`, under the lock). An adapter that no longer loads (its folder
        moved, unreadable or corrupted) is skipped, logged and dropped from the server: unloaded from the other
        engines too, so that requests naming it get a 404 instead of failing on one engine. Any other failure
        (the engine died again, no reply) raises: the engine does not serve without the other engines' adapters."""
        async with self._lock:
            dropped = []
            for req in sorted(self.adapters.values(), key=lambda r: r.lora_id):
                try:
                    await self.client.call_utility("add_lora", req.lora_id, req.name, req.path, engine=engine)
                except UtilityCallError as e:  # the engine ran the load and it failed: the adapter's fault
                    logger.error("engine core %d: adapter %r (%s) no longer loads, dropped from the server: %s",
                                 engine, req.name, req.path, e.message)
                    del self.adapters[req.name]
                    dropped.append(req)
                except UtilityError as e:
                    raise RuntimeError(f"adapter {req.name!r} ({req.path}) could not be loaded again: "
                                       f"{e}") from e
            serve()
            for req in dropped:
                result = await self.client.call_utility_all("remove_lora", req.lora_id)
                for err in result.errors():
                    logger.error("adapter %r could not be dropped from engine core %d: %s", req.name,
                                 err.engine_index, err.exception)

    async def _load(self, name: str, path: str) -> LoRARequest:
        async with self._lock:
            if not name or name == self.base_model_name:
                raise InvalidRequest(f"lora_name {name!r} is empty or the base model's name", param="lora_name")
            if name in self.adapters:
                raise InvalidRequest(f"the adapter {name!r} is already loaded", param="lora_name")
            req = LoRARequest(name, next(self._ids), path)
            try:
                await self.client.call_utility_all_or_undo("add_lora", (req.lora_id, name, path), "remove_lora",
                                                           (req.lora_id,))
            except UtilityFanoutError as e:
                raise LoRAFanoutError(e) from e
            self.adapters[name] = req
            return req

    async def _unload(self, name: str) -> LoRARequest:
        async with self._lock:
            req = self.adapters.get(name)
            if req is None:
                raise ModelNotFound(f"no adapter named {name!r} is loaded", param="lora_name",
                                    code="model_not_found")
            try:
                await self.client.call_utility_all_or_undo("remove_lora", (req.lora_id,), "add_lora",
                                                           (req.lora_id, req.name, req.path))
            except UtilityFanoutError as e:
                raise LoRAFanoutError(e) from e
            del self.adapters[name]
            return req
