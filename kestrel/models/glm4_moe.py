"""GLM-4-MoE (GLM-4.5 / 4.6): standard GQA attention with partial rotary (`partial_rotary_factor`, default 0.5),
q/k/v bias by `attention_bias` (o_proj never), optional q/k norm; the first `first_k_dense_replace` layers dense,
then MoE blocks with DeepSeek-V3 routing (sigmoid + e_score_correction_bias, grouped top-k, routed_scaling_factor)
and ungated shared experts (`n_shared_experts` x `moe_intermediate_size`)."""
from __future__ import annotations

from kestrel.layers.linear import Linear
from kestrel.models.llama import LlamaAttention
from kestrel.models.deepseek_moe import deepseek_moe_block, deepseek_router
from kestrel.models.moe_base import MoEForCausalLM, cfg_get


class Glm4MoeAttention(LlamaAttention):
    def __init__(self, cfg, layer_index, dtype, prefix, quant_config, linear_backend, rotary):
        self.use_qk_norm = bool(getattr(cfg, "use_qk_norm", False))
        super().__init__(cfg, layer_index, dtype, prefix, quant_config, linear_backend, rotary)
        if getattr(cfg, "attention_bias", False):  # the bias is on q/k/v only
            self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False, params_dtype=dtype,
                                 prefix=f"{prefix}.o_proj", quant_config=quant_config, backend=linear_backend)


class Glm4MoeForCausalLM(MoEForCausalLM):
    attention_cls = Glm4MoeAttention

    @staticmethod
    def rotary_dim(cfg) -> int:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        factor = (getattr(cfg, "rope_parameters", None) or {}).get("partial_rotary_factor") \
            or getattr(cfg, "partial_rotary_factor", None) or 0.5
        return int(head_dim * factor)

    def moe_block(self, cfg, i, prefix, dtype, quant_config, linear_backend, moe):
        if i < cfg_get(cfg, "first_k_dense_replace", default=0):
            return None
        return deepseek_moe_block(cfg, prefix, dtype, deepseek_router(cfg), quant_config, linear_backend, moe)
