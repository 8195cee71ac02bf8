"""GLM-4-MoE (GLM-4.5 / 4.6): standard GQA attention with partial rotary (`partial_rotary_factor`, default 0.5),
q/k/v bias by `attention_bias` (o_proj never), optional q/k norm; the first `first_k_dense_replace` layers dense,
then MoE blocks with DeepSeek-V3 routing (sigmoid + e_score_correction_bias, grouped top-k, routed_scaling_factor)
and ungated shared experts (`n_shared_experts` x `moe_intermediate_size`)."""
from __future__ import annotations

from kestrel.models.context import layer_index
from kestrel.models.deepseek_moe import deepseek_moe_block, deepseek_router
from kestrel.models.llama import LlamaAttention
from kestrel.models.moe_base import MoEDecoderLayer, MoEForCausalLM, cfg_get


class Glm4MoeAttention(LlamaAttention):
    o_bias_follows_qkv = False  # the bias is on q/k/v only
    rope_fraction_default = 0.5

    def __init__(self, ctx, prefix, input_norm, **kw):
        self.use_qk_norm = bool(getattr(ctx.text, "use_qk_norm", False))
        super().__init__(ctx, prefix, input_norm, **kw)


class Glm4MoeDecoderLayer(MoEDecoderLayer):
    attention_cls = Glm4MoeAttention

    def moe_block(self, ctx, prefix):
        if layer_index(prefix) < cfg_get(ctx.text, "first_k_dense_replace", default=0):
            return None
        return deepseek_moe_block(ctx, prefix, deepseek_router(ctx.text))


class Glm4MoeForCausalLM(MoEForCausalLM):
    decoder_layer_cls = Glm4MoeDecoderLayer
