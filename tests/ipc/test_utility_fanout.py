"""Utility fan-out to N engine cores: wait-for-all, cleanup on every exit, compensation.

Fake engines run as asyncio tasks behind an in-memory transport; asyncio events and loop-iteration
delays force the orderings. Each fake engine keeps state (loaded LoRA names, sleeping) so side
effects of a call, and of its undo, are observable.
"""
from __future__ import annotations

import asyncio
import gc
import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel.ipc.utility import (
    AlreadyRegisteredError,
    Err,
    FanoutResult,
    Ok,
    UtilityCallError,
    UtilityClient,
    UtilityFanoutError,
    UtilityPrepareError,
    UtilitySendError,
    UtilityTimeoutError,
    WaiterGuard,
)
from kestrel.errors import EngineDead

LOGGER = "kestrel.ipc.utility"
pytestmark = pytest.mark.timeout(30)  # a broken wait-for-all hangs; fail fast instead


# ------------------------------------------------------------------------------- fake engines


@dataclass
class Script:
    """How a fake engine answers one method: ok (apply + reply), fail (reply failure), silent (never)."""

    kind: str = "ok"
    delay: int = 0  # event-loop iterations before acting
    gate: asyncio.Event | None = None  # wait for it before acting


class EngineDied(Exception):
    pass


@dataclass
class FakeEngine:
    index: int
    log: list
    loras: set = field(default_factory=set)
    sleeping: bool = False
    scripts: dict = field(default_factory=dict)  # method -> Script
    default: Script = field(default_factory=Script)
    encode_raises: bool = False
    send_raises: bool = False
    send_gate: asyncio.Event | None = None
    received: list = field(default_factory=list)  # (call_id, method, args)

    def apply(self, method: str, args: tuple) -> Any:
        if method == "add_lora":
            self.loras.add(args[0])
            return True
        if method == "remove_lora":
            self.loras.discard(args[0])
            return True
        if method == "sleep":
            self.sleeping = True
            return True
        if method == "wake_up":
            self.sleeping = False
            return True
        if method == "is_sleeping":
            return self.sleeping
        if method == "echo":
            return args[0]
        raise AttributeError(method)

    async def serve(self, client: UtilityClient, call_id: int, method: str, args: tuple) -> None:
        script = self.scripts.get(method, self.default)
        for _ in range(script.delay):
            await asyncio.sleep(0)
        if script.gate is not None:
            await script.gate.wait()
        if script.kind == "silent":
            return
        if script.kind == "fail":
            ok, payload = False, f"Call to {method} method failed: scripted failure on engine {self.index}"
        else:
            ok, payload = True, self.apply(method, args)
        self.log.append(("settled", self.index, method, ok))
        client.deliver(call_id, ok, payload, engine_index=self.index)


