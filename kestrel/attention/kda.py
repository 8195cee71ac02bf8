"""Kimi Delta Attention (KDA) as an attention-like layer: its per-request state cache, its metadata and the split
of a step between its two compute paths.

The cache is a state slot per request (kestrel/core/kv_spec.py KDAStateSpec): the recurrent state and the short
convolution's last inputs, carried from one step (or prefill chunk) to the next. The request's slot is its one
block-table entry. A request without computed tokens (new, or preempted and now recomputed) starts from zero
state whatever its slot holds; slot 0 is the null slot that CUDA-graph padding rows read and write. A prefix hit
has computed tokens: the runner copied a snapshot into its slot before the step (prefix caching,
kestrel/engine/kv/managers.py StateSlotManager), so it continues that state like a next chunk.

The batch lists decodes first: they take the backend's decode path (one token per request, vectorised over
requests, graph-safe; the fused Triton kernel where the gate table allows it), the prefills and chunks after them
the per-request path (`forward_prefill`, carrying the state between chunks)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from kestrel.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadata, AttentionMetadataBuilder,
                                       CommonAttentionMetadata)
from kestrel.core.kv_spec import KDAStateSpec
from kestrel.kernels import kda_ref
from kestrel.platform import Platform
from kestrel.platform.gates import kernel_available

# the gate-table rows (kestrel/platform/gates.py) of the optional KDA kernels
KDA_KERNELS = ("triton_kda_fused_decode",)


def startup_kernels(platform: Platform, dtype: torch.dtype) -> list[str]:
    """The optional KDA kernels start-up compiles on `platform` (the warm-up's decode forwards launch them, and
    --precompile compiles them in parallel first): those whose gate row is open there for `dtype`."""
    return [k for k in KDA_KERNELS if kernel_available(k, platform, dtype)]


@dataclass
class KDAMetadata(AttentionMetadata):
    state_slots: torch.Tensor | None = None  # [num_reqs] int32: each request's slot (its table's first column)
    # per request: whether it continues a state (computed tokens before this step's); None in captured graphs,
    # which hold decodes only (always continuing)
    has_initial_state_cpu: list[bool] | None = None


class KDAMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata, block_table: torch.Tensor,
              slot_mapping: torch.Tensor) -> KDAMetadata:
        c = common
        slots = block_table[:, 0]
        # the memory profile's dummy tables number blocks, not slots: ids beyond the requests' slots (the snapshot
        # slots too, which only copies touch) read the null slot
        slots = torch.where(slots < self.spec.num_state_slots - self.spec.num_snapshot_slots, slots, 0)
        qsl, sl = c.query_start_loc_cpu, c.seq_lens_cpu
        has_init = [sl[b] > qsl[b + 1] - qsl[b] for b in range(c.num_reqs)] if qsl is not None else None
        return KDAMetadata(c.num_tokens, c.num_reqs, c.num_decodes, c.max_query_len, c.max_seq_len,
                           c.query_start_loc, c.seq_lens, block_table, slot_mapping, qsl, sl,
                           state_slots=slots, has_initial_state_cpu=has_init)

    def build_for_capture(self, common, block_table, slot_mapping) -> KDAMetadata:
        c = common
        return KDAMetadata(c.num_tokens, c.num_reqs, c.num_decodes, c.max_query_len, c.max_seq_len,
                           c.query_start_loc, c.seq_lens, block_table, slot_mapping, state_slots=block_table[:, 0])

    def prepare_replay(self, metadata: KDAMetadata, num_reqs: int, padded: int) -> None:
        super().prepare_replay(metadata, num_reqs, padded)
        if padded > num_reqs:
            metadata.block_tables[num_reqs:padded, 0].zero_()  # padded rows use the null slot


class KDAImpl(AttentionImpl):
    """One KDA layer's core for a step, from its projections' outputs: the decode rows through `forward_decode`
    (a subclass may replace it by a fused kernel), each prefill or chunk through `forward_prefill`."""

    def forward_kda(self, w, qkv, f, beta_logits, gate, cache, meta: KDAMetadata) -> torch.Tensor:
        """w: the layer's weights (conv_weight [3HD, K], A_log [H], dt_bias [HD], o_norm_weight [D], norm_eps);
        qkv [T, 3HD] before the convolution, f [T, HD] (forget-gate projection), beta_logits [T, H], gate [T, HD]
        (output-gate projection) -> [T, HD], the gated-normed output."""
        nd = meta.num_decodes
        if nd == qkv.shape[0]:  # decode steps, captured graphs
            return self.forward_decode(w, qkv, f, beta_logits, gate, cache, meta.state_slots, meta.seq_lens)
        out = gate.new_zeros(gate.shape)  # zeros for padded tokens
        if nd:
            out[:nd] = self.forward_decode(w, qkv[:nd], f[:nd], beta_logits[:nd], gate[:nd], cache,
                                           meta.state_slots[:nd], meta.seq_lens[:nd])
        qsl = meta.query_start_loc_cpu
        slots = meta.state_slots[nd:meta.num_reqs].tolist()
        for b, slot in zip(range(nd, meta.num_reqs), slots):
            s, e = qsl[b], qsl[b + 1]
            out[s:e] = self.forward_prefill(w, qkv[s:e], f[s:e], beta_logits[s:e], gate[s:e], cache, slot,
                                            meta.has_initial_state_cpu[b])
        return out

    def forward_prefill(self, w, qkv, f, beta_logits, gate, cache, slot: int, has_initial_state: bool):
        """One request's new tokens from its slot's state (zeros without an initial state); updates the slot."""
        recurrent, conv = cache
        h, d = recurrent.shape[1], recurrent.shape[2]
        y, new_conv = kda_ref.causal_conv(qkv, conv[slot] if has_initial_state else None, w.conv_weight)
        q, k, v = kda_ref.prepare_qkv(y, h, d)
        g = kda_ref.forget_gate(f, w.A_log, w.dt_bias, d)
        beta = torch.sigmoid(beta_logits.float())
        state = recurrent[slot].clone() if has_initial_state else recurrent.new_zeros(h, d, d)
        o = kda_ref.delta_rule_chunked(q, k, v, g, beta, state)
        recurrent[slot] = state
        conv[slot] = new_conv.to(conv.dtype)
        return kda_ref.gated_rms_norm(o, gate, w.o_norm_weight, w.norm_eps)

    def forward_decode(self, w, qkv, f, beta_logits, gate, cache, slots: torch.Tensor,
                       seq_lens: torch.Tensor) -> torch.Tensor:
        """One token per request (the unfused chain: conv update, gates, delta-rule step, gated norm), graph-safe
        (no host reads). A one-token row is a decode or a request's first token (a one-token prompt, or a first
        chunk of one token): rows whose seq_len is 1 start from a zero state, the others continue their slot's."""
        recurrent, conv = cache
        h, d = recurrent.shape[1], recurrent.shape[2]
        idx = slots.long()
        fresh = (seq_lens == 1).view(-1, 1, 1)
        prev = torch.where(fresh, 0, conv[idx]).to(qkv.dtype)
        window = torch.cat([prev, qkv.unsqueeze(-1)], dim=-1)  # [B, C, K]
        conv[idx] = window[..., 1:].to(conv.dtype)
        y = torch.nn.functional.silu((window.float() * w.conv_weight.float()).sum(-1))  # float32, as prefill
        q, k, v = kda_ref.prepare_qkv(y, h, d)
        g = kda_ref.forget_gate(f, w.A_log, w.dt_bias, d)
        state = torch.where(fresh.unsqueeze(-1), 0.0, recurrent[idx])
        o = kda_ref.delta_rule_step(q, k, v, g, torch.sigmoid(beta_logits.float()), state)
        recurrent[idx] = state
        return kda_ref.gated_rms_norm(o, gate, w.o_norm_weight, w.norm_eps)


