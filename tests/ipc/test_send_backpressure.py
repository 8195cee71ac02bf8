"""MPClient sends never fail because an engine is busy (issue 33 item 2): with the engine's input queue full
(ZeroMQ EAGAIN) messages wait in that engine's outbox, in order, and go out as it reads; an abort drops the adds
still waiting and sends ABORT only for those that left; an engine that is gone (EHOSTUNREACH) is EngineDead.
A fake socket stands in for the ROUTER; the rest is the real client."""
from __future__ import annotations

import asyncio
import errno

import pytest
import zmq

from kestrel.config import EngineConfig
from kestrel.core.sampling_params import SamplingParams
from kestrel.errors import EngineDead
from kestrel.ipc import protocol as P
from kestrel.ipc.core_client import DPClient


class FullSocket:
    """Takes `room[engine]` messages per engine, then raises EAGAIN until given more room."""

    def __init__(self, room: list[int]):
        self.room = room
        self.sent: list[tuple[int, P.RequestType, object]] = []
        self.gone: set[int] = set()

    def send_multipart(self, frames, flags=0):
        engine = int.from_bytes(frames[0], "little")
        if engine in self.gone:
            raise zmq.ZMQError(errno.EHOSTUNREACH)
        if self.room[engine] <= 0:
            raise zmq.Again()
        self.room[engine] -= 1
        rtype = P.RequestType(frames[1])
        body = P.add_decoder.decode(frames[2]).request_id if rtype is P.RequestType.ADD else \
            P.abort_decoder.decode(frames[2])
        self.sent.append((engine, rtype, body))


def req(i: int) -> P.EngineCoreRequest:
    return P.EngineCoreRequest(f"r{i}", [1, 2, 3], SamplingParams(), 4, 0.0)


def test_full_engine_queues_in_order_and_abort_drops_unsent_adds():
    async def run():
        c = DPClient(EngineConfig(), 2)
        c._input = sock = FullSocket([3, 100])
        c._outbox_ready = asyncio.Event()
        c.stats = [P.SchedulerStats(), P.SchedulerStats(num_waiting=1000)]  # everything routes to engine 0
        for i in range(10):
            assert c.add_request(req(i)) == 0  # never raises although engine 0 takes only 3
        assert [b for _, _, b in sock.sent] == ["r0", "r1", "r2"] and len(c._outbox[0]) == 7
        c.abort_requests(["r1", "r5", "r6"])  # r1 left: ABORT; r5, r6 never did: dropped
        assert [m[2] for m in c._outbox[0]] == ["r3", "r4", "r7", "r8", "r9", None]
        sender = asyncio.create_task(c._send_loop())
        await asyncio.sleep(0.05)
        assert len(sock.sent) == 3  # still full: nothing lost, nothing reordered
        sock.room[0] = 100
        for _ in range(100):
            if not c._outbox[0]:
                break
            await asyncio.sleep(0.01)
        assert sock.sent[3:] == [(0, P.RequestType.ADD, "r3"), (0, P.RequestType.ADD, "r4"),
                                 (0, P.RequestType.ADD, "r7"), (0, P.RequestType.ADD, "r8"),
                                 (0, P.RequestType.ADD, "r9"), (0, P.RequestType.ABORT, ["r1"])]
        assert sorted(c.request_engine) == ["r0", "r2", "r3", "r4", "r7", "r8", "r9"]
        c._closing = True
        c._outbox_ready.set()
        await asyncio.wait_for(sender, 1)

    asyncio.run(run())


def test_an_engine_that_is_gone_is_engine_dead():
    async def run():
        c = DPClient(EngineConfig(), 2)
        c._input = sock = FullSocket([100, 100])
        c._outbox_ready = asyncio.Event()
        c.stats = [P.SchedulerStats(), P.SchedulerStats(num_waiting=1000)]
        sock.gone.add(0)
        with pytest.raises(EngineDead, match="engine core 0 is unreachable"):
            c.add_request(req(0))
        assert "r0" not in c.request_engine

    asyncio.run(run())
