"""DeepSeek-V2 (incl. V2-Lite: no query compression) and DeepSeek-V3: multi-head latent attention
(kestrel/attention/mla.py) with interleaved rotary on the rope dims (V2 always, V3 where `rope_interleave`), YaRN
with the mscale correction of the softmax scale, and dense MLPs on the first `first_k_dense_replace` layers.

Layers from first_k_dense_replace on are MoE blocks (kestrel/layers/moe through models/deepseek_moe.py): V2 routes
with softmax scores (greedy or group-limited), V3 with sigmoid scores, the correction bias and grouped top-k; both
add n_shared_experts ungated shared experts."""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from kestrel.attention.mla import MLAAttention
from kestrel.layers.linear import Linear
from kestrel.layers.norm import RMSNorm, pre_norm
from kestrel.layers.rotary import QueryScale, RotaryEmbedding, _rope_params
from kestrel.models.context import ModelContext, layer_index
from kestrel.models.deepseek_moe import deepseek_moe_block, deepseek_router, deepseek_v2_router, mistral4_router
from kestrel.models.moe_base import MoEDecoderLayer, MoEForCausalLM


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
    (kv_a_layernorm on the compressed part | the rope key), MLA over the latent cache, o_proj. `use_rope` False:
    the rope dims are never rotated (Kimi Linear's NoPE MLA). Queries scaled by position where rope_parameters
    carry llama_4_scaling_beta (Mistral Small 4: QueryScale; before the rotary, which is linear)."""
    use_rope = True

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
                                                              interleaved=interleaved)) if self.use_rope else None
        # registered before kv_b_proj: its post-load step reads kv_b_proj's weights as loaded
        self.mla_attn = self.build_mla(ctx, f"{prefix}.mla_attn", heads, nope, rope, vdim, rank, kv_b_proj, rotary,
                                       mla_softmax_scale(cfg))
        self.kv_b_proj = kv_b_proj
        self.o_proj = Linear.from_ctx(ctx, heads * vdim, h, f"{prefix}.o_proj", bias)
        self.query_scale = QueryScale.from_config(cfg, nope_layer=False)

    def build_mla(self, ctx: ModelContext, prefix: str, *args) -> nn.Module:
        return MLAAttention(ctx, prefix, *args)

    def forward(self, positions, hidden, residual, ctx):
        x, residual = pre_norm(self._input_norm[0], hidden, residual)
        t = x.shape[0]
        if self.q_lora_rank:
            q_c = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_c)
        else:
            q_c, q = None, self.q_proj(x)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        q = q.view(t, self.num_heads, self.qk_head_dim)
        if self.query_scale is not None:
            q = (q * self.query_scale(positions)).to(q.dtype)
        out = self.attend(q, kv_c, k_pe, positions, ctx, x, q_c)
        return self.o_proj(out), residual

    def attend(self, q, kv_c, k_pe, positions, ctx, x, q_c):
        """The MLA layer's call; `x` (the normed input) and `q_c` (the compressed query) for subclasses whose
        attention reads more of the layer's inputs (DSA's indexer)."""
        return self.mla_attn(q, kv_c, k_pe, positions, ctx)


def _is_moe_layer(cfg, idx: int) -> bool:
    types = getattr(cfg, "mlp_layer_types", None)  # transformers 5's per-layer list (DeepSeek-V3.2, GLM-5)
    if types:
        return types[idx] == "sparse"
    return bool(getattr(cfg, "n_routed_experts", None)) and idx >= getattr(cfg, "first_k_dense_replace", 0)


class DeepseekV2DecoderLayer(MoEDecoderLayer):
    attention_cls = DeepseekV2Attention
    router = staticmethod(deepseek_v2_router)

    def moe_block(self, ctx: ModelContext, prefix: str):
        if not _is_moe_layer(ctx.text, layer_index(prefix)):
            return None
        return deepseek_moe_block(ctx, prefix, self.router(ctx.text))


class DeepseekV3DecoderLayer(DeepseekV2DecoderLayer):
    router = staticmethod(deepseek_router)


class Mistral4DecoderLayer(DeepseekV2DecoderLayer):
    router = staticmethod(mistral4_router)


class DeepseekV2ForCausalLM(MoEForCausalLM):
    decoder_layer_cls = DeepseekV2DecoderLayer
    packed_modules = {"gate_up_proj": ("gate_proj", "up_proj")}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        n = self.config.num_hidden_layers
        # V3 checkpoints carry multi-token-prediction layers past the last decoder layer: not part of the target
        # (speculative_config method "mtp" loads them into its drafter, kestrel/spec_decode/mtp_drafter.py)
        return super().load_weights((name, t) for name, t in weights if not _beyond_last_layer(name, n))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    decoder_layer_cls = DeepseekV3DecoderLayer


class Mistral4ForCausalLM(DeepseekV2ForCausalLM):
    """Mistral Small 4 (Mistral Large 3's text model): DeepSeek-V3's MLA + MoE with llama-4 query scaling and a
    softmax group router."""
    decoder_layer_cls = Mistral4DecoderLayer


def _beyond_last_layer(name: str, num_layers: int) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= num_layers

