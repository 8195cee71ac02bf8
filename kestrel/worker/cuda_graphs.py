"""CUDA graphs for decode: one graph per captured batch size, replayed from the persistent input buffers.
A decode batch is padded up to the next captured size; each group's metadata builder prepares the padded rows
before a replay (for paged attention: seq_len 0 and slot -1, which the kernels treat as empty).

A builder whose decode steps take one of several forms (AttentionMetadataBuilder.graph_variants; DSA: the sparse
or the dense route) gets one set of graphs per form (DecodeGraphForms); a step replays the set of the form its
builders decided when they built its metadata, so capture and replay never disagree on the route.

Every set of graphs that serves steps is a GraphSet: the runner keeps a list of them (decode first, then those the
add-ons add, e.g. verify steps, then one-request prefills) and replays the first whose `step_key` is not None. A
set is chosen at start-up from the flags the metadata builders declare (AttentionMetadataBuilder.graph_steps),
never from their types."""
from __future__ import annotations

import bisect
import itertools
import logging
import time

import torch

logger = logging.getLogger(__name__)


def default_graph_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256]  # padding to the next size wastes < 1/3
    return [s for s in sizes if s <= max_num_seqs] or [1]


def decode_graphs(parts, sizes: list[int]):
    """The decode graphs (not yet captured): one DecodeGraphs, or one per combination of its builders'
    forms."""
    forms = list(itertools.product(*(b.graph_variants() for b in parts.builders)))
    return DecodeGraphs(parts, sizes) if len(forms) == 1 else DecodeGraphForms(parts, sizes, forms)


class GraphSet:
    """CUDA graphs that serve some steps of the parts."""

    def step_key(self, chunks, states, meta):
        """What step_logits replays for this step (its padded size, ...), or None where this set does not serve
        it (`meta`: the step's first group's attention metadata)."""
        return None

    def step_logits(self, chunks, meta, key):
        """Replay the step: the logits at its sampling rows (the verify rule's order, kestrel/core/step.py)."""
        raise NotImplementedError


class _DecodeSteps(GraphSet):
    """A step whose every row is a decode, padded up to the next captured batch size."""

    def step_key(self, chunks, states, meta):
        return self.padded_size(meta.num_reqs) if meta.num_decodes == meta.num_reqs else None

    def step_logits(self, chunks, meta, key):
        return self.replay(meta.num_reqs, key)  # every decode row samples


class DecodeGraphs(_DecodeSteps):
    def __init__(self, parts, sizes: list[int], form: tuple[str, ...] | None = None):
        """form: one of graph_variants per builder (None: what build_for_capture builds)."""
        self.parts, self.model, self.buf = parts, parts.model, parts.buffers
        self.form = form
        if form is not None:
            self.kind = "/".join(v for v in form if v) + " "
        self.sizes = sorted(sizes)
        self.max_seq_len = parts.max_model_len
        self.width = self.buf.max_blocks
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.contexts: dict[int, object] = {}
        self.pool = None
        self.arange = torch.arange(self.buf.max_reqs + 1, dtype=torch.int32, device=self.buf.device)
        self.replays = 0  # steps served by a graph (tests check that graphs were used)

    def _context(self, b: int):
        if b not in self.contexts:
            ctx = self.parts.metadata(b, b, b, 1, self.max_seq_len, self.width, capture=True)
            if self.form is not None:
                ctx.attn_metadata = [builder.captured_variant(meta, v) for builder, meta, v in
                                     zip(self.parts.builders, ctx.attn_metadata, self.form)]
            self.contexts[b] = ctx
        return self.contexts[b]

    @torch.inference_mode()
    def run(self, b: int) -> torch.Tensor:
        """One eager decode forward of the padded batch `b` from the buffers (what a capture records); returns
        its logits."""
        ctx = self._context(b)
        for builder, meta in zip(self.parts.builders, ctx.attn_metadata):
            builder.update_captured(meta)
        hidden = self.model(self.buf.input_ids[:b], self.buf.positions[..., :b], ctx)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> float:
        t0 = time.perf_counter()
        for b in reversed(self.sizes):  # largest first: later graphs reuse its memory pool
            self._prepare_capture(b)
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
        logger.info("Captured %d %sCUDA graphs (%s %s..%s) in %.1f s", len(self.graphs), self.kind, self.unit,
                    self.sizes[0], self.sizes[-1], dt)
        self.capture_seconds = dt
        return dt

    capture_seconds = 0.0

    kind, unit = "", "batch sizes"  # in the log line

    def _prepare_capture(self, b: int) -> None:
        """The buffers the capture of size `b` runs from: every row an empty decode (seq_len 0, slot -1)."""
        buf = self.buf
        buf.seq_lens.zero_()
        buf.slot_mapping.fill_(-1)
        buf.query_start_loc.copy_(self.arange)

    def padded_size(self, b: int) -> int | None:
        i = bisect.bisect_left(self.sizes, b)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, b: int, padded: int) -> torch.Tensor:
        """The logits of the step's b decode rows. Without a captured graph (CPU tests) the padded batch runs
        eagerly from the same buffers and captured metadata, so the padding and the capture path are tested
        there."""
        buf = self.buf
        if padded > b:
            buf.input_ids[b:padded].zero_()
            buf.positions[..., b:padded].zero_()
            buf.query_start_loc[b + 1:padded + 1].copy_(self.arange[b + 1:padded + 1])
            for builder, meta in zip(self.parts.builders, self._context(padded).attn_metadata):
                builder.prepare_replay(meta, b, padded)
        self.replays += 1
        if padded not in self.graphs:
            return self.run(padded)[:b]
        self.graphs[padded].replay()
        return self.logits[padded][:b]


class DecodeGraphForms(_DecodeSteps):
    """DecodeGraphs per combination of the builders' forms, in one memory pool, with DecodeGraphs' interface: a
    step replays the graphs of the forms its builders decided (step_variant) when they built its metadata."""

    def __init__(self, parts, sizes: list[int], forms: list[tuple[str, ...]]):
        self.builders = parts.builders
        self.by_form = {form: DecodeGraphs(parts, sizes, form) for form in forms}
        self.sizes = sorted(sizes)

    @property
    def pool(self):
        return list(self.by_form.values())[-1].pool

    @property
    def replays(self) -> int:
        return sum(g.replays for g in self.by_form.values())

    def capture(self) -> float:
        seconds, pool = 0.0, None
        for graphs in self.by_form.values():
            graphs.pool = pool
            seconds += graphs.capture()
            pool = graphs.pool
        self.capture_seconds = seconds
        return seconds

    capture_seconds = 0.0

    def run(self, b: int) -> None:
        """Every form's eager forward (the precompile's dry run)."""
        for graphs in self.by_form.values():
            graphs.run(b)

    def padded_size(self, b: int) -> int | None:
        return next(iter(self.by_form.values())).padded_size(b)

    def replay(self, b: int, padded: int) -> torch.Tensor:
        form = tuple(builder.step_variant() for builder in self.builders)
        return self.by_form[form].replay(b, padded)
