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
the prefill path. Where the gate row `fla_chunk_kda` is open (CUDA, bf16/fp16, fla-core installed), all of a
step's prefills and chunks go through one batched call (`forward_prefills`: one short convolution and one
varlen fla chunk_kda over every request, initial states gathered from the slots and final states written back);
elsewhere (the CPU, float32, no fla) one request at a time (`forward_prefill`, PyTorch's chunked form).

Gated DeltaNet layers (Qwen3-Next, Qwen3.5) run the same paths: their weights object's `delta` options
(kda_ref.DeltaOptions: q/k heads repeated to the state heads, D_v, one decay per head broadcast over D_k, a SiLU
output gate) reach every path, and their spec is GDNStateSpec. Their batched prefill tries its own gate row
`fla_chunk_gated_delta_rule` first, then fla_chunk_kda with the broadcast decay."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from torch import nn

from kestrel.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadata, AttentionMetadataBuilder,
                                       CommonAttentionMetadata)
from kestrel.core.device import to_device
from kestrel.core.kv_spec import GDNStateSpec, KDAStateSpec
from kestrel.kernels import kda_ref
from kestrel.platform import Platform, current_platform
from kestrel.platform.gates import kernel_available

logger = logging.getLogger(__name__)

PREFILL_KERNEL = "fla_chunk_kda"  # the batched prefill's gate row
GDN_PREFILL_KERNEL = "fla_chunk_gated_delta_rule"  # its per-head-decay form (Gated DeltaNet layers), tried first
# the gate-table rows (kestrel/platform/gates.py) of the optional KDA kernels
KDA_KERNELS = ("triton_kda_fused_decode", PREFILL_KERNEL, GDN_PREFILL_KERNEL)
_UNRESOLVED = object()


def startup_kernels(platform: Platform, dtype: torch.dtype) -> list[str]:
    """The optional KDA kernels start-up compiles on `platform` (the warm-up's decode forwards launch them, and
    --precompile compiles them in parallel first): those whose gate row is open there for `dtype`."""
    return [k for k in KDA_KERNELS if kernel_available(k, platform, dtype)]


@dataclass
class KDAPrefills:
    """A step's prefills and chunks (the requests after the decodes) as one varlen batch, for forward_prefills."""
    cu_seqlens_cpu: torch.Tensor  # [N + 1] int64: token offsets from the first prefill token
    cu_seqlens: torch.Tensor  # the same on the device
    fresh: torch.Tensor  # [N] bool on the device: starts from zero state (no computed tokens)
    conv_layout: kda_ref.VarlenConvLayout

    @classmethod
    def build(cls, qsl: list[int], num_decodes: int, has_initial_state: list[bool], conv_width: int, device):
        cu = [x - qsl[num_decodes] for x in qsl[num_decodes:]]
        cu_cpu = torch.tensor(cu, dtype=torch.long)
        fresh = to_device([not x for x in has_initial_state[num_decodes:]], torch.bool, device)
        return cls(cu_cpu, to_device(cu_cpu, torch.long, device), fresh,
                   kda_ref.VarlenConvLayout.build(cu, conv_width, device))


@dataclass
class KDAMetadata(AttentionMetadata):
    state_slots: torch.Tensor | None = None  # [num_reqs] int32: each request's slot (its table's first column)
    # per request: whether it continues a state (computed tokens before this step's); None in captured graphs,
    # which hold decodes only (always continuing)
    has_initial_state_cpu: list[bool] | None = None
    prefills: KDAPrefills | None = None  # None: a decode-only step


