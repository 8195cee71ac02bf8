"""The scheduler's waiting queue: FCFS, or priority order, with a count of waiting requests per request group (the
fair share passes over groups at their cap, kestrel/engine/fair_share.py)."""
from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque

from kestrel.engine.request import Request


class WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival, seq) for the priority policy."""

    def __init__(self, policy: str):
        self.policy = policy
        self._dq: deque[Request] = deque()
        self._heap: list = []
        self._seq = itertools.count()
        self._removed: set[str] = set()
        self.groups: Counter[str] = Counter()  # waiting requests per request group

    def _key(self, r: Request):
        return (r.priority, r.arrival_time, next(self._seq))

    def push(self, r: Request) -> None:
        self.groups[r.group] += 1
        if self.policy == "priority":
            heapq.heappush(self._heap, (*self._key(r), r))
        else:
            self._dq.append(r)

    def push_front(self, r: Request) -> None:
        if self.policy == "priority":
            self.push(r)  # order is by key anyway
        else:
            self.groups[r.group] += 1
            self._dq.appendleft(r)

    def _left(self, r: Request) -> None:
        self.groups[r.group] -= 1
        if not self.groups[r.group]:
            del self.groups[r.group]

    def in_order(self):
        """The waiting requests in the order they are admitted (a sort of the heap under the priority policy)."""
        if self.policy == "priority":
            return (e[-1] for e in sorted(self._heap) if e[-1].request_id not in self._removed)
        return iter(self._dq)

    def take(self, r: Request) -> None:
        """Remove `r`, found by in_order(), to run it."""
        if r is self.peek():
            self.pop()
        elif self.policy == "priority":
            self._heap = [e for e in self._heap if e[-1] is not r]
            heapq.heapify(self._heap)
            self._left(r)
        else:
            self._dq.remove(r)
            self._left(r)

    def _clean(self) -> None:
        while self._heap and self._heap[0][-1].request_id in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[-1].request_id)

    def peek(self) -> Request | None:
        if self.policy == "priority":
            self._clean()
            return self._heap[0][-1] if self._heap else None
        return self._dq[0] if self._dq else None

    def pop(self) -> Request:
        if self.policy == "priority":
            self._clean()
            r = heapq.heappop(self._heap)[-1]
        else:
            r = self._dq.popleft()
        self._left(r)
        return r

    def remove(self, r: Request) -> None:
        if self.policy == "priority":
            self._removed.add(r.request_id)
        else:
            self._dq.remove(r)
        self._left(r)

    def __len__(self) -> int:
        if self.policy == "priority":
            return sum(1 for *_, r in self._heap if r.request_id not in self._removed)
        return len(self._dq)
