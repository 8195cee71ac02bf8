"""GLM-4-MoE (GLM-4.5 / 4.6): standard GQA attention with partial rotary (`partial_rotary_factor`, default 0.5),
q/k/v bias by `attention_bias` (o_proj never), optional q/k norm; the first `first_k_dense_replace` layers dense,
then MoE blocks with DeepSeek-V3 routing (sigmoid + e_score_correction_bias, grouped top-k, routed_scaling_factor)
and ungated shared experts (`n_shared_experts` x `moe_intermediate_size`)."""
from __future__ import annotations

from kestrel.layers.linear import Linear
from kestrel.layers.moe import RouterConfig, SparseMoeBlock
from kestrel.models.llama import LlamaAttention
from kestrel.models.moe_base import MoEForCausalLM, cfg_get


class Glm4MoeAttention(LlamaAttention):
    def __init__(self, cfg, layer_index, dtype, prefix, quant_config, linear_backend, rotary):
        self.use_qk_norm = bool(getattr(cfg, "use_qk_norm", False))
        super().__init__(cfg, layer_index, dtype, prefix, quant_config, linear_backend, rotary)
        if getattr(cfg, "attention_bias", False):  # the bias is on q/k/v only
            self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False, params_dtype=dtype,
                                 prefix=f"{prefix}.o_proj", quant_config=quant_config, backend=linear_backend)


def deepseek_router(cfg) -> RouterConfig:
    """DeepSeek-V3 routing as GLM-4-MoE and DeepSeek-V3 configs describe it."""
    return RouterConfig(cfg_get(cfg, "n_routed_experts", "num_local_experts"), cfg.num_experts_per_tok, "sigmoid",
                        bool(getattr(cfg, "norm_topk_prob", True)), cfg_get(cfg, "n_group", default=1),
                        cfg_get(cfg, "topk_group", default=1), "top2_sum",
                        float(cfg_get(cfg, "routed_scaling_factor", default=1.0)), correction_bias=True)


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
        shared = cfg_get(cfg, "n_shared_experts", default=0) * cfg.moe_intermediate_size
        return SparseMoeBlock(prefix=prefix, hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
                              router=deepseek_router(cfg), dtype=dtype, shared_intermediate_size=shared,
                              shared_name="shared_experts", quant_config=quant_config, moe_backend=moe.moe_backend,
                              linear_backend=linear_backend, fuse_shared_experts=moe.fuse_shared_experts,
                              platform=moe.platform)
