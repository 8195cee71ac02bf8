"""The chained drafts of an EAGLE-3 draft step after its first forward (kestrel/spec_decode/eagle3_drafter.py): k - 1
forwards of one token per drafting request, each at the next position, from static buffers, so that they are
one shape per batch size and captured as CUDA graphs per batch bucket (the decode graphs' sizes) where the runner
captures graphs. Without a captured graph (the CPU, a batch above the largest bucket) the same code runs eagerly,
so tests exercise the padding and the in-graph slot arithmetic there.

Everything a graph reads is staged into the buffers before a replay: each request's first chained position, its
block table row and held block count (in the draft's KV group), the first forward's output and first draft. Each
chained forward computes its slots and sequence lengths on the device; a position in a block the request does not
hold (or past the context) gets slot -1 and sequence length 0, which the kernels treat as an empty row (it writes
and reads nothing), and its draft is dropped on the host (`num_valid`). Padding rows hold no block: empty too.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from kestrel.attention.backend import CommonAttentionMetadata
from kestrel.attention.layer import ForwardContext
from kestrel.core.device import to_device

logger = logging.getLogger(__name__)


class DraftChain:
    def __init__(self, drafter, max_batch: int, max_blocks: int, hidden_size: int):
        self.drafter, self.steps, self.max_batch = drafter, drafter.k - 1, max_batch
        dev = drafter.device
        self.first_pos = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.held = torch.zeros(max_batch, dtype=torch.int64, device=dev)  # blocks held in the draft's group
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=dev)
        self.hidden = torch.zeros(max_batch, hidden_size, dtype=drafter.dtype, device=dev)
        self.token = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.seq_lens = [torch.zeros(max_batch, dtype=torch.int32, device=dev) for _ in range(self.steps)]
        self.slots = [torch.zeros(max_batch, dtype=torch.int64, device=dev) for _ in range(self.steps)]
        self.sizes: list[int] = []
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.drafts: dict[int, torch.Tensor] = {}  # a graph's output [b, k - 1]
        self._contexts: dict[int, list[ForwardContext]] = {}
        self.replays = 0

    def contexts(self, b: int) -> list[ForwardContext]:
        """Each chained forward's context over the first `b` rows of the buffers (what a graph keeps reading)."""
        if b not in self._contexts:
            d = self.drafter
            gid, builder = d.attn.group_id, d.kv.builder
            metas = [builder.build_for_capture(
                CommonAttentionMetadata(b, b, b, 1, d.max_positions, self.query_start_loc[:b + 1],
                                        self.seq_lens[j][:b]), self.tables[:b], self.slots[j][:b])
                for j in range(self.steps)]
            self._contexts[b] = [ForwardContext([None] * gid + [m]) for m in metas]
        return self._contexts[b]

    def forward(self, b: int) -> torch.Tensor:
        """The chained drafts [b, k - 1] of the buffers' first `b` rows: device work of fixed shapes."""
        d, bs = self.drafter, self.drafter.kv.block_size
        last, token, drafts = self.hidden[:b], self.token[:b], []
        for j, ctx in enumerate(self.contexts(b)):
            pos = self.first_pos[:b] + j
            held = (pos // bs < self.held[:b]) & (pos < d.max_positions)
            pos = torch.where(held, pos, 0)
            block = self.tables[:b].gather(1, (pos // bs)[:, None])[:, 0].to(torch.int64)
            self.slots[j][:b].copy_(torch.where(held, block * bs + pos % bs, -1))
            self.seq_lens[j][:b].copy_(torch.where(held, pos + 1, 0))
            d.kv.builder.update_captured(ctx.attn_metadata[-1])
            last = d.layer(token, last, pos, ctx)
            token = d.draft_token_ids(last)
            drafts.append(token)
        return torch.stack(drafts, dim=1)

    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> float:
        t0, pool = time.perf_counter(), None
        self.sizes = sorted(s for s in sizes if s <= self.max_batch)
        self.held.zero_()  # every row empty
        for b in reversed(self.sizes):  # largest first: the others reuse its memory pool
            for _ in range(2):
                self.forward(b)  # warm-up outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.drafts[b] = self.forward(b)
            pool = pool or g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if self.sizes:
            logger.info("Captured %d draft CUDA graphs (batch sizes %s..%s) in %.1f s", len(self.graphs),
                        self.sizes[0], self.sizes[-1], dt)
        return dt

    def run(self, table_rows: list[int], first_pos: list[int], hidden: torch.Tensor,
            token: torch.Tensor) -> torch.Tensor:
        """The chained drafts [B, k - 1] of B requests (their block table rows, the position of their first chained
        forward, the first forward's output [B, H] and first draft [B]): a replay of the bucket's graph, else
        eager."""
        d, b = self.drafter, len(table_rows)
        rows, gid = d.kv.block_rows, d.attn.group_id
        held = rows.lens[table_rows, gid]
        width = max(1, int(held.max()))
        self.first_pos[:b].copy_(to_device(first_pos, torch.int64, d.device))
        self.held[:b].copy_(to_device(held, torch.int64, d.device))
        self.tables[:b, :width].copy_(to_device(rows.ids[table_rows, gid, :width], torch.int32, d.device))
        self.hidden[:b].copy_(hidden)
        self.token[:b].copy_(token)
        i = bisect.bisect_left(self.sizes, b)
        padded = self.sizes[i] if i < len(self.sizes) else b
        self.held[b:padded].zero_()
        if padded in self.graphs:
            self.replays += 1
            self.graphs[padded].replay()
            return self.drafts[padded][:b]
        return self.forward(padded)[:b]

    def num_valid(self, table_row: int, first_pos: int) -> int:
        """How many of a request's chained drafts are real: those before its first position outside its blocks
        (or past the context)."""
        d = self.drafter
        n = 0
        while n < self.steps and first_pos + n < d.max_positions and d.kv.owns(table_row, first_pos + n):
            n += 1
        return n
