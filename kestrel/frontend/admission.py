"""Per-request admission: one API request (a prompt list times n) has at most `size` sequences in the engine at
once; the rest wait here and go in as earlier ones finish. Without it a request of thousands of sequences fills
the engine's waiting queue and every slot, and a short request from anyone else waits behind all of them."""
from __future__ import annotations

import asyncio
import collections


class AdmissionWindow:
    """A counting window shared by the streams of one API request; waiters are served in arrival order."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"an admission window needs at least one slot, got {size}")
        self.size = size
        self.free = size
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    def try_take(self, k: int) -> bool:
        """Take k slots now if they are free and nobody waits before us."""
        if self._waiters or self.free < k:
            return False
        self.free -= k
        return True

    async def take(self) -> None:
        if self.try_take(1):
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as we were cancelled: hand it on
                self.give(1)
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def give(self, k: int = 1) -> None:
        self.free += k
        while self.free and self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                self.free -= 1
                fut.set_result(None)
