"""ChildSender: a request's core requests go in at once when its admission window has room for all of them, else
one by one as slots free; a slot goes back when its core request ends, or at once when the send itself fails."""
from __future__ import annotations

import asyncio

import pytest

from kestrel.core.sampling_params import SamplingParams
from kestrel.engine.messages import EngineCoreRequest
from kestrel.frontend.child_sender import ChildSender
from kestrel.frontend.request_metrics import RequestTiming


class FakeClient:
    def __init__(self, fail_on: str | None = None):
        self.sent, self.fail_on = [], fail_on

    def add_request(self, r) -> int:
        if r.request_id == self.fail_on:
            raise ConnectionError(f"cannot send {r.request_id}")
        self.sent.append(r.request_id)
        return 3  # the engine core it went to


def _reqs(n: int) -> list[EngineCoreRequest]:
    params = SamplingParams(max_tokens=1)
    return [EngineCoreRequest(f"r#{i}", [1], params, 1, 0.0, 0) for i in range(n)]


def test_all_at_once_when_the_window_has_room():
    async def run():
        client = FakeClient()
        sender, timing = ChildSender(client, None), RequestTiming(3)
        window = sender.new_window(4, 4)
        assert sender.send(_reqs(3), window, timing, asyncio.Queue()) is None
        assert client.sent == ["r#0", "r#1", "r#2"] and window.in_use == 3 and timing.engine == 3
        sender.leave(["r#1", "unknown"])
        assert window.in_use == 2 and set(sender.windows) == {"r#0", "r#2"}
    asyncio.run(run())


def test_the_rest_go_in_as_slots_free():
    async def run():
        client = FakeClient()
        sender = ChildSender(client, None)
        window = sender.new_window(2, 2)
        task = sender.send(_reqs(5), window, RequestTiming(5), asyncio.Queue())
        await asyncio.sleep(0)
        assert task is not None and client.sent == ["r#0", "r#1"]
        sender.leave(["r#0"])
        await asyncio.sleep(0)
        assert client.sent == ["r#0", "r#1", "r#2"] and window.in_use == 2
        sender.leave(["r#1", "r#2"])
        await task
        assert client.sent == [f"r#{i}" for i in range(5)] and window.in_use == 2
    asyncio.run(run())


def test_a_failed_send_gives_every_unsent_slot_back():
    async def run():
        sender = ChildSender(FakeClient(fail_on="r#1"), None)
        window = sender.new_window(4, 4)
        with pytest.raises(ConnectionError, match="cannot send r#1"):
            sender.send(_reqs(3), window, RequestTiming(3), asyncio.Queue())
        assert window.in_use == 1 and list(sender.windows) == ["r#0"]  # r#0 is in the engine until it ends

        errors: asyncio.Queue = asyncio.Queue()
        slow = ChildSender(FakeClient(fail_on="r#0"), None)
        small = slow.new_window(1, 1)
        small.in_use = 1  # full: the send waits for a slot
        task = slow.send(_reqs(2), small, RequestTiming(2), errors)
        small.give(1)
        await task
        err = errors.get_nowait()
        assert isinstance(err, ConnectionError) and small.in_use == 0 and slow.windows == {}
    asyncio.run(run())
