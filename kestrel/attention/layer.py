"""The attention layer a model calls: the fused q/k/v projection in, attention output out. It owns the steps
between (split, q/k norm, rotary, cache write, attention) and asks its backend to fuse them: the Triton backend
does norm, rotary and the cache write in one kernel; the model never asks which.

Options of the steps between (each read from the config by the model's attention module):
  q/k norm: per head (Qwen3), or over all heads together (`qk_norm_all_heads`: Olmo 3, MiniMax-M2; the norm
    modules see [T, heads * head_dim]), before the rotary or after it (`qk_norm_after_rope`: Hunyuan, Llama 4);
  rotary None: no position encoding (NoPE layers: SmolLM3, Llama 4);
  attention_chunk_size: chunked local attention (Llama 4: a ChunkedLocalAttentionSpec, the backends' mask mode);
  query_scale: a per-position factor on the queries after all of that (Llama 4's temperature tuning, Ministral 3).
The fused prologue serves the plain order (per-head norm, full rotary); the other options run the steps in turn."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.attention import kv_quant
from kestrel.attention.backend import AttentionMetadata
from kestrel.core.kv_spec import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec


class Attention(nn.Module):
    def __init__(self, ctx, prefix: str, num_heads: int, head_dim: int, num_kv_heads: int, rotary,
                 scale: float | None = None, q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 qk_norm_all_heads: bool = False, qk_norm_after_rope: bool = False,
                 query_scale: nn.Module | None = None, attention_chunk_size: int | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window or 0
        self.logits_soft_cap = logits_soft_cap or 0.0
        self.rotary = rotary  # shared by the layers
        self._qk_norms = (q_norm, k_norm)  # registered by the model's attention module (checkpoint names)
        self.qk_norm_all_heads, self.qk_norm_after_rope = qk_norm_all_heads, qk_norm_after_rope
        self.query_scale = query_scale
        # the fused prologue's order: per-head RMSNorm (with a weight), then a neox rotary over the whole head
        self.plain_prologue = (rotary is not None and rotary.rot_dim == head_dim and not rotary.interleaved
                               and query_scale is None and not qk_norm_all_heads and not qk_norm_after_rope
                               and (q_norm is None or getattr(q_norm, "weight", None) is not None))
        self.attention_chunk_size = attention_chunk_size or 0
        if self.sliding_window and self.attention_chunk_size:
            raise ValueError(f"{prefix}: a sliding window and chunked attention together")
        spec_cls, extra = FullAttentionSpec, {}
        if self.sliding_window:
            spec_cls, extra = SlidingWindowSpec, {"sliding_window": self.sliding_window}
        elif self.attention_chunk_size:
            spec_cls, extra = ChunkedLocalAttentionSpec, {"attention_chunk_size": self.attention_chunk_size}
        self.kv_cache_spec = spec_cls(ctx.dtype, num_kv_heads, head_dim, **extra)
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
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if q_norm is not None and self.qk_norm_all_heads:
            q, k = q_norm(q), k_norm(k)
        q = q.reshape(t, self.num_heads, self.head_dim)
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
        if self.calibrate_kv_scales:
            self.calibrate_kv_scales = not kv_quant.calibrate(self, k, v, meta.slot_mapping, meta.num_tokens,
                                                              self.kv_cache[0].dtype)
        out = self.impl.forward(q, k, v, self.kv_cache, meta)
        return out.reshape(t, self.q_size)


class ForwardContext:
    """What one forward pass needs besides token ids and positions: each KV-cache group's attention metadata
    (indexed by group id; a single AttentionMetadata stands for one group)."""

    def __init__(self, attn_metadata: list[AttentionMetadata] | AttentionMetadata):
        self.attn_metadata = attn_metadata if isinstance(attn_metadata, (list, tuple)) else [attn_metadata]
