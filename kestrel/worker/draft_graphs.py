"""CUDA graphs of a runner drafter's k chained forwards (WindowDrafter.chain over the left-padded window batch
[B, W]: W fixed, B padded up to a bucket), one graph per bucket, replayed after each step instead of k eager
forwards and their launches. The windows are staged into static buffers; the padding rows are empty windows (no
valid position: each query sees itself only, so they stay finite) whose drafts are dropped. Without a captured
graph (the CPU, a batch above the largest bucket) the same padded batch runs eagerly, so tests exercise the
padding there. Drafters whose layers cannot be captured (a host sync inside: transformers' eager MoE experts, as
in DeepSeek's MTP layers) set `graphable = False` and draft eagerly."""
from __future__ import annotations

import bisect
import logging
import time

import torch

logger = logging.getLogger(__name__)


class DraftGraphs:
    def __init__(self, drafter, sizes: list[int], hidden_size: int):
        self.drafter, self.sizes = drafter, sorted(sizes)
        b, w, dev = self.sizes[-1], drafter.window, drafter.device
        self.pos = torch.zeros(b, w, dtype=torch.int64, device=dev)
        self.ids = torch.zeros(b, w, dtype=torch.int64, device=dev)
        self.h = torch.zeros(b, w, hidden_size, dtype=drafter.dtype, device=dev)
        self.valid = torch.zeros(b, w, dtype=torch.bool, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.drafts: dict[int, torch.Tensor] = {}  # a graph's output [b, k]
        self.replays = 0

    def _chain(self, b: int) -> torch.Tensor:
        return self.drafter.chain(self.pos[:b], self.ids[:b], self.h[:b], self.valid[:b])

    @torch.inference_mode()
    def capture(self) -> float:
        t0, pool = time.perf_counter(), None
        for b in reversed(self.sizes):  # largest first: the others reuse its memory pool
            for _ in range(2):
                self._chain(b)  # warm-up outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.drafts[b] = self._chain(b)
            pool = pool or g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        logger.info("Captured %d draft CUDA graphs (batch sizes %s..%s) in %.1f s", len(self.graphs), self.sizes[0],
                    self.sizes[-1], dt)
        return dt

    def run(self, pos: torch.Tensor, ids: torch.Tensor, h: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The drafts [B, k] of B staged windows: a replay of the bucket's graph (eager where none is captured)."""
        b = pos.shape[0]
        i = bisect.bisect_left(self.sizes, b)
        if i == len(self.sizes):
            return self.drafter.chain(pos, ids, h, valid)
        padded = self.sizes[i]
        self.pos[:b].copy_(pos)
        self.ids[:b].copy_(ids)
        self.h[:b].copy_(h)
        self.valid[:b].copy_(valid)
        self.valid[b:padded].zero_()
        self.replays += 1
        if padded in self.graphs:
            self.graphs[padded].replay()
            return self.drafts[padded][:b]
        return self._chain(padded)[:b]


def capture_draft_graphs(drafter, decode_graphs) -> DraftGraphs | None:
    """Where decode graphs are captured and the drafter allows it: draft graphs at the decode graphs' batch sizes
    up to the drafter's max_batch. A failed capture logs and leaves drafting eager (drafts cost acceptance only)."""
    if drafter is None or decode_graphs is None or not drafter.graphable:
        return None
    sizes = [s for s in decode_graphs.sizes if drafter.max_batch is None or s <= drafter.max_batch]
    if not sizes:
        return None
    with torch.inference_mode():
        width = drafter.window_hidden(drafter.capture.buffer[:1]).shape[-1]  # the draft's hidden input
    graphs = DraftGraphs(drafter, sizes, width)
    try:
        graphs.capture()
    except Exception as e:  # noqa: BLE001  (an optimisation: eager drafting stays correct)
        logger.warning("draft CUDA graphs not captured (%s: %s); drafting runs eagerly", type(e).__name__, e)
        torch.cuda.synchronize()
        return None
    return graphs
