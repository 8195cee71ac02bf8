"""Multi-head latent attention (DeepSeek-V2/V3, reusable by other families): the layer, its metadata and the
routing between its two compute paths.

The cache holds one latent per token: the normalised compressed KV (kv_lora_rank) followed by the rotated shared
rope key (qk_rope_head_dim). Two ways to attend over it:
- dense (MHA): expand the context's latents through kv_b_proj into per-head keys and values and run ordinary
  attention; cheap when many query tokens share one expansion (prefill, chunked prefill);
- absorbed (MQA): fold W_UK into the query (q_nope W_UK -> a query in latent space) and W_UV into the output, so
  every head attends over the latent cache directly (one shared "head" of kv_lora_rank + rope dims); what decode
  uses, since it never expands the context.
Which requests take which path is decided once per step by the backend's metadata builder from its declared
capability (`supports_dense_mha_prefill`): decodes always go absorbed; prefills go dense where the backend has a
dense path, else absorbed. The batch lists decodes first, so the absorbed part is always a prefix of it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from kestrel.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadata, AttentionMetadataBuilder,
                                       CommonAttentionMetadata)
from kestrel.core.kv_spec import MLASpec, SparseMLASpec, cdiv


@dataclass
class MLAMetadata(AttentionMetadata):
    num_absorbed_reqs: int = 0  # leading requests that attend in latent space (decodes; all without dense prefill)
    num_absorbed_tokens: int = 0
    # the dense part's contexts, gathered from the paged cache: slot of each context token (dense requests in order)
    # and, in a buffer where each request starts on a block boundary, its row; a block table over that buffer
    dense_ctx_slots: torch.Tensor | None = None  # [sum of dense seq_lens] int64
    dense_ctx_rows: torch.Tensor | None = None  # [same] int64
    dense_block_table: torch.Tensor | None = None  # [num dense reqs, max blocks] int32
    dense_num_blocks: int = 0
    dense_seq_lens: torch.Tensor | None = None  # [num dense reqs] int32, its own (aligned) allocation
    dense_ctx_start_cpu: list[int] | None = None  # [num dense reqs + 1] offsets into dense_ctx_slots
    # the dense part's own query_start_loc (from 0, its own allocation) and its longest query and context
    dense_query_start_loc: torch.Tensor | None = None
    dense_max_query_len: int = 0
    dense_max_seq_len: int = 0
    # a captured prefill (kestrel/worker/prefill_graphs.py), all absorbed: each token as a one-query row over its
    # own prefix, for kernels that take one query per row; written inside the graph (update_captured)
    token_block_tables: torch.Tensor | None = None  # [num_tokens, max_seq_len / block_size] int32
    token_seq_lens: torch.Tensor | None = None  # [num_tokens] int32: its position + 1


class MLAMetadataBuilder(AttentionMetadataBuilder):
    """Routes the step: the absorbed/dense split, and for the dense part where its contexts sit in the cache."""
    dense_prefill: ClassVar[bool] = True  # set per backend (MLABackend.__init_subclass__)
    graph_steps: ClassVar[frozenset[str]] = frozenset({"prefill"})  # absorbed: each token a one-query row
    prefill_graph_per_token: ClassVar[bool] = True

    def build(self, common: CommonAttentionMetadata, block_table: torch.Tensor,
              slot_mapping: torch.Tensor) -> MLAMetadata:
        c = common
        return self.build_split(c, block_table, slot_mapping, c.num_decodes if self.dense_prefill else c.num_reqs)

    def build_split(self, c: CommonAttentionMetadata, block_table: torch.Tensor, slot_mapping: torch.Tensor,
                    n_abs: int) -> MLAMetadata:
        """The metadata with the first `n_abs` requests absorbed and the rest dense."""
        qsl = c.query_start_loc_cpu
        n_abs_tok = c.num_tokens if n_abs == c.num_reqs else qsl[n_abs]
        meta = MLAMetadata(c.num_tokens, c.num_reqs, c.num_decodes, c.max_query_len, c.max_seq_len,
                           c.query_start_loc, c.seq_lens, block_table, slot_mapping, qsl, c.seq_lens_cpu,
                           num_absorbed_reqs=n_abs, num_absorbed_tokens=n_abs_tok)
        if n_abs < c.num_reqs:
            self._dense_contexts(meta, block_table[n_abs:c.num_reqs], c.seq_lens_cpu[n_abs:c.num_reqs])
            q_lens = [qsl[b + 1] - qsl[b] for b in range(n_abs, c.num_reqs)]
            meta.dense_query_start_loc = c.query_start_loc[n_abs:c.num_reqs + 1] - n_abs_tok
            meta.dense_max_query_len, meta.dense_max_seq_len = max(q_lens), max(c.seq_lens_cpu[n_abs:c.num_reqs])
        return meta

    def build_for_capture(self, common, block_table, slot_mapping) -> MLAMetadata:
        """Captured graphs are all absorbed (no host lists needed): decodes, and prefills (max_query_len > 1)
        whose tokens also get their rows (token_block_tables, token_seq_lens) within max_seq_len."""
        c = common
        meta = MLAMetadata(c.num_tokens, c.num_reqs, c.num_decodes, c.max_query_len, c.max_seq_len,
                           c.query_start_loc, c.seq_lens, block_table, slot_mapping, c.query_start_loc_cpu,
                           c.seq_lens_cpu, num_absorbed_reqs=c.num_reqs, num_absorbed_tokens=c.num_tokens)
        if c.max_query_len > 1:
            meta.token_block_tables = block_table.new_zeros(c.num_tokens, cdiv(c.max_seq_len, self.block_size))
            meta.token_seq_lens = c.seq_lens.new_zeros(c.num_tokens)
        return meta

    def update_captured(self, metadata: MLAMetadata) -> None:
        """A captured prefill's token rows from the buffers: token t of request b (query_start_loc[b] <= t <
        query_start_loc[b + 1]) sees seq_lens[b] - (query_start_loc[b + 1] - t) + 1 positions of b's blocks."""
        m = metadata
        if m.token_seq_lens is None:
            return
        t = torch.arange(m.num_tokens, dtype=m.query_start_loc.dtype, device=m.query_start_loc.device)
        req = torch.searchsorted(m.query_start_loc[1:], t, right=True)
        torch.add(m.seq_lens[req] - m.query_start_loc[1:][req], t + 1, out=m.token_seq_lens)
        m.token_block_tables.copy_(m.block_tables[req, :m.token_block_tables.shape[1]])

    def _dense_contexts(self, meta: MLAMetadata, block_table: torch.Tensor, seq_lens: list[int]) -> None:
        bs, dev = self.block_size, block_table.device
        blocks = [cdiv(s, bs) for s in seq_lens]
        starts, rows0 = [0], [0]
        for s, nb in zip(seq_lens, blocks):
            starts.append(starts[-1] + s)
            rows0.append(rows0[-1] + nb * bs)
        total = starts[-1]
        lens = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
        req = torch.repeat_interleave(torch.arange(len(seq_lens), device=dev), lens, output_size=total)
        pos = torch.arange(total, device=dev) - torch.tensor(starts[:-1], device=dev)[req]
        meta.dense_ctx_slots = block_table.long()[req, pos // bs] * bs + pos % bs
        meta.dense_ctx_rows = torch.tensor(rows0[:-1], device=dev)[req] + pos
        # Triton specialises an integer argument on divisibility by 16 and a pointer on 16-byte alignment: a table
        # as wide as the longest context, or the seq_lens slice after the decodes, would compile a new prefill
        # variant inside a run (~1.2 s a step, H200 session 7); so the width is a multiple of 16 and the lengths
        # get their own tensor
        width = cdiv(max(blocks), 16) * 16
        first = torch.tensor([r // bs for r in rows0[:-1]], dtype=torch.int32, device=dev)
        meta.dense_block_table = first[:, None] + torch.arange(width, dtype=torch.int32, device=dev)[None, :]
        meta.dense_seq_lens = lens.to(torch.int32)
        meta.dense_num_blocks = rows0[-1] // bs
        meta.dense_ctx_start_cpu = starts


class MLAImpl(AttentionImpl):
    """The two paths over the latent cache. Subclasses provide the kernels: `write_latent`, `attend_latent`
    (absorbed MQA over the cache) and, where the backend declares dense prefill, `attend_dense` (per-head
    attention over expanded contexts). Absorbing W_UK / W_UV and expanding contexts are the same everywhere."""

    def forward_mla(self, q_nope, q_pe, kv_c, k_pe, cache, meta: MLAMetadata, layer: "MLAAttention"):
        """q_nope [T, H, nope], q_pe [T, H, R] (rotated), kv_c [T, L] (normalised), k_pe [T, R] (rotated)
        -> [T, H, v_head_dim]; writes the new tokens' latents into the cache first."""
        self.write_latent(kv_c, k_pe, cache, meta.slot_mapping)
        t = q_nope.shape[0]
        na, n = meta.num_absorbed_tokens, meta.num_tokens
        if na == t:  # every token absorbed (decode steps, captured graphs): no output buffer to fill
            return self._absorbed(q_nope, q_pe, cache, meta, layer)
        out = q_nope.new_empty(t, layer.num_heads, layer.v_head_dim)
        out[n:].zero_()  # padded tokens
        if na:
            out[:na] = self._absorbed(q_nope[:na], q_pe[:na], cache, meta, layer)
        if n > na:
            self.attend_dense(q_nope[na:n], q_pe[na:n], cache, meta, layer, out[na:n])
        return out

    def _absorbed(self, q_nope, q_pe, cache, meta: MLAMetadata, layer) -> torch.Tensor:
        """W_UK folded into the query, attention over the latent cache, W_UV on the way out -> [na, H, v]
        (a transposed view: the caller's reshape makes the one copy)."""
        q_lat = torch.bmm(q_nope.transpose(0, 1), layer.w_uk).transpose(0, 1)  # [na, H, L]
        o_lat = self.attend_latent(q_lat, q_pe, cache, meta)  # [na, H, L]
        return torch.bmm(o_lat.transpose(0, 1), layer.w_uv).transpose(0, 1)

    @staticmethod
    def expand_contexts(cache: torch.Tensor, meta: MLAMetadata, layer: "MLAAttention"):
        """The dense requests' contexts from the cache -> per-head (k_nope [S, H, nope], k_pe [S, R],
        v [S, H, v]) over all their tokens, in request order."""
        lat = cache.flatten(0, 1)[meta.dense_ctx_slots]
        kv_c, k_pe = lat.split([layer.kv_lora_rank, layer.qk_rope_head_dim], dim=-1)
        kv = layer.kv_b_proj(kv_c.to(layer.dtype)).view(-1, layer.num_heads, layer.qk_nope_head_dim +
                                                              layer.v_head_dim)
        k_nope, v = kv.split([layer.qk_nope_head_dim, layer.v_head_dim], dim=-1)
        return k_nope, k_pe, v

    def write_latent(self, kv_c, k_pe, cache, slot_mapping) -> None:
        raise NotImplementedError

    def attend_latent(self, q_lat, q_pe, cache, meta: MLAMetadata) -> torch.Tensor:
        raise NotImplementedError

    def attend_dense(self, q_nope, q_pe, cache, meta: MLAMetadata, layer, out: torch.Tensor) -> None:
        """Writes the dense requests' attention output into out [n dense tokens, H, v_head_dim]."""
        raise NotImplementedError


class MLABackend(AttentionBackend):
    """Base of the backends that read an MLA latent cache. `supports_dense_mha_prefill`: the backend implements
    the expanded (MHA) path for prefills; without it every token goes through the absorbed path."""
    cache_specs = (MLASpec,)
    supports_mla: ClassVar[bool] = True
    supports_dense_mha_prefill: ClassVar[bool] = True
    supports_sparse_mla: ClassVar[bool] = False  # reads a SparseMLASpec (indexer keys + top-k selection)
    builder_cls = MLAMetadataBuilder

    @classmethod
    def validate_spec(cls, spec) -> tuple[bool, str]:
        ok, why = super().validate_spec(spec)
        if ok and isinstance(spec, SparseMLASpec) and not cls.supports_sparse_mla:
            return False, "no sparse MLA (DSA indexer)"
        return ok, why

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        # the builder routes from this backend's own declaration
        cls.builder_cls = type(f"{cls.__name__}Builder", (cls.builder_cls,),
                               {"dense_prefill": cls.supports_dense_mha_prefill})


class MLAAttention(nn.Module):
    """The MLA layer a model calls with its projections' outputs. Owns kv_b_proj's split into W_UK / W_UV (taken
    after loading; an FP8 kv_b_proj is dequantized for them), rotary on the rope parts, and the cache spec."""

    def __init__(self, ctx, prefix: str, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, kv_lora_rank: int, kv_b_proj: nn.Module, rotary, scale: float,
                 kv_cache_spec: MLASpec | None = None):
        super().__init__()
        self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim = num_heads, qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = v_head_dim, kv_lora_rank
        self.scale, self.dtype = scale, ctx.dtype
        # what the runner gives every impl: one shared latent "head" of kv_lora_rank + rope dims
        self.head_dim, self.num_kv_heads = kv_lora_rank + qk_rope_head_dim, 1
        self.sliding_window, self.logits_soft_cap, self.attention_chunk_size = 0, 0.0, 0
        self._kv_b_proj = (kv_b_proj,)  # registered (and loaded) by the model's attention module
        self.rotary = rotary
        self.kv_cache_spec = kv_cache_spec or MLASpec(ctx.dtype, kv_lora_rank, qk_rope_head_dim)
        ctx.register_attention(prefix, self, self.kv_cache_spec)
        self.layer_name = prefix
        self.w_uk: torch.Tensor | None = None  # [H, nope, L]
        self.w_uv: torch.Tensor | None = None  # [H, L, v]
        self.impl = None
        self.kv_cache: torch.Tensor | None = None
        self.group_id = 0

    @property
    def kv_b_proj(self) -> nn.Module:
        return self._kv_b_proj[0]

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """W_UK and W_UV from kv_b_proj's weight as its kernel computes with it (FP8: dequantized). Runs before
        kv_b_proj's own post-load step (the model registers this layer first), while the checkpoint tensors are
        as loaded."""
        proj = self.kv_b_proj
        dequantized = getattr(proj.kernel, "dequantized_weight", None)
        w = dequantized(proj, torch.float32) if dequantized is not None else proj.weight.float()
        w = w.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)  # [H, nope, L], [H, v, L]
        self.w_uk = w_uk.contiguous().to(self.dtype)
        self.w_uv = w_uv.transpose(1, 2).contiguous().to(self.dtype)

    def forward(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
                ctx) -> torch.Tensor:
        """q [T, H, nope + rope], kv_c [T, L] (after kv_a_layernorm), k_pe [T, R] (not yet rotated)
        -> [T, H * v_head_dim]."""
        meta = ctx.attn_metadata[self.group_id]
        t = q.shape[0]
        q_nope, q_pe, k_pe = self.split_rotate(q, k_pe, positions)
        out = self.impl.forward_mla(q_nope, q_pe, kv_c, k_pe, self.kv_cache, meta, self)
        return out.reshape(t, self.num_heads * self.v_head_dim)

    def split_rotate(self, q: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor):
        """q [T, H, nope + rope], k_pe [T, R] -> q_nope, rotated q_pe, rotated k_pe [T, R]."""
        t = q.shape[0]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        # strided views of the projections' outputs: the CUDA rotary rotates them in place, no copies
        if self.rotary is not None:  # None: no position encoding (NoPE MLA)
            q_pe, k_pe = self.rotary(positions, q_pe, k_pe.reshape(t, 1, self.qk_rope_head_dim))
        return q_nope, q_pe, k_pe.reshape(t, self.qk_rope_head_dim)