class KDABackend(AttentionBackend):
    """Base of the backends that run KDA over its state slots. `kernels`: the Triton kernels its decode path
    launches (compiled at start-up by the warm-up forwards; what the gate-table test compares)."""
    cache_specs = (KDAStateSpec,)
    builder_cls = KDAMetadataBuilder
    kernels: ClassVar[tuple[str, ...]] = ()


class DeltaAttention(nn.Module):
    """The KDA layer a model calls with its projections' outputs; owns the cache spec (registered like any
    attention layer, so the runner binds it a backend impl and its state slots)."""

    def __init__(self, ctx, prefix: str, num_heads: int, head_dim: int, conv_width: int):
        super().__init__()
        # what the runner gives every impl
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_heads
        self.scale, self.sliding_window, self.logits_soft_cap = head_dim ** -0.5, 0, 0.0
        self.kv_cache_spec = KDAStateSpec(ctx.dtype, num_heads=num_heads, head_dim=head_dim, conv_width=conv_width)
        ctx.register_attention(prefix, self, self.kv_cache_spec)
        self.layer_name = prefix
        self.impl: KDAImpl | None = None
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.group_id = 0

    def forward(self, weights, qkv, f, beta_logits, gate, ctx) -> torch.Tensor:
        meta = ctx.attn_metadata[self.group_id]
        return self.impl.forward_kda(weights, qkv, f, beta_logits, gate, self.kv_cache, meta)
