"""CUDA graphs for verify steps (speculative decoding): b requests with d drafts each, so b * (d + 1) tokens of
query length d + 1, one graph per draft count d = 1..k and captured batch size (up to disable_by_batch_size). A
verify step whose requests have different draft counts (or where a decode or prefill row rides along) runs
eagerly.

The step's inputs are staged as for an eager step; the batch is padded up to the next captured size with requests
that compute k + 1 queries over themselves (seq_len k + 1 at positions 0..k, slots -1: they read some block and
write nothing). Only builders that declare "verify" in graph_steps are captured (the plain paged metadata: the
query positions come from query_start_loc and seq_lens on the device, and their prefill kernels size their grids
from the token and request counts alone, so one graph serves every step of its size)."""
from __future__ import annotations

import logging

import torch

from kestrel.core.device import to_device
from kestrel.core.step import logits_positions
from kestrel.worker.cuda_graphs import DecodeGraphs, GraphSet

logger = logging.getLogger(__name__)


def verify_graphs_supported(parts) -> bool:
    return all("verify" in b.graph_steps for b in parts.builders)


class VerifyGraphs(DecodeGraphs):
    kind = "verify "

    def __init__(self, parts, sizes: list[int], k: int, pool=None):
        super().__init__(parts, [s for s in sizes if s * (k + 1) <= parts.buffers.max_tokens])
        self.k, self.q, self.pool = k, k + 1, pool
        dev = self.buf.device
        self.starts = torch.arange(self.buf.max_reqs + 1, dtype=torch.int32, device=dev) * self.q
        self.pad_positions = torch.arange(self.q, dtype=torch.int64, device=dev).repeat(self.buf.max_reqs)

    def fits(self, chunks) -> bool:
        """Is this step a uniform verify step (every row samples after exactly k drafts)?"""
        return all(len(c.draft_token_ids) == self.k and c.num_new_tokens == self.q for c in chunks)

    def _context(self, b: int):
        if b not in self.contexts:
            self.contexts[b] = self.parts.metadata(b * self.q, b, 0, self.q, self.max_seq_len, self.width,
                                                    capture=True)
        return self.contexts[b]

    def _pad(self, b: int, padded: int) -> None:
        """Rows b..padded of the buffers become self-contained dummy requests."""
        buf, q = self.buf, self.q
        buf.input_ids[b * q:padded * q].zero_()
        buf.positions[..., b * q:padded * q].copy_(self.pad_positions[:(padded - b) * q])
        buf.query_start_loc[b + 1:padded + 1].copy_(self.starts[b + 1:padded + 1])
        buf.seq_lens[b:padded].fill_(q)
        buf.slot_mapping[:, b * q:padded * q].fill_(-1)

    def _prepare_capture(self, b: int) -> None:
        self._pad(0, b)

    @torch.inference_mode()
    def run(self, b: int) -> torch.Tensor:
        """One eager forward of the padded batch `b` from the buffers; its logits at every token."""
        n = b * self.q
        hidden = self.model(self.buf.input_ids[:n], self.buf.positions[..., :n], self._context(b))
        return self.model.compute_logits(hidden)

    def replay(self, b: int, padded: int) -> torch.Tensor:
        """Logits at every token of the step's b requests (token order). Without a captured graph (CPU), the
        padded batch runs eagerly: the same inputs, so tests exercise the padding there."""
        self._pad(b, padded)
        self.replays += 1
        if padded in self.graphs:
            self.graphs[padded].replay()
            return self.logits[padded][:b * self.q]
        return self.run(padded)[:b * self.q]


class VerifyGraphSet(GraphSet):
    """Verify graphs per draft count d = 1..k: a step whose requests all verify d drafts replays a graph of d."""

    def __init__(self, by_drafts: dict[int, VerifyGraphs]):
        self.by_drafts = by_drafts

    def step_key(self, chunks, states, meta):
        vg = self.select(chunks)
        padded = vg.padded_size(meta.num_reqs) if vg is not None else None
        return (vg, padded) if padded is not None else None

    def step_logits(self, chunks, meta, key):
        """Every row verifies k drafts: its logits at all tokens, then the sampling rows."""
        vg, padded = key
        rows = to_device(logits_positions(chunks, meta.query_start_loc_cpu), torch.int64, vg.buf.device)
        return vg.replay(meta.num_reqs, padded)[rows]

    def select(self, chunks) -> VerifyGraphs | None:
        graphs = self.by_drafts.get(len(chunks[0].draft_token_ids))
        return graphs if graphs is not None and graphs.fits(chunks) else None

    @property
    def replays(self) -> int:
        return sum(g.replays for g in self.by_drafts.values())

    @property
    def capture_seconds(self) -> float:
        return sum(g.capture_seconds for g in self.by_drafts.values())


def capture_verify_graphs(parts, spec, decode_graphs) -> VerifyGraphSet | None:
    """Where decode graphs are captured and the backends allow it: verify graphs for 1..k drafts a request at the
    decode graphs' batch sizes up to disable_by_batch_size. A failed capture logs and leaves verify steps eager."""
    if spec is None or decode_graphs is None or not verify_graphs_supported(parts):
        return None
    limit = spec.disable_by_batch_size or parts.config.scheduler.max_num_seqs
    sizes = [s for s in decode_graphs.sizes if s <= limit]
    by_drafts, pool = {}, decode_graphs.pool
    try:
        for d in range(spec.num_speculative_tokens, 0, -1):  # the most tokens first: the others reuse its pool
            graphs = VerifyGraphs(parts, sizes, d, pool)
            if graphs.sizes:
                graphs.capture()
                by_drafts[d], pool = graphs, graphs.pool
    except Exception as e:  # noqa: BLE001  (an optimisation: eager verify steps stay correct)
        logger.warning("verify CUDA graphs not captured (%s: %s); verify steps run eagerly", type(e).__name__, e)
        torch.cuda.synchronize()
        return None
    return VerifyGraphSet(by_drafts) if by_drafts else None
