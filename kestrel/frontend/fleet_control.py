"""The engine cores as one fleet, for AsyncEngine: whether any core can serve, the calls that fan out to every
live core (utility calls, LoRA adapters, the prefix cache, sleep and wake-up; they wait for every engine, see
kestrel/ipc/utility.py), and the state a restarted core gets back before it serves (the fleet's sleep, the
adapters)."""
from __future__ import annotations

import asyncio
from typing import Any

from kestrel.errors import EngineDead
from kestrel.frontend.lora_registry import LoRARegistry, LoRARequest
from kestrel.ipc.core_client import EngineCoreClient


class FleetControl:
    """AsyncEngine's fleet-wide half (a base class: it reads the engine's `client`)."""
    client: EngineCoreClient

    def __init__(self):
        self.loras = LoRARegistry(self)  # adapters by name, loaded on every engine core or on none
        self.sleep_level: int | None = None  # the fleet's state: the level of the last /sleep, None while awake
        self._fleet_lock = asyncio.Lock()  # sleep, wake-up and a restarted engine's restore, one at a time

    @property
    def is_dead(self) -> bool:
        """No engine core can serve now (all dead or restarting)."""
        return self.client.is_dead

    def unavailable(self) -> EngineDead:
        """The error for a request that finds no engine core able to serve."""
        down = sorted(self.client.out_of_service().items())
        return EngineDead("; ".join(f"{e} ({self.client.engine_state(i)})" for i, e in down) or "no engine core can serve")

    # ---- fan-outs to the live engine cores (they wait for every engine; see ipc/utility.py). A dead or
    # restarting engine is left out: it has no state to change, and it comes back fresh.
    async def call_utility(self, method: str, *args, engine: int = 0) -> Any:
        return await self.client.utility.call(engine, method, *args)

    def _live(self) -> list[int]:
        if self.client.is_dead:
            raise self.unavailable()
        return self.client.live_engines

    # ---- LoRA adapters: fan-outs applied on every live engine or undone (kestrel/frontend/lora_registry.py)
    async def call_utility_all(self, method: str, *args):
        """`method` on every live engine core; the FanoutResult, which never raises by itself."""
        return await self.client.utility.call_all(method, *args, engines=self._live())

    async def call_utility_all_or_undo(self, method: str, args: tuple, undo_method: str, undo_args: tuple):
        return await self.client.utility.call_all_or_undo(method, args, undo_method, undo_args, engines=self._live())

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        return await self.loras.load(name, path)

    async def unload_lora_adapter(self, name: str) -> LoRARequest:
        return await self.loras.unload(name)

    async def list_loras(self) -> list[list]:
        """Every live engine's [[lora id, name], ...]; raises if the engines disagree."""
        return (await self.client.utility.call_all("list_loras", engines=self._live())).consensus()

    async def reset_prefix_cache(self) -> bool:
        return (await self.client.utility.call_all("reset_prefix_cache", engines=self._live())).all_true()

    async def sleep(self, level: int = 1) -> bool:
        """Mutating: if some engine fails, the ones that went to sleep are woken again (compensation). Once all
        sleep, the fleet is asleep: new requests get EngineSleeping (503), a restarted engine sleeps too."""
        async with self._fleet_lock:
            res = await self.client.utility.call_all_or_undo("sleep", (level,), "wake_up", (), engines=self._live())
            self.sleep_level = level
        return res.all_true()

    async def wake_up(self) -> bool:
        async with self._fleet_lock:
            res = await self.client.utility.call_all_or_undo("wake_up", (), "sleep", (1,), engines=self._live())
            self.sleep_level = None
        return res.all_true()

    async def _restore_engine(self, engine: int, serve) -> None:
        """A restarted engine core gets the server's state back before it serves: the fleet's sleep (an engine
        restarted while the others sleep comes back asleep), then the LoRA adapters (which call serve())."""
        async with self._fleet_lock:
            if self.sleep_level is not None:
                await self.client.utility.call(engine, "sleep", self.sleep_level)
            await self.loras.restore(engine, serve)

    async def is_sleeping(self) -> bool:
        return (await self.client.utility.call_all("is_sleeping", engines=self._live())).consensus()
