"""Sending a request's core requests (its n sequences; the prompts of a prompt list share one window) to the engine
cores through its admission window (kestrel/frontend/admission.py): each holds a slot of the window from when it is
sent until it finishes or leaves, and the ones that find no free slot go in as earlier ones finish."""
from __future__ import annotations

import asyncio
import uuid

from kestrel.engine.messages import EngineCoreRequest
from kestrel.frontend.admission import AdmissionPolicy, AdmissionWindow
from kestrel.frontend.request_metrics import RequestMetricsSink, RequestTiming
from kestrel.ipc.core_client import EngineCoreClient


class ChildSender:
    """`metrics`: told which engine core each core request went to (None: no metrics)."""

    def __init__(self, client: EngineCoreClient, metrics: RequestMetricsSink | None):
        self.client, self.metrics = client, metrics
        self.windows: dict[str, AdmissionWindow] = {}  # core request in the engine -> its request's window
        self.policy = AdmissionPolicy()  # the windows' shared view: is anybody else being served?

    def new_window(self, size: int, contended: int) -> AdmissionWindow:
        return AdmissionWindow(size, contended, self.policy, group_id=uuid.uuid4().hex)

    def send(self, core_reqs: list[EngineCoreRequest], window: AdmissionWindow, timing: RequestTiming,
             errors: asyncio.Queue) -> asyncio.Task | None:
        """Every core request now if the window has room for all (the usual case; an error raises here); else a
        task that sends each when a slot frees, putting an error that stops it on `errors`."""
        if not window.try_take(len(core_reqs)):
            return asyncio.create_task(self._send_as_slots_free(core_reqs, window, timing, errors))
        for k, r in enumerate(core_reqs):
            try:
                self._send_one(r, window, timing)
            except BaseException:
                window.give(len(core_reqs) - k - 1)
                raise
        return None

    def _send_one(self, r: EngineCoreRequest, window: AdmissionWindow, timing: RequestTiming) -> None:
        """Send one core request holding a slot of `window` (given back when it finishes or leaves)."""
        self.windows[r.request_id] = window
        try:
            timing.engine = self.client.add_request(r)
        except BaseException:
            self.windows.pop(r.request_id, None)
            window.give(1)
            raise
        if self.metrics is not None:
            self.metrics.on_routed(timing.engine)

    async def _send_as_slots_free(self, core_reqs, window: AdmissionWindow, timing: RequestTiming,
                                  errors: asyncio.Queue) -> None:
        try:
            for r in core_reqs:
                await window.take()
                self._send_one(r, window, timing)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - the stream raises it
            errors.put_nowait(e)

    def leave(self, request_ids) -> None:
        """These core requests have finished or left the engine: their slots go back to their windows."""
        for rid in request_ids:
            w = self.windows.pop(rid, None)
            if w is not None:
                w.give(1)
