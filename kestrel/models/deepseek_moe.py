"""The MoE half of DeepSeek-V2/V3 (their MLA attention comes with the next issue), shared with GLM-4-MoE:
router configs from the HF config and the MoE block of one layer (ungated shared experts,
n_shared_experts x moe_intermediate_size)."""
from __future__ import annotations

from kestrel.layers.moe import RouterConfig, SparseMoeBlock
from kestrel.models.moe_base import MoEOptions, cfg_get


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


def deepseek_moe_block(cfg, prefix: str, dtype, router: RouterConfig, quant_config=None,
                       linear_backend: str = "auto", moe: MoEOptions | None = None) -> SparseMoeBlock:
    moe = moe or MoEOptions()
    shared = cfg_get(cfg, "n_shared_experts", default=0) * cfg.moe_intermediate_size
    return SparseMoeBlock(prefix=prefix, hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
                          router=router, dtype=dtype, shared_intermediate_size=shared, shared_name="shared_experts",
                          quant_config=quant_config, moe_backend=moe.moe_backend, linear_backend=linear_backend,
                          fuse_shared_experts=moe.fuse_shared_experts, platform=moe.platform)
