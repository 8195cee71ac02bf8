"""AdmissionWindow: at most `size` slots taken, waiters served in arrival order, a cancelled waiter leaks no slot
(also when it was granted as it was cancelled)."""
from __future__ import annotations

import asyncio

import pytest

from kestrel.frontend.admission import AdmissionWindow


def test_window_order_and_cancellation():
    async def run():
        w = AdmissionWindow(2)
        assert w.try_take(2) and not w.try_take(1)
        order = []

        async def waiter(name):
            await w.take()
            order.append(name)

        a, b, c = (asyncio.create_task(waiter(n)) for n in "abc")
        await asyncio.sleep(0)
        assert not w.try_take(1)  # others wait first
        b.cancel()
        await asyncio.sleep(0)
        w.give(1)
        await asyncio.sleep(0)
        assert order == ["a"]
        w.give(1)
        w.give(1)  # c takes one; one stays free
        await asyncio.gather(a, c)
        assert order == ["a", "c"] and w.free == 1
        # granted and cancelled in the same turn: the slot goes back
        assert w.try_take(1)
        d = asyncio.create_task(w.take())
        await asyncio.sleep(0)
        w.give(1)
        d.cancel()
        with pytest.raises(asyncio.CancelledError):
            await d
        assert w.free == 1

    asyncio.run(run())


def test_window_needs_a_slot():
    with pytest.raises(ValueError, match="at least one slot"):
        AdmissionWindow(0)
