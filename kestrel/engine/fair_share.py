"""Fair share between request groups (a group: the sequences of one API request, `Request.group`).

While requests of more than one group are in the scheduler, each group runs at most `cap` sequences a step. A
group's excess running sequences (those with the least computed work, the newest on ties) pause: they keep their
blocks and slot and sit the step out, so another user's step costs about what it costs beside `cap` rows, not
beside the whole big request. The scheduler preempts a paused sequence only where a newcomer of another group
needs a sequence slot or blocks, and when the pool runs dry paused sequences go first. Waiting sequences of a group
at its cap are passed over. A group alone is never capped."""
from __future__ import annotations

from collections import Counter

from kestrel.engine.request import Request
from kestrel.engine.waiting_queue import WaitingQueue


class FairShare:
    def __init__(self, contended_cap: int | None):
        self.contended_cap = contended_cap  # None: the rule is off
        self.group_sizes: Counter[str] = Counter()  # live (running or waiting) requests per request group
        self.num_paused_steps = 0  # steps in which the rule left running sequences out

    def joined(self, req: Request) -> None:
        self.group_sizes[req.group] += 1

    def left(self, req: Request) -> None:
        self.group_sizes[req.group] -= 1
        if not self.group_sizes[req.group]:
            del self.group_sizes[req.group]

    def cap(self) -> int | None:
        """This step's cap on one group's running sequences: None while at most one group has work."""
        return self.contended_cap if len(self.group_sizes) > 1 else None

    def paused(self, running: list[Request], cap: int | None) -> list[Request]:
        """The running requests over their group's cap, least computed work first (then the newest): left out of
        this step, and the first to preempt where a newcomer needs room. Counts the step when any pause."""
        if cap is None:
            return []
        groups: dict[str, list[tuple[int, int, Request]]] = {}
        for i, r in enumerate(running):  # running is in admission order
            groups.setdefault(r.group, []).append((r.num_computed_tokens, -i, r))
        paused = []
        for rows in groups.values():
            if len(rows) > cap:
                rows.sort(key=lambda e: e[:2])
                paused += rows[:len(rows) - cap]
        self.num_paused_steps += bool(paused)
        return [r for *_, r in sorted(paused, key=lambda e: e[:2])]

    @staticmethod
    def next_waiting(waiting: WaitingQueue, running_per_group: Counter | None, cap: int | None) -> Request | None:
        """The waiting request to admit next: the queue's head, or under a cap the first whose group is below it."""
        if cap is None:
            return waiting.peek()
        if all(running_per_group[g] >= cap for g in waiting.groups):
            return None
        return next((r for r in waiting.in_order() if running_per_group[r.group] < cap), None)