class KDAMetadataBuilder(AttentionMetadataBuilder):
    graph_steps: ClassVar[frozenset[str]] = frozenset()  # state slots and prefill chunks: decode graphs only
    def build(self, common: CommonAttentionMetadata, block_table: torch.Tensor,
              slot_mapping: torch.Tensor) -> KDAMetadata:
        c = common
        slots = block_table[:, 0]
        # the memory profile's dummy tables number blocks, not slots: ids beyond the requests' slots (the snapshot
        # slots too, which only copies touch) read the null slot
        slots = torch.where(slots < self.spec.num_slots, slots, 0)
        qsl, sl = c.query_start_loc_cpu, c.seq_lens_cpu
        has_init = [sl[b] > qsl[b + 1] - qsl[b] for b in range(c.num_reqs)] if qsl is not None else None
        prefills = (KDAPrefills.build(qsl[:c.num_reqs + 1], c.num_decodes, has_init, self.spec.conv_width, self.device)
                    if has_init is not None and c.num_reqs > c.num_decodes else None)
        return KDAMetadata(c.num_tokens, c.num_reqs, c.num_decodes, c.max_query_len, c.max_seq_len,
                           c.query_start_loc, c.seq_lens, block_table, slot_mapping, qsl, sl,
                           state_slots=slots, has_initial_state_cpu=has_init, prefills=prefills)

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
    (a subclass may replace it by a fused kernel), the prefills and chunks through `forward_prefills` (batched)
    where `varlen_delta_rule` is a kernel, else each through `forward_prefill`."""
    # the batched prefill's delta rule (kda_ref.delta_rule_varlen's contract) or None (per request); resolved from
    # the gate table at the layer's first prefill (`resolve_prefill`)
    varlen_delta_rule: Callable | None | object = _UNRESOLVED

    @classmethod
    def prefill_kernel(cls, platform: Platform, dtype: torch.dtype) -> str | None:
        """The batched prefill's gate row where it is open on `platform` for `dtype`; None: per request."""
        return PREFILL_KERNEL if kernel_available(PREFILL_KERNEL, platform, dtype) else None

    @classmethod
    def gdn_prefill_kernel(cls, platform: Platform, dtype: torch.dtype) -> str | None:
        """A per-head-decay layer's own batched prefill row where it is open (else it takes prefill_kernel's)."""
        return GDN_PREFILL_KERNEL if kernel_available(GDN_PREFILL_KERNEL, platform, dtype) else None

    def resolve_prefill(self, dtype: torch.dtype, per_head_decay: bool = False) -> Callable | None:
        if self.varlen_delta_rule is _UNRESOLVED:
            p = current_platform()
            kernel = (per_head_decay and self.gdn_prefill_kernel(p, dtype)) or self.prefill_kernel(p, dtype)
            if kernel is None:
                self.varlen_delta_rule = None
            elif compiling_only():  # the precompile's dry run: fla's autotuner must time real launches
                return None
            else:
                from kestrel.kernels import fla_kda
                self.varlen_delta_rule = (fla_kda.chunk_gdn_varlen if kernel == GDN_PREFILL_KERNEL
                                          else fla_kda.chunk_kda_varlen)
                logger.debug("delta-rule prefill: fla-core %s, all of a step's prefills in one varlen call", kernel)
        return self.varlen_delta_rule

    def forward_kda(self, w, qkv, f, beta_logits, gate, cache, meta: KDAMetadata) -> torch.Tensor:
        """w: the layer's weights and options (`delta`: kda_ref.DeltaOptions; conv_weight [C, K], A_log [H],
        dt_bias [HD] (per head: [H]), o_norm_weight [D_v], norm_eps); qkv [T, C] before the convolution (C: 3HD
        for KDA, 2 H_k D + H D_v for Gated DeltaNet), f [T, HD] (per head: [T, H]; the forget-gate projection),
        beta_logits [T, H], gate [T, H D_v] (output-gate projection) -> [T, H D_v], the gated-normed output."""
        nd = meta.num_decodes
        if nd == qkv.shape[0]:  # decode steps, captured graphs
            return self.forward_decode(w, qkv, f, beta_logits, gate, cache, meta.state_slots, meta.seq_lens)
        out = gate.new_zeros(gate.shape)  # zeros for padded tokens
        if nd:
            out[:nd] = self.forward_decode(w, qkv[:nd], f[:nd], beta_logits[:nd], gate[:nd], cache,
                                           meta.state_slots[:nd], meta.seq_lens[:nd])
        qsl = meta.query_start_loc_cpu
        delta_rule = self.resolve_prefill(qkv.dtype, w.delta.per_head_decay)
        if delta_rule is not None:
            s, e = qsl[nd], qsl[meta.num_reqs]
            out[s:e] = self.forward_prefills(w, qkv[s:e], f[s:e], beta_logits[s:e], gate[s:e], cache,
                                             meta.state_slots[nd:meta.num_reqs], meta.prefills, delta_rule)
            return out
        slots = meta.state_slots[nd:meta.num_reqs].tolist()
        for b, slot in zip(range(nd, meta.num_reqs), slots):
            s, e = qsl[b], qsl[b + 1]
            out[s:e] = self.forward_prefill(w, qkv[s:e], f[s:e], beta_logits[s:e], gate[s:e], cache, slot,
                                            meta.has_initial_state_cpu[b])
        return out

    def forward_prefills(self, w, qkv, f, beta_logits, gate, cache, slots: torch.Tensor, prefills: KDAPrefills,
                         delta_rule: Callable):
        """Several requests' new tokens at once (as `prefills` lays them out), each from its slot's state (zeros
        without an initial state), as forward_prefill does for one; updates the slots."""
        recurrent, conv = cache
        opts: kda_ref.DeltaOptions = w.delta
        idx, fresh = slots.long(), prefills.fresh
        y, new_conv = kda_ref.causal_conv_varlen(qkv, prefills.conv_layout,
                                                 torch.where(fresh.view(-1, 1, 1), 0, conv[idx]), w.conv_weight)
        hk, dk = opts.key_heads, opts.head_dim
        q, k, v = y.split([hk * dk, hk * dk, opts.num_heads * opts.v_dim], dim=-1)
        q, k = (x.reshape(-1, hk, dk) for x in (q, k))
        if hk != opts.num_heads:  # the kernels read as many q/k heads as state heads
            q, k = (x.repeat_interleave(opts.num_heads // hk, dim=1) for x in (q, k))
        g = opts.decay(f, w.A_log, w.dt_bias)
        beta = torch.sigmoid(beta_logits.float())
        initial = torch.where(fresh.view(-1, 1, 1, 1), 0.0, recurrent[idx].float())
        o, final = delta_rule(q, k, v.reshape(-1, opts.num_heads, opts.v_dim), g, beta, initial,
                              prefills.cu_seqlens, prefills.cu_seqlens_cpu, dk ** -0.5)
        recurrent[idx] = final.to(recurrent.dtype)
        conv[idx] = new_conv.to(conv.dtype)
        return opts.output(o, gate, w.o_norm_weight, w.norm_eps)

    def forward_prefill(self, w, qkv, f, beta_logits, gate, cache, slot: int, has_initial_state: bool):
        """One request's new tokens from its slot's state (zeros without an initial state); updates the slot."""
        recurrent, conv = cache
        opts: kda_ref.DeltaOptions = w.delta
        y, new_conv = kda_ref.causal_conv(qkv, conv[slot] if has_initial_state else None, w.conv_weight)
        q, k, v = opts.qkv(y)
        g = opts.decay(f, w.A_log, w.dt_bias)
        beta = torch.sigmoid(beta_logits.float())
        state = recurrent[slot].clone() if has_initial_state else recurrent.new_zeros(recurrent.shape[1:])
        o = kda_ref.delta_rule_chunked(q, k, v, g, beta, state)
        recurrent[slot] = state
        conv[slot] = new_conv.to(conv.dtype)
        return opts.output(o, gate, w.o_norm_weight, w.norm_eps)

    def forward_decode(self, w, qkv, f, beta_logits, gate, cache, slots: torch.Tensor,
                       seq_lens: torch.Tensor) -> torch.Tensor:
        """One token per request (the unfused chain: conv update, gates, delta-rule step, gated norm), graph-safe
        (no host reads). A one-token row is a decode or a request's first token (a one-token prompt, or a first
        chunk of one token): rows whose seq_len is 1 start from a zero state, the others continue their slot's."""
        recurrent, conv = cache
        opts: kda_ref.DeltaOptions = w.delta
        idx = slots.long()
        fresh = (seq_lens == 1).view(-1, 1, 1)
        prev = torch.where(fresh, 0, conv[idx]).to(qkv.dtype)
        window = torch.cat([prev, qkv.unsqueeze(-1)], dim=-1)  # [B, C, K]
        conv[idx] = window[..., 1:].to(conv.dtype)
        y = torch.nn.functional.silu((window.float() * w.conv_weight.float()).sum(-1))  # float32, as prefill
        q, k, v = opts.qkv(y)
        g = opts.decay(f, w.A_log, w.dt_bias)
        state = torch.where(fresh.unsqueeze(-1), 0.0, recurrent[idx])
        o = kda_ref.delta_rule_step(q, k, v, g, torch.sigmoid(beta_logits.float()), state)
        recurrent[idx] = state
        return opts.output(o, gate, w.o_norm_weight, w.norm_eps)


def compiling_only() -> bool:
    """Inside the start-up precompile's dry run (launches only compile)."""
    try:
        from kestrel.kernels.triton_ops.precompile import compiling_only as active
    except ImportError:  # no triton
        return False
    return active()


class KDABackend(AttentionBackend):
    """Base of the backends that run KDA over its state slots. `kernels`: the optional kernels it launches where
    their gate rows are open (compiled at start-up by the warm-up forwards; what the gate-table test compares)."""
    cache_specs = (KDAStateSpec,)
    builder_cls = KDAMetadataBuilder
    kernels: ClassVar[tuple[str, ...]] = (PREFILL_KERNEL,)


class DeltaAttention(nn.Module):
    """The delta-rule layer (KDA or Gated DeltaNet, by its `options`) a model calls with its projections' outputs;
    owns the cache spec (registered like any attention layer, so the runner binds it a backend impl and its state
    slots). The model's weights object passed to forward carries the same options as `delta`."""

    def __init__(self, ctx, prefix: str, options: kda_ref.DeltaOptions, conv_width: int):
        super().__init__()
        o = options
        # what the runner gives every impl (num_kv_heads: the q/k heads before their repeat)
        self.num_heads, self.head_dim, self.num_kv_heads = o.num_heads, o.head_dim, o.key_heads
        self.scale, self.sliding_window, self.logits_soft_cap = o.head_dim ** -0.5, 0, 0.0
        self.attention_chunk_size = 0
        self.options = o
        if o.key_heads == o.num_heads and o.v_dim == o.head_dim and not o.per_head_decay:
            self.kv_cache_spec = KDAStateSpec(ctx.dtype, num_heads=o.num_heads, head_dim=o.head_dim,
                                              conv_width=conv_width)
        else:
            self.kv_cache_spec = GDNStateSpec(ctx.dtype, num_heads=o.num_heads, head_dim=o.head_dim,
                                              conv_width=conv_width, num_key_heads=o.key_heads,
                                              value_head_dim=o.v_dim)
        ctx.register_attention(prefix, self, self.kv_cache_spec)
        self.layer_name = prefix
        self.impl: KDAImpl | None = None
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.group_id = 0

    def forward(self, weights, qkv, f, beta_logits, gate, ctx) -> torch.Tensor:
        meta = ctx.attn_metadata[self.group_id]
        return self.impl.forward_kda(weights, qkv, f, beta_logits, gate, self.kv_cache, meta)
