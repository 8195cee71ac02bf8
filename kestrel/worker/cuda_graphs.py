"""CUDA graphs for decode: one graph per captured batch size, replayed from the persistent input buffers.
A decode batch is padded up to the next captured size; each group's metadata builder prepares the padded rows
before a replay (for paged attention: seq_len 0 and slot -1, which the kernels treat as empty)."""
from __future__ import annotations

import bisect
import logging
import time

import torch

logger = logging.getLogger(__name__)


def default_graph_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256]  # padding to the next size wastes < 1/3
    return [s for s in sizes if s <= max_num_seqs] or [1]


class DecodeGraphs:
    def __init__(self, runner, sizes: list[int]):
        self.runner, self.model, self.buf = runner, runner.model, runner.buffers
        self.sizes = sorted(sizes)
        self.max_seq_len = runner.max_model_len
        self.width = self.buf.max_blocks
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.contexts: dict[int, object] = {}
        self.pool = None
        self.arange = torch.arange(self.buf.max_reqs + 1, dtype=torch.int32, device=self.buf.device)
        self.replays = 0  # steps served by a graph (tests check that graphs were used)

    def _context(self, b: int):
        if b not in self.contexts:
            self.contexts[b] = self.runner.metadata(b, b, b, 1, self.max_seq_len, self.width, capture=True)
        return self.contexts[b]

    @torch.inference_mode()
    def run(self, b: int) -> torch.Tensor:
        """One eager decode forward of the padded batch `b` from the buffers; returns its logits."""
        hidden = self.model(self.buf.input_ids[:b], self.buf.positions[:b], self._context(b))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> float:
        t0 = time.perf_counter()
        self._prepare_capture()
        for b in reversed(self.sizes):  # largest first: later graphs reuse its memory pool
            for _ in range(2):
                self.run(b)  # warm-up (Triton autotune / JIT) outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.logits[b] = self.run(b)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        logger.info("Captured %d %sCUDA graphs (batch sizes %s..%s) in %.1f s", len(self.graphs), self.kind,
                    self.sizes[0], self.sizes[-1], dt)
        return dt

    kind = ""  # in the log line

    def _prepare_capture(self) -> None:
        """The buffers the capture runs from: every row an empty decode (seq_len 0, slot -1)."""
        buf = self.buf
        buf.seq_lens.zero_()
        buf.slot_mapping.fill_(-1)
        buf.query_start_loc.copy_(self.arange)

    def padded_size(self, b: int) -> int | None:
        i = bisect.bisect_left(self.sizes, b)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, b: int, padded: int) -> torch.Tensor:
        buf = self.buf
        if padded > b:
            buf.input_ids[b:padded].zero_()
            buf.positions[b:padded].zero_()
            buf.query_start_loc[b + 1:padded + 1].copy_(self.arange[b + 1:padded + 1])
            for builder, meta in zip(self.runner.builders, self.contexts[padded].attn_metadata):
                builder.prepare_replay(meta, b, padded)
        self.graphs[padded].replay()
        self.replays += 1
        return self.logits[padded][:b]
