"""Where a KV tier's copies run (kestrel/worker/kv_host_tier.py), and the bookkeeping of device->host copies in
flight. On CUDA the copies go on a side stream into pinned host memory and overlap the forward: the side stream
first waits for the work queued on the main stream (the saves read what earlier forwards computed), a step's
loads end with an event the main stream waits on before its forward (it reads those blocks), and a save's event
is waited on only by a later forward that writes a block the save still reads (a block the scheduler evicted and
reallocated, or a preempted request's block taken again) or by a reader of its host slot on the host (a disk
write). Elsewhere (the CPU) there is no stream and no event: the same calls copy synchronously."""
from __future__ import annotations

import contextlib

import torch


class CopyStream:
    """The side stream of a device (None off CUDA: synchronous copies, every event None)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def context(self):
        """Copies queued inside run on the side stream, after everything queued on the main stream so far."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        return torch.cuda.stream(self.stream)

    def record(self):
        """An event after the copies queued so far (None: they are done)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    @staticmethod
    def wait(event) -> None:
        """The main stream's next work waits for `event` (the host does not)."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


def done(event) -> bool:
    return event is None or event.query()


class PendingSaves:
    """Device->host copies in flight: (event, the (unit, device index) entries they read, the (unit, host slot)
    entries they write). A device entry being read is never written before its copy is done: `guard` makes the
    main stream wait for the copies reading any entry a step writes; `sync` waits on the host for the copies
    writing given host slots; `poll` forgets the copies done."""

    def __init__(self):
        self.items: list[tuple[object, set, set]] = []

    def __len__(self) -> int:
        return len(self.items)

    def add(self, event, reads: set, writes: set) -> None:
        if event is not None and reads:
            self.items.append((event, reads, writes))

    def poll(self) -> None:
        self.items = [it for it in self.items if not done(it[0])]

    def guard(self, written, wait) -> int:
        """`wait(event)` for each copy in flight that reads an entry of `written` (a set of (unit, device index),
        or None: every entry); returns how many. Those copies are forgotten (the main stream is behind them)."""
        keep, waited = [], 0
        for it in self.items:
            if written is None or not it[1].isdisjoint(written):
                wait(it[0])
                waited += 1
            else:
                keep.append(it)
        self.items = keep
        return waited

    def sync(self, slots: set) -> None:
        """Wait on the host for the copies into the (unit, host slot) entries `slots`."""
        for event, _, writes in self.items:
            if not writes.isdisjoint(slots):
                event.synchronize()

    def busy(self, unit: int, index: int) -> bool:
        """Whether a copy in flight still reads device entry `index` of `unit`."""
        return any((unit, index) in reads and not done(event) for event, reads, _ in self.items)
