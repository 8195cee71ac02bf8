"""CUDA graphs for small prefill steps: a step of one request's chunk alone (a short prompt, the rest of a
prefix-cache hit, the last chunk of a chunked prefill), n tokens, replays the graph captured for the next token
bucket Q >= n (16, 32, ... up to --cuda-graph-prefill-max-tokens). Eagerly such a step is hundreds of kernel
launches from Python, most of a short prompt's time to first token.

The graph of bucket Q runs two requests: the real one (tokens 0..n-1, its seq_len, block table row and slots as
staged for an eager step) and a pad request of the Q - n tokens after it, at positions 0..Q-n-1 with seq_len
Q - n and slots -1 (it reads some block and writes nothing, like VerifyGraphs' dummy requests; empty where
n == Q). Logits are computed at one row, the real request's last token (an index tensor filled before the
replay). Steps with decode rows, drafts, prompt logprobs or a bidirectional prefix run eagerly, as do steps an
add-on keeps off the graphs (step_graph_ok: merged image rows) and the step that calibrates --calculate-kv-scales.

Backends: the plain paged metadata (AttentionMetadataBuilder: the varlen prefill kernel sizes its grid from
the token and request counts and finds each query's sequence on the device), and MLA without the DSA
selection (MLAMetadataBuilder: a captured step is all absorbed, each token attending over its own prefix in
latent space; the Triton decode kernel takes it as one row per token, MLAMetadataBuilder.update_captured).
Absorbed attention costs each token its whole context, so MLA graphs serve contexts up to the largest bucket;
longer ones (a long cached prefix) take the eager dense path."""
from __future__ import annotations

import logging

import torch

from kestrel.worker.cuda_graphs import DecodeGraphs

logger = logging.getLogger(__name__)

BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)


def prefill_graphs_supported(parts) -> bool:
    return all("prefill" in b.graph_steps for b in parts.builders)


def prefill_graph_sizes(parts) -> list[int]:
    """The token buckets up to --cuda-graph-prefill-max-tokens and the buffers, and none beyond the first that
    holds a whole step (--max-num-batched-tokens); none where the backends have no prefill graphs or the buffers
    hold a single request (no room for the pad request)."""
    cap = min(parts.config.compilation.cuda_graph_prefill_max_tokens, parts.buffers.max_tokens)
    if parts.buffers.max_reqs < 2 or not prefill_graphs_supported(parts):
        return []
    sizes = [s for s in BUCKETS if s <= cap]
    budget = parts.config.scheduler.max_num_batched_tokens
    return [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] < budget]


class PrefillGraphs(DecodeGraphs):
    kind, unit = "prefill ", "tokens"

    def __init__(self, parts, sizes: list[int], pool=None):
        super().__init__(parts, sizes)
        self.pool = pool
        if any(b.prefill_graph_per_token for b in parts.builders):  # absorbed MLA: a table row per token
            self.max_seq_len = min(self.max_seq_len, max(self.sizes, default=0))
        # --calculate-kv-scales: the first batch that writes K/V sets the scales, in the eager forward
        self.calibrating = ([x for x in parts.loaded.context.attention_layers.values()
                             if hasattr(x, "calibrate_kv_scales")] if parts.config.cache.calculate_kv_scales else [])
        dev = self.buf.device
        self.last = torch.zeros(1, dtype=torch.int64, device=dev)  # the real request's last token
        self.pad_positions = torch.arange(max(self.sizes, default=0), dtype=torch.int64, device=dev)

    def fits(self, chunks, states, meta) -> bool:
        """Is this step one prefill chunk alone, without drafts, prompt logprobs or a bidirectional prefix, whose
        context the graphs cover, and no KV scale left to calibrate?"""
        return (len(chunks) == 1 and meta.num_decodes == 0 and not chunks[0].draft_token_ids
                and states[0].sampling_params.prompt_logprobs is None and meta.bidirectional_lens_cpu is None
                and meta.max_seq_len <= self.max_seq_len and not any(x.calibrate_kv_scales for x in self.calibrating))

    def step_key(self, chunks, states, meta):
        return self.padded_size(meta.num_tokens) if self.fits(chunks, states, meta) else None

    def step_logits(self, chunks, meta, key):
        return self.replay(meta.num_tokens, key)  # the logits at its last token

    def _context(self, q: int):
        if q not in self.contexts:
            self.contexts[q] = self.parts.metadata(q, 2, 0, q, self.max_seq_len, self.width, capture=True)
        return self.contexts[q]

    def _pad(self, n: int, q: int) -> None:
        """Tokens n..q-1 of the buffers become the pad request; logits at token n - 1."""
        buf = self.buf
        buf.input_ids[n:q].zero_()
        buf.positions[..., n:q].copy_(self.pad_positions[:q - n])
        buf.query_start_loc[2:3].fill_(q)
        buf.seq_lens[1:2].fill_(q - n)
        buf.slot_mapping[:, n:q].fill_(-1)
        self.last.fill_(n - 1)

    def _prepare_capture(self, q: int) -> None:
        """A one-token real request (position 0, slot -1) and the pad request after it."""
        buf = self.buf
        buf.query_start_loc[:2].copy_(self.arange[:2])
        buf.seq_lens[:1].fill_(1)
        buf.positions[..., :1].zero_()
        buf.slot_mapping[:, :1].fill_(-1)
        self._pad(1, q)

    @torch.inference_mode()
    def run(self, q: int) -> torch.Tensor:
        """One eager forward of bucket `q` from the buffers (what a capture records); the logits [1, vocab] at
        the real request's last token."""
        ctx = self._context(q)
        for builder, meta in zip(self.parts.builders, ctx.attn_metadata):
            builder.update_captured(meta)
        hidden = self.model(self.buf.input_ids[:q], self.buf.positions[..., :q], ctx)
        return self.model.compute_logits(hidden.index_select(0, self.last))

    def replay(self, n: int, q: int) -> torch.Tensor:
        """The logits [1, vocab] at the last of the step's n tokens. Without a captured graph (CPU) the padded
        batch runs eagerly from the same buffers and captured metadata, so tests exercise the padding there."""
        self._pad(n, q)
        self.replays += 1
        if q in self.graphs:
            self.graphs[q].replay()
            return self.logits[q]
        return self.run(q)


def capture_prefill_graphs(parts, decode_graphs) -> PrefillGraphs | None:
    """Where decode graphs are captured and the backends allow it: prefill graphs per token bucket, in the decode
    graphs' memory pool. A failed capture logs and leaves prefill steps eager."""
    sizes = prefill_graph_sizes(parts) if decode_graphs is not None else []
    if not sizes:
        return None
    try:
        graphs = PrefillGraphs(parts, sizes, decode_graphs.pool)
        graphs.capture()
    except Exception as e:  # noqa: BLE001  (an optimisation: eager prefill steps stay correct)
        logger.warning("prefill CUDA graphs not captured (%s: %s); prefill steps run eagerly", type(e).__name__, e)
        torch.cuda.synchronize()
        return None
    return graphs
