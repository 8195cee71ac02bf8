"""Acceptance 2 (property): loads and unloads through the frontend's LoRA registry, with random engine failures
and callers cancelled at random points, always leave every engine's adapters equal to the registry's. Fake engines
answer over the real UtilityClient (kestrel/ipc/utility.py) through an in-memory transport; only the forward
call of an operation may fail (its undo, e.g. dropping an adapter, succeeds)."""
from __future__ import annotations

import asyncio

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel.ipc.utility import UtilityClient
from kestrel.errors import KestrelError
from kestrel.frontend.lora_registry import LoRAFanoutError, LoRARegistry

pytestmark = pytest.mark.timeout(120)


class FakeEngines:
    """N engines holding {lora id: name}; `faults` is consumed per forward call: the engines that fail it."""

    def __init__(self, n: int, faults: list[frozenset], latencies: list[int]):
        self.loras = [dict() for _ in range(n)]
        self.faults = list(faults)
        self.latencies = latencies
        self.client: UtilityClient | None = None
        self.forward = True
        self.failing: frozenset = frozenset()
        self.tasks: set[asyncio.Task] = set()
        self.dead: dict[int, BaseException] = {}  # the transport's dead engines (none here)
        self.restoring: set[int] = set()

    @property
    def num_engines(self) -> int:
        return len(self.loras)

    def encode(self, engine_index: int, call_id: int, method: str, args: tuple) -> bytes:
        return msgspec.msgpack.encode((call_id, method, list(args)))

    async def send(self, engine_index: int, payload: bytes) -> None:
        call_id, method, args = msgspec.msgpack.decode(payload)
        fail = self.forward and engine_index in self.failing
        task = asyncio.get_running_loop().create_task(self._serve(engine_index, call_id, method, args, fail))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _serve(self, i: int, call_id: int, method: str, args: list, fail: bool) -> None:
        for _ in range(self.latencies[i]):
            await asyncio.sleep(0)
        if fail:
            self.client.deliver(call_id, False, f"Call to {method} method failed: injected fault", engine_index=i)
            return
        if method == "add_lora":
            self.loras[i][args[0]] = args[1]
        elif method == "remove_lora":
            self.loras[i].pop(args[0], None)
        self.client.deliver(call_id, True, True, engine_index=i)


class OneFaultPlanClient(UtilityClient):
    """Marks each operation's first fan-out (the forward call) as the one the fault plan applies to."""

    async def call_utility_all_or_undo(self, method, args, undo_method, undo_args):  # as AsyncEngine offers it
        tr = self.transport
        tr.forward, tr.failing = True, tr.faults.pop(0) if tr.faults else frozenset()
        return await self.call_all_or_undo(method, args, undo_method, undo_args)

    async def call_all(self, *args, **kw):
        try:
            return await super().call_all(*args, **kw)
        finally:
            self.transport.forward = False  # the next fan-out of this operation is its undo


async def _scenario(n, ops, faults, latencies, cancels):
    engines = FakeEngines(n, faults, latencies)
    client = OneFaultPlanClient(engines)
    engines.client = client
    registry = LoRARegistry(client, base_model_name="base")

    async def run(op, name):
        if op == "load":
            return await registry.load(name, f"/adapters/{name}")
        return await registry.unload(name)

    callers = [asyncio.create_task(run(op, name)) for op, name in ops]
    for task, cancel_after in zip(callers, cancels):
        if cancel_after is not None:
            for _ in range(cancel_after):
                await asyncio.sleep(0)
            task.cancel()
    results = await asyncio.gather(*callers, return_exceptions=True)
    while registry._tasks:  # cancelled callers' operations still run to their end
        await asyncio.gather(*list(registry._tasks), return_exceptions=True)
    await asyncio.gather(*list(engines.tasks), return_exceptions=True)

    expected = {r.lora_id: r.name for r in registry.adapters.values()}
    assert engines.loras == [expected] * n, (ops, faults, results)
    assert client.pending == {}
    for r in results:  # every failure is one of ours, and a fan-out failure names the engines that failed
        if isinstance(r, LoRAFanoutError):
            assert r.failed_engines and all(f"engine {i}" in str(r) for i in r.failed_engines)
        elif isinstance(r, BaseException):
            assert isinstance(r, (KestrelError, asyncio.CancelledError)), r


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 3))
def test_registry_stays_consistent_under_random_failures_and_cancellations(data, n):
    ops = data.draw(st.lists(st.tuples(st.sampled_from(["load", "unload"]), st.sampled_from("abc")), min_size=1,
                             max_size=8))
    faults = data.draw(st.lists(st.frozensets(st.integers(0, n - 1)), min_size=len(ops), max_size=len(ops)))
    latencies = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    cancels = data.draw(st.lists(st.none() | st.integers(0, 10), min_size=len(ops), max_size=len(ops)))
    asyncio.run(_scenario(n, ops, faults, latencies, cancels))
