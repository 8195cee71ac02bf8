"""GLM-4-MoE (GLM-4.5 / 4.6): standard GQA attention with partial rotary (`partial_rotary_factor`, default 0.5),
q/k/v bias by `attention_bias` (o_proj never), optional q/k norm; the first `first_k_dense_replace` layers dense,
then MoE blocks with DeepSeek-V3 routing (sigmoid + e_score_correction_bias, grouped top-k, routed_scaling_factor)
and ungated shared experts (`n_shared_experts` x `moe_intermediate_size`)."""
from __future__ import annotations

from kestrel.layers.linear import Linear
from kestrel.layers.rotary import RotaryEmbedding, partial_rotary_dim
from kestrel.models.context import layer_index
from kestrel.models.deepseek_moe import deepseek_moe_block, deepseek_router
from kestrel.models.llama import LlamaAttention, head_dim_of
from kestrel.models.moe_base import MoEDecoderLayer, MoEForCausalLM, cfg_get


def rotary_dim(cfg) -> int:
    return partial_rotary_dim(cfg, head_dim_of(cfg), default=0.5)


class Glm4MoeAttention(LlamaAttention):
    def __init__(self, ctx, prefix, input_norm, **kw):
        cfg = ctx.text
        self.use_qk_norm = bool(getattr(cfg, "use_qk_norm", False))
        rotary = ctx.shared("rotary", lambda: RotaryEmbedding(cfg, rotary_dim(cfg), ctx.max_positions, ctx.dtype))
        super().__init__(ctx, prefix, input_norm, rotary=rotary, **kw)
        if getattr(cfg, "attention_bias", False):  # the bias is on q/k/v only
            self.o_proj = Linear.from_ctx(ctx, cfg.num_attention_heads * head_dim_of(cfg), cfg.hidden_size,
                                          f"{prefix}.o_proj", False)


class Glm4MoeDecoderLayer(MoEDecoderLayer):
    attention_cls = Glm4MoeAttention

    def moe_block(self, ctx, prefix):
        if layer_index(prefix) < cfg_get(ctx.text, "first_k_dense_replace", default=0):
            return None
        return deepseek_moe_block(ctx, prefix, deepseek_router(ctx.text))


class Glm4MoeForCausalLM(MoEForCausalLM):
    decoder_layer_cls = Glm4MoeDecoderLayer
