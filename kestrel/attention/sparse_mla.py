"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5.x) over MLA: the layer, its metadata and its one route per
step.

A lightning indexer scores every cached token s for each query token t,
    I[t, s] = sum_h w[t, h] * ReLU(q_I[t, h] . k_I[s])        (w already carries n_heads^-1/2 * head_dim^-1/2)
and MLA attends, in latent space (absorbed), only to the `index_topk` best-scoring visible tokens of each query.
The indexer keys k_I sit beside the latents in the same cache block (SparseMLASpec) and are written on every step,
whatever the route. A GLM-5.2 "shared" layer has no indexer: it reuses the top-k of the full layer before it,
which the step's metadata carries from layer to layer (`topk_indices`).

While a query sees at most `index_topk` tokens, sparse equals dense exactly, so short requests may skip the
indexer's scoring and take MLA's dense paths. The metadata builder decides once per step (`route`):
- SPARSE: every token absorbed, scored, attending to its selection;
- DENSE_PREFILL: every prefill context <= index_topk: prefills expanded through the dense MHA path
  (MLAImpl.attend_dense) and not scored; decodes scored and sparse;
- DENSE: every context of the step <= index_topk: prefills expanded, decodes absorbed over their whole context
  (the backend's plain MLA decode); nothing scored, the indexer computes its keys only.
The two dense routes need three declarations ANDed: the backend's `supports_dense_mha_prefill`, the layer class's
own `supports_dense_mha_prefill` (declared per class, never inherited: a subclass that changes the forward states
it again) and the lengths. Indexer keys are written on every route. Nothing else re-derives the route: the
model's indexer and the impl read `num_scored_tokens` from the metadata."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch

from kestrel.attention.backend import CommonAttentionMetadata
from kestrel.attention.indexer_keys import quantize_index_keys, quantize_index_queries
from kestrel.attention.mla import MLAAttention, MLAImpl, MLAMetadata, MLAMetadataBuilder
from kestrel.core.kv_spec import SparseMLASpec

SPARSE, DENSE_PREFILL, DENSE = "sparse", "dense_prefill", "dense"


def declares_dense_mha_prefill(cls: type) -> bool:
    """A class's own declaration of `supports_dense_mha_prefill`; an undeclared class has no dense path."""
    return bool(cls.__dict__.get("supports_dense_mha_prefill", False))


@dataclass
class SparseMLAMetadata(MLAMetadata):
    route: str = SPARSE
    index_topk: int = 0
    # [num_scored_tokens, k] request-local positions each scored token attends to (-1: none), written by the
    # step's latest full indexer layer and read by it and the shared layers after it
    topk_indices: torch.Tensor | None = None
    # the absorbed tokens' request (row of block_tables) and position in it, int32 [num_absorbed_tokens]
    # (None on the DENSE route, which reads neither)
    token_req: torch.Tensor | None = None
    token_pos: torch.Tensor | None = None
    # a captured decode graph's metadata: the selection reads the scores at the static width max_seq_len (the
    # graph's longest context) and each token's visible length from token_pos on the device, never a host list
    static_width: bool = False

    @property
    def num_scored_tokens(self) -> int:
        """The leading tokens the indexer scores: the absorbed ones, none on the DENSE route."""
        return 0 if self.route == DENSE else self.num_absorbed_tokens


def _sparse_fields(meta: MLAMetadata, **extra) -> SparseMLAMetadata:
    return SparseMLAMetadata(**{f.name: getattr(meta, f.name) for f in fields(meta)}, **extra)


def _as_sparse(meta: MLAMetadata, route: str, index_topk: int) -> SparseMLAMetadata:
    sparse = _sparse_fields(meta, route=route, index_topk=index_topk)
    if route == DENSE:
        return sparse
    nr, n = sparse.num_absorbed_reqs, sparse.num_absorbed_tokens
    qsl = sparse.query_start_loc[:nr + 1].long()
    steps = torch.arange(n, device=qsl.device)
    req = torch.repeat_interleave(torch.arange(nr, device=qsl.device), qsl[1:] - qsl[:-1], output_size=n)
    sparse.token_req = req.to(torch.int32)
    sparse.token_pos = (sparse.seq_lens[:nr].long()[req] - (qsl[1:][req] - steps)).to(torch.int32)
    return sparse


class SparseMLAMetadataBuilder(MLAMetadataBuilder):
    """The route per step (see the module docstring). CUDA graphs: a pure decode step takes the SPARSE or the
    DENSE route (DENSE_PREFILL needs a prefill), so one graph is captured per route where the dense routes are
    declared (else SPARSE only), and a replay runs the graph of the route build() decided for its step (the same
    rule as eager steps: DENSE while every context is <= index_topk)."""
    spec: SparseMLASpec
    graph_steps: ClassVar[frozenset[str]] = frozenset()  # a route per step: decode graphs only (per route)

    def __init__(self, spec, block_size, device):
        super().__init__(spec, block_size, device)
        self.last_route = SPARSE

    def dense_declared(self) -> bool:
        return bool(self.dense_prefill and self.spec.layer_dense_prefill)

    def route(self, c: CommonAttentionMetadata) -> str:
        if not (self.dense_declared() and c.seq_lens_cpu):
            return SPARSE
        topk, seq_lens = self.spec.index_topk, c.seq_lens_cpu[:c.num_reqs]
        if max(seq_lens, default=0) <= topk:
            return DENSE
        prefills = seq_lens[c.num_decodes:]
        return DENSE_PREFILL if prefills and max(prefills) <= topk else SPARSE

    def build(self, common, block_table, slot_mapping) -> SparseMLAMetadata:
        c, route = common, self.route(common)
        self.last_route = route
        meta = self.build_split(c, block_table, slot_mapping, c.num_reqs if route == SPARSE else c.num_decodes)
        return _as_sparse(meta, route, self.spec.index_topk)

    def build_for_capture(self, common, block_table, slot_mapping) -> SparseMLAMetadata:
        """A pure decode batch on the SPARSE route: token b is request b's one query, at position seq_lens[b] - 1
        (update_captured writes it inside the graph); padded rows (seq_len 0) sit at -1 and select nothing."""
        meta = _sparse_fields(super().build_for_capture(common, block_table, slot_mapping), route=SPARSE,
                              index_topk=self.spec.index_topk, static_width=True)
        n = meta.num_tokens
        meta.token_req = torch.arange(n, dtype=torch.int32, device=meta.seq_lens.device)
        meta.token_pos = torch.empty(n, dtype=torch.int32, device=meta.seq_lens.device)
        self.update_captured(meta)
        return meta

    def graph_variants(self) -> tuple[str, ...]:
        return (SPARSE, DENSE) if self.dense_declared() else (SPARSE,)

    def captured_variant(self, metadata: SparseMLAMetadata, variant: str) -> SparseMLAMetadata:
        return replace(metadata, route=variant)

    def step_variant(self) -> str:
        return self.last_route

    def update_captured(self, metadata: SparseMLAMetadata) -> None:
        if metadata.token_pos is not None and metadata.route != DENSE:
            torch.sub(metadata.seq_lens, 1, out=metadata.token_pos)


class SparseMLAImpl(MLAImpl):
    """MLA whose absorbed path attends to each token's selected positions. Subclasses provide the kernels:
    `write_index_keys`, `select_topk` (scores + causal top-k per token) and `attend_sparse`."""

    def forward_sparse(self, q_nope, q_pe, kv_c, k_pe, index_q, index_k, index_w, cache, meta: SparseMLAMetadata,
                       layer: "SparseMLAAttention"):
        """As forward_mla, plus the indexer: index_k [T, D_I] (rotated; None on a shared layer), index_q
        [n, H_I, D_I] (rotated) and index_w [n, H_I] float32 for (at least) the n = num_scored_tokens leading
        tokens. Writes the keys first, then scores. An FP8 key cache (a (keys, scales) pair: indexer_keys.py)
        gets the keys Hadamard-rotated and quantized, (keys, scales), and scores fp8 queries whose scales are
        folded into the weights."""
        latent, index_cache = cache
        n = meta.num_scored_tokens
        if index_k is not None and isinstance(index_cache, tuple):
            index_k = quantize_index_keys(index_k)
            if n:
                index_q, index_w = quantize_index_queries(index_q[:n], index_w[:n])
        if index_k is not None:
            self.write_index_keys(index_k, index_cache, meta.slot_mapping)
            if n:
                meta.topk_indices = self.select_topk(index_q[:n], index_w[:n], index_cache, meta)
        elif n and meta.topk_indices is None:
            raise RuntimeError(f"{layer.layer_name} shares a top-k, but no full indexer layer ran before it")
        return self.forward_mla(q_nope, q_pe, kv_c, k_pe, latent, meta, layer)

    def attend_latent(self, q_lat, q_pe, cache, meta: SparseMLAMetadata) -> torch.Tensor:
        if meta.route == DENSE:  # every context within index_topk: the plain absorbed MLA over all of it
            return super().attend_latent(q_lat, q_pe, cache, meta)
        return self.attend_sparse(q_lat, q_pe, cache, meta, meta.topk_indices)

    def write_index_keys(self, index_k, index_cache, slot_mapping) -> None:
        """index_k [T, D] into index_cache [blocks, bs, D]; or, FP8, (keys, scales) [T, D], [T, 1] into the
        (keys, scales) cache parts."""
        raise NotImplementedError

    def select_topk(self, index_q, index_w, index_cache, meta: SparseMLAMetadata) -> torch.Tensor:
        """-> [num_absorbed_tokens, k] int64: each token's best min(index_topk, visible) positions, -1 after."""
        raise NotImplementedError

    def attend_sparse(self, q_lat, q_pe, cache, meta: SparseMLAMetadata, topk: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class SparseMLAAttention(MLAAttention):
    """MLA with the DSA selection. The model's indexer module computes (index_q, index_k, index_w); a layer
    without one (GLM-5.2 "shared") passes None and attends to the previous full layer's selection."""
    # attend_dense over the expanded context is exact while every prefill context is <= index_topk
    supports_dense_mha_prefill: ClassVar[bool] = True

    def __init__(self, ctx, prefix: str, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, kv_lora_rank: int, kv_b_proj, rotary, scale: float, index_head_dim: int,
                 index_topk: int):
        spec = SparseMLASpec(ctx.dtype, kv_lora_rank, qk_rope_head_dim, index_head_dim=index_head_dim,
                             index_topk=index_topk, layer_dense_prefill=declares_dense_mha_prefill(type(self)))
        super().__init__(ctx, prefix, num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank,
                         kv_b_proj, rotary, scale, kv_cache_spec=spec)
        self.index_topk = index_topk

    def num_scored_tokens(self, ctx) -> int:
        """How many leading tokens of this step the indexer scores (its queries are needed for those only)."""
        return ctx.attn_metadata[self.group_id].num_scored_tokens

    def forward(self, q, kv_c, k_pe, positions, ctx, index_q=None, index_k=None, index_w=None) -> torch.Tensor:
        meta = ctx.attn_metadata[self.group_id]
        t = q.shape[0]
        q_nope, q_pe, k_pe = self.split_rotate(q, k_pe, positions)
        out = self.impl.forward_sparse(q_nope, q_pe, kv_c, k_pe, index_q, index_k, index_w, self.kv_cache, meta,
                                       self)
        return out.reshape(t, self.num_heads * self.v_head_dim)
