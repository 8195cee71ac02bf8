"""The attention layer a model calls: q/k/v in, attention output out, through the step's backend impl."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.attention.backend import AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, layer_index: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.layer_index = layer_index
        self.impl = None  # set by the model runner once the backend is chosen

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: "ForwardContext") -> torch.Tensor:
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = self.impl.forward(q, k, v, ctx.kv_caches[self.layer_index], ctx.attn_metadata)
        return out.reshape(t, self.num_heads * self.head_dim)

    def fuses_qkv_prologue(self, rotary) -> bool:
        """Whether the backend takes the fused qkv output and does q/k norm, rotary and the cache write itself
        (Triton; whole-head neox rotary only)."""
        return getattr(self.impl, "fuses_qkv_prologue", False) and rotary.rot_dim == self.head_dim

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, rotary, q_norm, k_norm,
                    ctx: "ForwardContext") -> torch.Tensor:
        out = self.impl.forward_qkv(qkv, positions, rotary.cos_sin_cache, q_norm, k_norm,
                                    ctx.kv_caches[self.layer_index], ctx.attn_metadata)
        return out.reshape(qkv.shape[0], self.num_heads * self.head_dim)


class ForwardContext:
    """What one forward pass needs besides token ids and positions."""

    def __init__(self, attn_metadata: AttentionMetadata, kv_caches: list):
        self.attn_metadata = attn_metadata
        self.kv_caches = kv_caches