class FakeTransport:
    def __init__(self, n: int):
        self.log: list = []
        self.engines = [FakeEngine(i, self.log) for i in range(n)]
        self.client: UtilityClient | None = None
        self.sent: list[tuple[int, str]] = []
        self.encoded: list[tuple[int, int, str]] = []
        self.tasks: set[asyncio.Task] = set()
        self.dead: dict[int, BaseException] = {}  # the core client's one record of dead engines
        self.restoring: set[int] = set()

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    def encode(self, engine_index: int, call_id: int, method: str, args: tuple) -> bytes:
        if self.engines[engine_index].encode_raises:
            raise ValueError(f"cannot encode {method} for engine {engine_index}")
        self.encoded.append((engine_index, call_id, method))
        return msgspec.msgpack.encode((call_id, method, list(args)))

    async def send(self, engine_index: int, payload: bytes) -> None:
        engine = self.engines[engine_index]
        await asyncio.sleep(0)  # a real socket send yields to the loop
        if engine.send_gate is not None:
            await engine.send_gate.wait()
        if engine.send_raises:
            self.log.append(("send_failed", engine_index))
            raise ConnectionError(f"socket to engine {engine_index} is closed")
        call_id, method, args = msgspec.msgpack.decode(payload)
        self.sent.append((engine_index, method))
        self.log.append(("received", engine_index, method))
        engine.received.append((call_id, method, tuple(args)))
        task = asyncio.get_running_loop().create_task(engine.serve(self.client, call_id, method, tuple(args)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def shutdown(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def make_cluster(n: int) -> tuple[UtilityClient, FakeTransport]:
    transport = FakeTransport(n)
    client = UtilityClient(transport)
    transport.client = client
    return client, transport


@pytest.fixture
async def cluster():
    made: list[FakeTransport] = []

    def factory(n: int = 3) -> tuple[UtilityClient, FakeTransport]:
        client, transport = make_cluster(n)
        made.append(transport)
        return client, transport

    yield factory
    for transport in made:
        await transport.shutdown()


async def spin(n: int = 30) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# ------------------------------------------------------------------------------ 1. wait for all


async def test_fanout_waits_for_every_engine_before_raising(cluster):
    client, tr = cluster(3)
    gate = asyncio.Event()
    tr.engines[0].scripts["add_lora"] = Script("fail")
    tr.engines[2].scripts["add_lora"] = Script(gate=gate)

    async def caller():
        result = await client.call_all("add_lora", "sql")
        tr.log.append(("done",))
        return result.values_or_raise()

    task = asyncio.create_task(caller())
    await spin(50)
    assert ("settled", 0, "add_lora", False) in tr.log  # engine 0 failed long ago...
    assert not task.done()  # ...and the call still waits for engine 2
    assert "sql" not in tr.engines[2].loras
    assert [w.engine_index for w in client.pending.values()] == [2]

    gate.set()
    with pytest.raises(UtilityFanoutError) as info:
        await task
    err = info.value
    assert [o.engine_index for o in err.result] == [0, 1, 2]
    assert [type(o) for o in err.result] == [Err, Ok, Ok]
    assert isinstance(err.result[0].exception, UtilityCallError)
    assert err.result[0].exception.engine_index == 0
    assert err.failed_engines == [0] and err.result.ok_engines() == [1, 2]
    assert "engine 0" in str(err) and "scripted failure on engine 0" in str(err)
    assert tr.engines[2].loras == {"sql"}  # the held engine's side effect happened
    assert tr.log.index(("settled", 2, "add_lora", True)) < tr.log.index(("done",))
    assert client.pending == {}


# ----------------------------------------------------------------------------- 2. cancellation


async def test_cancel_mid_wait_cleans_registry_and_drops_late_reply(cluster, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    client, tr = cluster(3)
    gate = asyncio.Event()
    tr.engines[1].scripts["echo"] = Script(gate=gate)
    task = asyncio.create_task(client.call_all("echo", 7))
    await spin()
    assert len(client.pending) == 1
    (late_id,) = client.pending
    pending_future = client.pending[late_id]

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.pending == {}
    assert pending_future.cancelled()

    gate.set()  # engine 1 now answers the abandoned call
    await spin()
    assert ("settled", 1, "echo", True) in tr.log
    assert f"dropping reply for unknown or finished utility call {late_id}" in caplog.text
    assert client.deliver(late_id, True, 7, engine_index=1) is False  # again, directly: still no exception

    del tr.engines[1].scripts["echo"]
    assert (await client.call_all("echo", 8)).values_or_raise() == [8, 8, 8]
    assert client.pending == {}


async def test_cancel_during_send_phase_cleans_registry(cluster):
    client, tr = cluster(3)
    tr.engines[1].send_gate = asyncio.Event()  # engine 1's socket blocks
    task = asyncio.create_task(client.call_all("add_lora", "a"))
    await spin()
    assert not task.done()
    assert [w.engine_index for w in client.pending.values()] == [1]  # 0 and 2 already answered
    assert tr.engines[0].loras == {"a"}
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.pending == {}
    assert client.pending == {}
    tr.engines[1].send_gate = None
    assert (await client.call_all("is_sleeping")).consensus() is False


async def test_deliver_never_raises_on_unknown_or_bad_ids(cluster, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    client, _ = cluster(2)
    assert client.deliver(12345, True, None, engine_index=0) is False
    assert client.deliver(["unhashable"], False, "x", engine_index=0) is False  # type: ignore[arg-type]
    assert "dropping reply for unknown or finished utility call 12345" in caplog.text


async def test_deliver_from_wrong_engine_is_dropped(cluster):
    client, tr = cluster(2)
    tr.engines[0].scripts["echo"] = Script("silent")
    task = asyncio.create_task(client.call(0, "echo", 1, timeout=1.0))
    await spin()
    (cid,) = client.pending
    assert client.deliver(cid, True, "forged", engine_index=1) is False
    assert cid in client.pending
    assert client.deliver(cid, True, "real", engine_index=0) is True
    assert await task == "real"


# ------------------------------------------------------------------ 3. prepare and send failure


async def test_prepare_failure_sends_nothing(cluster):
    client, tr = cluster(3)
    tr.engines[2].encode_raises = True
    with pytest.raises(UtilityPrepareError) as info:
        await client.call_all("add_lora", "x")
    assert info.value.engine_index == 2
    assert "engine 2" in str(info.value) and "cannot encode" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert [e for e, _, _ in tr.encoded] == [0, 1]  # engines 0 and 1 were prepared...
    assert tr.sent == []  # ...but nothing went out to anyone
    assert client.pending == {}
    assert all(not e.loras for e in tr.engines)


async def test_send_failure_still_awaits_the_others(cluster):
    client, tr = cluster(3)
    tr.engines[1].send_raises = True
    gate = asyncio.Event()
    tr.engines[0].scripts["add_lora"] = Script(gate=gate)
    task = asyncio.create_task(client.call_all("add_lora", "y"))
    await spin()
    assert ("send_failed", 1) in tr.log
    assert not task.done()  # engine 0 is still awaited after engine 1's send failed
    assert [w.engine_index for w in client.pending.values()] == [0]
    gate.set()
    result = await task
    assert [type(o) for o in result] == [Ok, Err, Ok]
    assert isinstance(result[1].exception, UtilitySendError)
    assert isinstance(result[1].exception.__cause__, ConnectionError)
    assert result.ok_engines() == [0, 2] and result.failed_engines() == [1]
    assert [e.loras for e in tr.engines] == [{"y"}, set(), {"y"}]
    assert client.pending == {}


async def test_single_engine_call_errors(cluster):
    client, tr = cluster(3)
    assert await client.call(1, "echo", "hi") == "hi"
    assert [e for e, _ in tr.sent] == [1]
    tr.engines[1].scripts["echo"] = Script("fail")
    with pytest.raises(UtilityCallError) as info:
        await client.call(1, "echo", "hi")
    assert (info.value.method, info.value.engine_index) == ("echo", 1)
    assert "scripted failure" in info.value.message
    tr.engines[2].send_raises = True
    with pytest.raises(UtilitySendError):
        await client.call(2, "echo", 1)
    tr.engines[0].encode_raises = True
    with pytest.raises(UtilityPrepareError):
        await client.call(0, "echo", 1)
    with pytest.raises(ValueError):
        await client.call(3, "echo", 1)
    assert client.pending == {}


# -------------------------------------------------------------------------- 4. compensation


async def test_compensation_undoes_exactly_the_engines_that_succeeded(cluster):
    client, tr = cluster(3)
    gate = asyncio.Event()
    tr.engines[1].scripts["add_lora"] = Script("fail")
    tr.engines[2].scripts["add_lora"] = Script(gate=gate)  # succeeds, but late
    task = asyncio.create_task(client.call_all_or_undo("add_lora", ("sql",), "remove_lora", ("sql",)))
    await spin(50)
    assert not task.done()
    assert tr.engines[0].loras == {"sql"}
    assert not any(m == "remove_lora" for _, m in tr.sent)  # no undo while engine 2 is in flight

    gate.set()
    with pytest.raises(UtilityFanoutError) as info:
        await task
    err = info.value
    assert err.failed_engines == [1]
    assert err.undo is not None and err.undo.method == "remove_lora"
    assert err.undo.ok_engines() == [0, 2] and err.undo.failed_engines() == []
    assert sorted(e for e, m in tr.sent if m == "remove_lora") == [0, 2]
    assert [e.loras for e in tr.engines] == [set(), set(), set()]
    assert "undo 'remove_lora': ok on [0, 2], failed on []" in str(err)

    last_forward_settle = max(i for i, ev in enumerate(tr.log) if ev[0] == "settled" and ev[2] == "add_lora")
    first_undo = min(i for i, ev in enumerate(tr.log) if ev[0] == "received" and ev[2] == "remove_lora")
    assert last_forward_settle < first_undo
    assert client.pending == {}


async def test_compensation_with_undo_args_and_undo_failure(cluster):
    client, tr = cluster(3)
    tr.engines[0].scripts["sleep"] = Script("fail")
    tr.engines[2].scripts["wake_up"] = Script("fail")
    with pytest.raises(UtilityFanoutError) as info:
        await client.call_all_or_undo("sleep", (1,), "wake_up", ())
    err = info.value
    assert [e.received[-1][1:] for e in tr.engines[1:]] == [("wake_up", ()), ("wake_up", ())]
    assert [e.sleeping for e in tr.engines] == [False, False, True]  # engine 2 could not be woken
    assert err.undo.ok_engines() == [1] and err.undo.failed_engines() == [2]
    assert "undo 'wake_up': ok on [1], failed on [2]" in str(err)
    assert client.pending == {}


async def test_compensation_not_needed_when_all_succeed(cluster):
    client, tr = cluster(3)
    result = await client.call_all_or_undo("add_lora", ("a",), "remove_lora", ("a",))
    assert result.all_true()
    assert all(m == "add_lora" for _, m in tr.sent)
    assert [e.loras for e in tr.engines] == [{"a"}] * 3


async def test_compensation_undo_prepare_failure_is_reported_not_lost(cluster):
    client, tr = cluster(2)
    tr.engines[1].scripts["add_lora"] = Script("fail")

    with pytest.raises(UtilityFanoutError) as info:  # undo args that cannot be encoded: nothing of it is sent
        await client.call_all_or_undo("add_lora", ("a",), "remove_lora", (object(),))
    assert info.value.failed_engines == [1]
    assert info.value.undo.failed_engines() == [0]
    assert tr.engines[0].loras == {"a"}
    assert client.pending == {}


# ---------------------------------------------------------------------- 5. property: hypothesis

TIMEOUT_S = 0.03
KINDS = ("ok", "fail", "send_fail", "timeout")


async def _scenario(specs: list[tuple[int, str]], cancel_after: int | None) -> None:
    loop = asyncio.get_running_loop()
    loop_errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: loop_errors.append(context))
    client, tr = make_cluster(len(specs))
    for engine, (latency, kind) in zip(tr.engines, specs):
        engine.send_raises = kind == "send_fail"
        engine.default = Script({"fail": "fail", "timeout": "silent"}.get(kind, "ok"), delay=latency)
    timeout = TIMEOUT_S if any(kind == "timeout" for _, kind in specs) else None

    start = loop.time()
    done_at: list[float] = []

    async def caller():
        try:
            return await client.call_all("echo", 1, timeout=timeout)
        finally:
            done_at.append(loop.time())
            tr.log.append(("done",))

    task = asyncio.create_task(caller())
    if cancel_after is not None:
        await spin(cancel_after)
        task.cancel()
    await asyncio.wait([task], timeout=2.0)
    if not task.done():  # fail this example quickly rather than hang the whole run
        task.cancel()
        await tr.shutdown()
        raise AssertionError(f"fan-out never returned: specs={specs} cancel_after={cancel_after}")
    assert client.pending == {}  # empty at every exit, right away

    if task.cancelled():
        await spin(40)  # the engines finish; replies to the cancelled call are dropped
        assert client.pending == {}
        for engine in tr.engines:
            engine.send_raises = False
            engine.default = Script()
        after = await client.call_all("echo", 2)
        assert after.values_or_raise() == [2] * len(specs)
    else:
        result = task.result()
        done = tr.log.index(("done",))
        assert [o.engine_index for o in result] == list(range(len(specs)))
        for i, (outcome, (_, kind)) in enumerate(zip(result, specs)):
            if kind == "ok":
                assert outcome == Ok(1, i)
                assert tr.log.index(("settled", i, "echo", True)) < done
            elif kind == "fail":
                assert isinstance(outcome, Err) and isinstance(outcome.exception, UtilityCallError)
                assert tr.log.index(("settled", i, "echo", False)) < done
            elif kind == "send_fail":
                assert isinstance(outcome, Err) and isinstance(outcome.exception, UtilitySendError)
                assert tr.log.index(("send_failed", i)) < done
            else:
                assert isinstance(outcome, Err) and isinstance(outcome.exception, TimeoutError)
                assert done_at[0] - start >= TIMEOUT_S  # it settled at its deadline, not before
    assert client.pending == {}
    await tr.shutdown()
    gc.collect()
    assert loop_errors == []


@pytest.mark.timeout(120)  # gc.collect() per example is slow with a full test session's heap
@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(0, 12), st.sampled_from(KINDS)), min_size=1, max_size=4),
    cancel_after=st.none() | st.integers(0, 20),
)
def test_fanout_invariants_under_random_failures(specs, cancel_after):
    asyncio.run(_scenario(specs, cancel_after))


# ------------------------------------------------- 6. timeout, consensus, engine death, add_request


async def test_timeout_fails_only_the_silent_engine(cluster):
    client, tr = cluster(3)
    tr.engines[1].scripts["echo"] = Script("silent")
    result = await client.call_all("echo", 5, timeout=0.05)
    assert [type(o) for o in result] == [Ok, Err, Ok]
    assert [o.value for o in result if isinstance(o, Ok)] == [5, 5]
    exc = result[1].exception
    assert isinstance(exc, TimeoutError) and isinstance(exc, UtilityTimeoutError)
    assert exc.engine_index == 1 and "timed out" in str(exc)
    assert client.pending == {}
    (timed_out_id,) = [cid for cid, _, _ in tr.engines[1].received]
    assert client.deliver(timed_out_id, True, 5, engine_index=1) is False  # a reply after the deadline is dropped
    with pytest.raises(UtilityFanoutError, match="engine 1: .*timed out"):
        result.values_or_raise()
    with pytest.raises(TimeoutError):
        await client.call(1, "echo", 5, timeout=0.01)
    assert client.pending == {}


async def test_consensus_and_all_true(cluster):
    client, tr = cluster(3)
    assert (await client.call_all("is_sleeping")).consensus() is False
    assert (await client.call_all("add_lora", "z")).all_true()
    tr.engines[1].sleeping = True
    result = await client.call_all("is_sleeping")
    with pytest.raises(UtilityFanoutError) as info:
        result.consensus()
    message = str(info.value)
    assert "inconsistent" in message and "engine 0 returned False" in message and "engine 1 returned True" in message
    assert not FanoutResult("is_sleeping", [Ok(True, 0), Ok(False, 1)]).all_true()
    failed = FanoutResult("m", [Ok(1, 0), Err(RuntimeError("boom"), 1)])
    with pytest.raises(UtilityFanoutError, match="engine 1: RuntimeError: boom"):
        failed.consensus()
    with pytest.raises(UtilityFanoutError):
        failed.all_true()


async def test_fail_engine_fails_only_its_waiters_and_marks_it_dead(cluster):
    client, tr = cluster(3)
    tr.engines[1].scripts["echo"] = Script("silent")
    tr.engines[2].scripts["echo"] = Script("silent")
    task = asyncio.create_task(client.call_all("echo", 3))
    await spin()
    died = EngineDied("engine 1 process exited")
    tr.dead[1] = died  # the core client records the death, then fails the engine's waiters
    assert client.fail_engine(1, died) == 1
    await spin()
    assert not task.done()  # engine 2 is still awaited
    tr.dead[2] = EngineDied("engine 2 exited")
    assert client.fail_engine(2, tr.dead[2]) == 1
    result = await task
    assert [type(o) for o in result] == [Ok, Err, Err]
    assert result[1].exception is died
    assert client.pending == {}

    sent_before = len(tr.sent)
    again = await client.call_all("echo", 4)  # dead engines settle at once, unsent
    assert again.failed_engines() == [1, 2] and again[0] == Ok(4, 0)
    assert isinstance(again[1].exception, UtilitySendError) and again[1].exception.__cause__ is died
    assert [e for e, _ in tr.sent[sent_before:]] == [0]
    tr.dead.clear()  # both restarted
    del tr.engines[1].scripts["echo"], tr.engines[2].scripts["echo"]
    assert (await client.call_all("echo", 5)).values_or_raise() == [5, 5, 5]

    tr.engines[0].scripts["echo"] = Script("silent")
    single = asyncio.create_task(client.call(0, "echo", 6))
    await spin()
    client.fail_engine(None, EngineDied("shutdown"))
    with pytest.raises(EngineDied):
        await single
    assert client.pending == {}


async def test_dead_engine_triggers_no_undo_on_live_engines(cluster):
    """A fan-out whose failure is only a dead engine leaves the live engines' new state alone (the dead engine comes
    back fresh); an engine-side failure on a live engine still undoes."""
    client, tr = cluster(2)
    tr.engines[0].sleeping = True
    tr.dead[1] = EngineDead("engine core 1 died with exit code -9")
    with pytest.raises(UtilityFanoutError) as info:
        await client.call_all_or_undo("wake_up", (), "sleep", (1,))
    assert info.value.undo is None and info.value.failed_engines == [1]
    assert tr.engines[0].sleeping is False  # before the fix: put back to sleep by the undo
    assert [m for _, m in tr.sent] == ["wake_up"]
    # a death during the call (not known before sending) is no reason to undo either
    tr.dead.clear()
    tr.engines[1].scripts["sleep"] = Script("silent")
    task = asyncio.create_task(client.call_all_or_undo("sleep", (1,), "wake_up", ()))
    await spin()
    died = EngineDead("engine core 1 died with exit code -9")
    tr.dead[1] = died
    client.fail_engine(1, died)
    with pytest.raises(UtilityFanoutError) as info:
        await task
    assert info.value.undo is None and tr.engines[0].sleeping is True
    assert client.pending == {}


async def test_waiter_guard_exit_paths():
    loop = asyncio.get_running_loop()
    registry: dict[int, Any] = {}
    with pytest.raises(RuntimeError):
        with WaiterGuard(registry) as guard:
            a = guard.register(1, loop.create_future())
            guard.register(2, loop.create_future())
            raise RuntimeError("prepare failed")
    assert registry == {} and a.cancelled()

    with WaiterGuard(registry) as guard:
        kept = guard.register(1, loop.create_future())
        guard.register(2, loop.create_future())
        guard.release(2)
        assert list(registry) == [1]
        guard.disarm(1)
    assert registry == {1: kept} and not kept.done()

    with WaiterGuard(registry) as guard:
        guard.register(3, loop.create_future())
        replacement = loop.create_future()
        registry[3] = replacement  # someone else took the slot over: not ours to remove
        with pytest.raises(AlreadyRegisteredError):
            guard.register(1, loop.create_future())
    assert registry == {1: kept, 3: replacement} and not replacement.done()
    with pytest.raises(RuntimeError):
        guard.register(4, loop.create_future())
