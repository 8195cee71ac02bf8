"""The MoE half of DeepSeek-V2/V3 (their MLA attention is in models/deepseek_v2.py), shared with GLM-4-MoE:
router configs from the HF config and the MoE block of one layer (ungated shared experts,
n_shared_experts x moe_intermediate_size)."""
from __future__ import annotations

from kestrel.layers.moe import RouterConfig, SparseMoeBlock
from kestrel.models.context import ModelContext
from kestrel.models.moe_base import cfg_get, moe_block_from_ctx


def deepseek_router(cfg) -> RouterConfig:
    """DeepSeek-V3 / GLM-4-MoE: sigmoid scores, e_score_correction_bias, groups ranked by their top-2 sum."""
    return RouterConfig(cfg_get(cfg, "n_routed_experts", "num_local_experts"), cfg.num_experts_per_tok, "sigmoid",
                        bool(getattr(cfg, "norm_topk_prob", True)), cfg_get(cfg, "n_group", default=1),
                        cfg_get(cfg, "topk_group", default=1), "top2_sum",
                        float(cfg_get(cfg, "routed_scaling_factor", default=1.0)), correction_bias=True)


def deepseek_v2_router(cfg) -> RouterConfig:
    """DeepSeek-V2: softmax scores, greedy or group_limited_greedy (groups ranked by their best score), no
    renormalization, routed_scaling_factor."""
    method = getattr(cfg, "topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise NotImplementedError(f"DeepSeek-V2 topk_method {method!r} is not supported")
    grouped = method == "group_limited_greedy"
    return RouterConfig(cfg_get(cfg, "n_routed_experts", "num_experts"), cfg.num_experts_per_tok, "softmax", False,
                        cfg_get(cfg, "n_group", default=1) if grouped else 1,
                        cfg_get(cfg, "topk_group", default=1) if grouped else 1, "max",
                        float(cfg_get(cfg, "routed_scaling_factor", default=1.0)))


def mistral4_router(cfg) -> RouterConfig:
    """Mistral Small 4: softmax scores, groups ranked by their top-2 sum, renormalized by `norm_topk_prob`,
    routed_scaling_factor; no correction bias."""
    return RouterConfig(cfg_get(cfg, "n_routed_experts", "num_local_experts"), cfg.num_experts_per_tok, "softmax",
                        bool(getattr(cfg, "norm_topk_prob", True)), cfg_get(cfg, "n_group", default=1),
                        cfg_get(cfg, "topk_group", default=1), "top2_sum",
                        float(cfg_get(cfg, "routed_scaling_factor", default=1.0)))


def deepseek_moe_block(ctx: ModelContext, prefix: str, router: RouterConfig) -> SparseMoeBlock:
    cfg = ctx.text
    shared = cfg_get(cfg, "n_shared_experts", default=0) * cfg.moe_intermediate_size
    return moe_block_from_ctx(ctx, prefix, router, cfg.moe_intermediate_size, shared, shared_name="shared_experts")
