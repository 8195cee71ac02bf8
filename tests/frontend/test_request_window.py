"""AdmissionWindow: at most `size` slots taken, waiters served in arrival order, a cancelled waiter leaks no slot
(also when it was granted as it was cancelled)."""
from __future__ import annotations

import asyncio

import pytest

from kestrel.frontend.admission import AdmissionPolicy, AdmissionWindow


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


def test_a_window_keeps_to_its_contended_size_while_others_are_served_and_a_while_after():
    now = [0.0]
    policy = AdmissionPolicy(hold_s=2.0, clock=lambda: now[0])
    big, small = AdmissionWindow(8, 2, policy), AdmissionWindow(8, 2, policy)
    assert big.try_take(8) and big.limit == 8  # alone: the whole window
    assert small.try_take(1)  # somebody else arrives
    assert policy.contended() and big.limit == 2 and big.free == 0
    big.give(7)  # the big request's sequences finish: only 2 may be in the engine now
    assert big.in_use == 1 and big.free == 1 and not big.try_take(2) and big.try_take(1)
    small.give(1)  # the other request is done; a short gap before the user's next one
    now[0] = 1.0
    assert policy.contended() and big.free == 0
    now[0] = 2.5  # nobody else for longer than the hold: the whole window again
    assert not policy.contended() and big.free == 6 and big.try_take(6)


def test_waiters_of_a_contended_window_go_in_when_the_contention_is_over():
    async def run():
        now = [0.0]
        policy = AdmissionPolicy(hold_s=1.0, clock=lambda: now[0])
        big, other = AdmissionWindow(4, 1, policy), AdmissionWindow(4, 1, policy)
        assert other.try_take(1) and big.try_take(1)
        takers = [asyncio.create_task(big.take()) for _ in range(3)]
        await asyncio.sleep(0)
        assert big.in_use == 1 and len(big._waiters) == 3
        other.give(1)
        now[0] = 5.0
        big.give(1)  # a sequence of the big request finishes: the waiters may fill the whole window now
        await asyncio.gather(*takers)
        assert big.in_use == 3 and policy.active == {big}

    asyncio.run(run())
