"""Gemma 3 (text): Gemma with sliding-window attention on most layers (`layer_types`; 5 of every 6 by default), a
rope base per layer type, RMSNorm on each head of q and k, norms before and after both the attention and the MLP
("sandwich"), queries scaled by query_pre_attn_scalar, and logit soft-capping where the config asks."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.layers.activation import gated_activation
from kestrel.layers.norm import GemmaRMSNorm
from kestrel.layers.rotary import RotaryEmbedding
from kestrel.models.context import ModelContext, layer_index
from kestrel.models.gemma import GemmaForCausalLM
from kestrel.models.llama import LlamaAttention, LlamaMLP, head_dim_of


class Gemma3Attention(LlamaAttention):
    use_qk_norm = True
    norm_cls = GemmaRMSNorm


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, ctx: ModelContext, prefix: str):
        super().__init__()
        cfg = ctx.text
        layer_type = cfg.layer_types[layer_index(prefix)]
        sliding = layer_type == "sliding_attention"
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        rotary = ctx.shared(f"rotary.{layer_type}", lambda: RotaryEmbedding(
            cfg, head_dim_of(cfg), ctx.max_positions, ctx.dtype, layer_type=layer_type))
        self.self_attn = Gemma3Attention(ctx, f"{prefix}.self_attn", self.input_layernorm, rotary=rotary,
                                         scale=cfg.query_pre_attn_scalar ** -0.5,
                                         sliding_window=cfg.sliding_window if sliding else None,
                                         logits_soft_cap=getattr(cfg, "attn_logit_softcapping", None))
        self.mlp = LlamaMLP(ctx, f"{prefix}.mlp", self.pre_feedforward_layernorm,
                            gated_activation(cfg.hidden_activation))

    def forward(self, positions, hidden, residual, ctx):
        # (hidden, residual) carries the stream as hidden + residual; each pre-norm adds them first
        attn, residual = self.self_attn(positions, hidden, residual, ctx)
        mlp, residual = self.mlp(self.post_attention_layernorm(attn), residual)
        return self.post_feedforward_layernorm(mlp), residual


class Gemma3ForCausalLM(GemmaForCausalLM):
    decoder_layer_cls = Gemma3DecoderLayer

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = getattr(self.config, "final_logit_softcapping", None)
        return cap * torch.tanh(logits / cap) if cap else logits
