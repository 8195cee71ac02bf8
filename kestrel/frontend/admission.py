"""Per-request admission: one API request (a prompt list times n) has at most `size` sequences in the engine at
once; the rest wait here and go in as earlier ones finish. Without it a request of thousands of sequences fills
the engine's waiting queue and every slot, and a short request from anyone else waits behind all of them.

The windows of one engine share an `AdmissionPolicy`: a request alone may fill its whole window, but while other
requests hold sequences too (and for `hold_s` after, so a user sending one short request after another keeps its
share between them) each window admits at most its `contended` size. Sequences already in the engine run on; the
limit applies to the next ones. A batch job then has the engine to itself when nobody else is there, and another
user's step stays close to an idle step's cost when somebody is."""
from __future__ import annotations

import asyncio
import collections
import time


class AdmissionPolicy:
    """Which windows hold or await sequences now, and so whether a window must keep to its contended size."""

    def __init__(self, hold_s: float = 2.0, clock=time.monotonic):
        self.hold_s, self.clock = hold_s, clock
        self.active: set[AdmissionWindow] = set()
        self.contended_until = 0.0

    def update(self, window: AdmissionWindow) -> None:
        if window.in_use or window._waiters:
            self.active.add(window)
        else:
            self.active.discard(window)
        if len(self.active) > 1:
            self.contended_until = self.clock() + self.hold_s

    def contended(self) -> bool:
        return len(self.active) > 1 or self.clock() < self.contended_until


class AdmissionWindow:
    """A counting window shared by the streams of one API request; waiters are served in arrival order.
    `group_id` names the request to the engine core (EngineCoreRequest.group_id), whose scheduler caps a group's
    running sequences while other groups have work ("": each stream is a group of its own)."""

    def __init__(self, size: int, contended: int | None = None, policy: AdmissionPolicy | None = None,
                 group_id: str = ""):
        if size < 1:
            raise ValueError(f"an admission window needs at least one slot, got {size}")
        self.size, self.group_id = size, group_id
        self.contended = max(1, min(size, contended if contended is not None else size))
        self.policy = policy
        self.in_use = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def limit(self) -> int:
        return self.contended if self.policy is not None and self.policy.contended() else self.size

    @property
    def free(self) -> int:
        return max(0, self.limit - self.in_use)

    def _changed(self) -> None:
        if self.policy is not None:
            self.policy.update(self)

    def try_take(self, k: int) -> bool:
        """Take k slots now if they are free and nobody waits before us."""
        if self._waiters or self.free < k:
            return False
        self.in_use += k
        self._changed()
        return True

    async def take(self) -> None:
        if self.try_take(1):
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._changed()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as we were cancelled: hand it on
                self.give(1)
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)
                self._changed()

    def give(self, k: int = 1) -> None:
        self.in_use -= k
        while self.free and self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                self.in_use += 1
                fut.set_result(None)
        self._changed()
