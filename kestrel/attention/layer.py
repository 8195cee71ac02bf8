"""The attention layer a model calls: the fused q/k/v projection in, attention output out. It owns the steps
between (split, q/k norm, rotary, cache write, attention) and asks its backend to fuse them: the Triton backend
does norm, rotary and the cache write in one kernel; the model never asks which.

Options of the steps between (each read from the config by the model's attention module):
  q/k norm: per head (Qwen3), or over all heads together (`qk_norm_all_heads`: Olmo 3, MiniMax-M2; the norm
    modules see [T, heads * head_dim]), before the rotary or after it (`qk_norm_after_rope`: Hunyuan, Llama 4);
  rotary None: no position encoding (NoPE layers: SmolLM3, Llama 4);
  attention_chunk_size: chunked local attention (Llama 4: a ChunkedLocalAttentionSpec, the backends' mask mode);
  query_scale: a per-position factor on the queries after all of that (Llama 4's temperature tuning, Ministral 3);
  sinks: a learned logit per query head in the softmax denominator (gpt-oss; the `sinks` parameter, float32,
    this rank's heads), which the backend must declare it reads (`supports_attention_sinks`).
  v_norm: a per-head norm of the values before the cache write (Gemma 4: unweighted);
  k_eq_v: the projection gives no values; V is K as projected, before K's norm and rotary (Gemma 4's global
    layers);
  kv_source: the name of an earlier attention layer whose cache this layer reads instead of keeping one (Gemma 4's
    KV-shared layers): the projection gives queries only, nothing is written, and the layer registers a
    SharedKVSpec, which puts it on that layer's KV group as a reader (core/kv_spec.py group_layers).
The fused prologue serves the plain order (per-head norm, full rotary); the other options run the steps in turn."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.attention import kv_quant
from kestrel.attention.backend import AttentionMetadata
from kestrel.core.kv_spec import ChunkedLocalAttentionSpec, FullAttentionSpec, SharedKVSpec, SlidingWindowSpec


class Attention(nn.Module):
    def __init__(self, ctx, prefix: str, num_heads: int, head_dim: int, num_kv_heads: int, rotary,
                 scale: float | None = None, q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 qk_norm_all_heads: bool = False, qk_norm_after_rope: bool = False,
                 query_scale: nn.Module | None = None, attention_chunk_size: int | None = None,
                 sinks: bool = False, v_norm: nn.Module | None = None, k_eq_v: bool = False,
                 kv_source: str | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.v_norm, self.k_eq_v, self.kv_source = v_norm, k_eq_v, kv_source
        # what the projection gives: q | k | v, q | k (K = V) or q alone (a reader of another layer's cache)
        self.qkv_split = [self.q_size] + ([] if kv_source else [self.kv_size] * (1 if k_eq_v else 2))
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window or 0
        self.logits_soft_cap = logits_soft_cap or 0.0
        self.rotary = rotary  # shared by the layers
        self._qk_norms = (q_norm, k_norm)  # registered by the model's attention module (checkpoint names)
        self.qk_norm_all_heads, self.qk_norm_after_rope = qk_norm_all_heads, qk_norm_after_rope
        self.query_scale = query_scale
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False) if sinks else None
        # the fused prologue's order: per-head RMSNorm (with a weight), then a neox rotary over the whole head
        self.plain_prologue = (rotary is not None and rotary.rot_dim == head_dim and not rotary.interleaved
                               and query_scale is None and not qk_norm_all_heads and not qk_norm_after_rope
                               and v_norm is None and not k_eq_v and not kv_source
                               and (q_norm is None or (getattr(q_norm, "weight", None) is not None
                                                       and getattr(q_norm, "fusable", True))))
        self.attention_chunk_size = attention_chunk_size or 0
        if self.sliding_window and self.attention_chunk_size:
            raise ValueError(f"{prefix}: a sliding window and chunked attention together")
        if kv_source and (qk_norm_all_heads or qk_norm_after_rope):
            raise ValueError(f"{prefix}: a layer reading {kv_source}'s cache takes per-head q norms before the rotary")
        spec_cls, extra = FullAttentionSpec, {}
        if self.sliding_window:
            spec_cls, extra = SlidingWindowSpec, {"sliding_window": self.sliding_window}
        elif self.attention_chunk_size:
            spec_cls, extra = ChunkedLocalAttentionSpec, {"attention_chunk_size": self.attention_chunk_size}
        self.kv_cache_spec = spec_cls(ctx.dtype, num_kv_heads, head_dim, **extra)
        if kv_source:
            self.kv_cache_spec = SharedKVSpec(ctx.dtype, source=kv_source, reads=self.kv_cache_spec)
        ctx.register_attention(prefix, self, self.kv_cache_spec)
        self.layer_name = prefix
        # per-tensor scales of an FP8 KV cache (kestrel/attention/kv_quant.py): the checkpoint's, else 1.0
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.calibrate_kv_scales = False  # --calculate-kv-scales: set them from the next batch that writes K/V
        # bound by the model runner: the group's backend impl, this layer's cache and its group
        self.impl = None
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.group_id = 0

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, ctx: "ForwardContext") -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) * D] -> [T, Hq * D]."""
        meta = ctx.attn_metadata[self.group_id]
        t = qkv.shape[0]
        q_norm, k_norm = self._qk_norms
        fuse = getattr(self.impl, "fuses_qkv_prologue", False) and not self.calibrate_kv_scales
        if fuse and self.plain_prologue:
            out = self.impl.forward_qkv(qkv, *self.rotary.cos_sin_for(positions), q_norm, k_norm, self.kv_cache, meta)
            return out.reshape(t, self.q_size)
        q, *kv = qkv.split(self.qkv_split, dim=-1)
        k = kv[0] if kv else None
        v = kv[-1] if kv else None  # K = V: the projected keys
        if q_norm is not None and self.qk_norm_all_heads:
            q, k = q_norm(q), k_norm(k)
        q = q.reshape(t, self.num_heads, self.head_dim)
        if k is None:  # a reader: no keys of its own
            return self._read_shared(q, positions, meta).reshape(t, self.q_size)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        per_head_norm = q_norm is not None and not self.qk_norm_all_heads
        if per_head_norm and not self.qk_norm_after_rope:
            q, k = q_norm(q), k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        if per_head_norm and self.qk_norm_after_rope:
            q, k = q_norm(q), k_norm(k)
        if self.query_scale is not None:
            q = (q * self.query_scale(positions[:t])).to(q.dtype)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.v_norm is not None:
            v = self.v_norm(v)
        if self.calibrate_kv_scales:
            self.calibrate_kv_scales = not kv_quant.calibrate(self, k, v, meta.slot_mapping, meta.num_tokens,
                                                              self.kv_cache[0].dtype)
        out = self.impl.forward(q, k, v, self.kv_cache, meta)
        return out.reshape(t, self.q_size)

    def _read_shared(self, q: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """Queries only, over the source layer's cache (bound to this layer: kv_allocation.py)."""
        q_norm = self._qk_norms[0]
        if q_norm is not None:
            q = q_norm(q)
        if self.rotary is not None:
            q, = self.rotary.rotate_copies(positions, q)
        if self.query_scale is not None:
            q = (q * self.query_scale(positions[:q.shape[0]])).to(q.dtype)
        return self.impl.attend(q, self.kv_cache, meta)


class ForwardContext:
    """What one forward pass needs besides token ids and positions: each KV-cache group's attention metadata
    (indexed by group id; a single AttentionMetadata stands for one group)."""

    def __init__(self, attn_metadata: list[AttentionMetadata] | AttentionMetadata):
        self.attn_metadata = attn_metadata if isinstance(attn_metadata, (list, tuple)) else [attn_metadata]
