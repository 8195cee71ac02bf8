"""CUDA graphs for decode: one graph per captured batch size, replayed from the persistent input buffers.
A decode batch is padded up to the next captured size; padded rows have seq_len 0 and slot -1, which the
attention kernels treat as empty (zeros out, nothing written)."""
from __future__ import annotations

import bisect
import logging
import time

import torch

from kestrel.attention.backend import AttentionMetadata
from kestrel.attention.layer import ForwardContext

logger = logging.getLogger(__name__)


def default_graph_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256]  # padding to the next size wastes < 1/3
    return [s for s in sizes if s <= max_num_seqs] or [1]


class DecodeGraphs:
    def __init__(self, model, buffers, kv_caches, sizes: list[int], max_seq_len: int):
        self.model, self.buf, self.kv_caches = model, buffers, kv_caches
        self.sizes = sorted(sizes)
        self.max_seq_len = max_seq_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self.arange = torch.arange(buffers.max_reqs + 1, dtype=torch.int32, device=buffers.device)

    def _meta(self, b: int) -> AttentionMetadata:
        buf = self.buf
        return AttentionMetadata(num_tokens=b, num_reqs=b, num_decodes=b, max_query_len=1,
                                 max_seq_len=self.max_seq_len, query_start_loc=buf.query_start_loc[:b + 1],
                                 seq_lens=buf.seq_lens[:b], block_tables=buf.block_tables[:b],
                                 slot_mapping=buf.slot_mapping[:b])

    @torch.inference_mode()
    def run(self, b: int) -> torch.Tensor:
        """One eager decode forward of the padded batch `b` from the buffers; returns its logits."""
        hidden = self.model(self.buf.input_ids[:b], self.buf.positions[:b],
                            ForwardContext(self._meta(b), self.kv_caches))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> float:
        t0 = time.perf_counter()
        buf = self.buf
        buf.seq_lens.zero_()
        buf.slot_mapping.fill_(-1)
        buf.query_start_loc.copy_(torch.arange(buf.max_reqs + 1, dtype=torch.int32, device=buf.device))
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
        logger.info("Captured %d CUDA graphs (batch sizes %s..%s) in %.1f s", len(self.graphs), self.sizes[0],
                    self.sizes[-1], dt)
        return dt

    def padded_size(self, b: int) -> int | None:
        i = bisect.bisect_left(self.sizes, b)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, b: int, padded: int) -> torch.Tensor:
        buf = self.buf
        if padded > b:
            buf.seq_lens[b:padded].zero_()
            buf.slot_mapping[b:padded].fill_(-1)
            buf.input_ids[b:padded].zero_()
            buf.positions[b:padded].zero_()
            buf.query_start_loc[b + 1:padded + 1].copy_(self.arange[b + 1:padded + 1])
        self.graphs[padded].replay()
        return self.logits[padded][:b]
