"""DeepSeek-V2 (incl. V2-Lite: no query compression) and DeepSeek-V3: multi-head latent attention
(kestrel/attention/mla.py) with interleaved rotary on the rope dims (V2 always, V3 where `rope_interleave`), YaRN
with the mscale correction of the softmax scale, and dense MLPs on the first `first_k_dense_replace` layers.

MoE layers (the layers past first_k_dense_replace) come from the MoE issue and are not wired here yet: such a
checkpoint raises NotImplementedError at construction."""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from kestrel.attention.mla import MLAAttention
from kestrel.layers.activation import gated_activation
from kestrel.layers.linear import Linear
from kestrel.layers.norm import RMSNorm
from kestrel.layers.rotary import RotaryEmbedding, _rope_params
from kestrel.models.context import ModelContext, layer_index
from kestrel.models.llama import LlamaForCausalLM, LlamaMLP
from kestrel.models.weights import load_named_weights


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(cfg) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (the rotary's own attention factor
    covers only the ratio of the two mscales)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = _rope_params(cfg)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale *= m * m
    return scale


class DeepseekV2Attention(nn.Module):
    """q (direct, or compressed through q_a_proj -> q_a_layernorm -> q_b_proj), the latent kv_a_proj_with_mqa ->
    (kv_a_layernorm on the compressed part | the rope key), MLA over the latent cache, o_proj."""

    def __init__(self, ctx: ModelContext, prefix: str, input_norm: nn.Module):
        super().__init__()
        cfg = ctx.text
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        nope, rope, vdim, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        bias = getattr(cfg, "attention_bias", False)
        self.num_heads, self.qk_head_dim, self.kv_lora_rank, self.rope_dim = heads, nope + rope, rank, rope
        self._input_norm = (input_norm,)  # registered by the decoder layer
        self.q_lora_rank = getattr(cfg, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = Linear.from_ctx(ctx, h, self.q_lora_rank, f"{prefix}.q_a_proj", bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6, ctx.dtype)  # HF's default eps, not rms_norm_eps
            self.q_b_proj = Linear.from_ctx(ctx, self.q_lora_rank, heads * (nope + rope), f"{prefix}.q_b_proj")
        else:
            self.q_proj = Linear.from_ctx(ctx, h, heads * (nope + rope), f"{prefix}.q_proj")
        self.kv_a_proj_with_mqa = Linear.from_ctx(ctx, h, rank + rope, f"{prefix}.kv_a_proj_with_mqa", bias)
        self.kv_a_layernorm = RMSNorm(rank, 1e-6, ctx.dtype)
        kv_b_proj = Linear.from_ctx(ctx, rank, heads * (nope + vdim), f"{prefix}.kv_b_proj")
        interleaved = getattr(cfg, "rope_interleave", True)  # V2 has no flag: always interleaved
        rotary = ctx.shared("rotary", lambda: RotaryEmbedding(cfg, rope, ctx.max_positions, ctx.dtype,
                                                              interleaved=interleaved))
        # registered before kv_b_proj: its post-load step reads kv_b_proj's weights as loaded
        self.mla_attn = MLAAttention(ctx, f"{prefix}.mla_attn", heads, nope, rope, vdim, rank, kv_b_proj, rotary,
                                     mla_softmax_scale(cfg))
        self.kv_b_proj = kv_b_proj
        self.o_proj = Linear.from_ctx(ctx, heads * vdim, h, f"{prefix}.o_proj", bias)

    def forward(self, positions, hidden, residual, ctx):
        norm = self._input_norm[0]
        if residual is None:
            x, residual = norm(hidden), hidden
        else:
            x, residual = norm(hidden, residual)
        t = x.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        out = self.mla_attn(q.view(t, self.num_heads, self.qk_head_dim), kv_c, k_pe, positions, ctx)
        return self.o_proj(out), residual


def _is_moe_layer(cfg, idx: int) -> bool:
    return bool(getattr(cfg, "n_routed_experts", None)) and idx >= getattr(cfg, "first_k_dense_replace", 0)


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, ctx: ModelContext, prefix: str):
        super().__init__()
        cfg = ctx.text
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.self_attn = DeepseekV2Attention(ctx, f"{prefix}.self_attn", self.input_layernorm)
        if _is_moe_layer(cfg, layer_index(prefix)):
            # follow-up: DeepSeek's routed + shared experts from kestrel/layers/moe (the MoE issue)
            raise NotImplementedError(f"{prefix}: DeepSeek MoE layers are not supported yet (layers from "
                                      f"first_k_dense_replace={cfg.first_k_dense_replace} on are MoE)")
        self.mlp = LlamaMLP(ctx, f"{prefix}.mlp", self.post_attention_layernorm,
                            gated_activation(getattr(cfg, "hidden_act", "silu")))

    def forward(self, positions, hidden, residual, ctx):
        hidden, residual = self.self_attn(positions, hidden, residual, ctx)
        return self.mlp(hidden, residual)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = DeepseekV2DecoderLayer
    packed_modules = {"gate_up_proj": ("gate_proj", "up_proj")}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        n = self.config.num_hidden_layers
        # V3 checkpoints carry multi-token-prediction layers past the last decoder layer: not used for decoding
        kept = ((name, t) for name, t in weights if not _beyond_last_layer(name, n))
        return load_named_weights(self, kept, self.packed_modules,
                                  skip_lm_head=getattr(self.config, "tie_word_embeddings", False))


def _beyond_last_layer(name: str, num_layers: int) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= num_layers


DeepseekV3ForCausalLM = DeepseekV2ForCausalLM
