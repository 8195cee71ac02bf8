"""Mixtral: Llama attention, every layer a sparse MoE (`block_sparse_moe`, experts w1/w3/w2), softmax top-k
renormalized (the same numbers as a softmax over the top-k logits), no shared experts."""
from __future__ import annotations

from kestrel.layers.moe import RouterConfig, SparseMoeBlock
from kestrel.models.moe_base import MoEForCausalLM, cfg_get


class MixtralForCausalLM(MoEForCausalLM):
    mlp_name = "block_sparse_moe"

    def __init__(self, cfg, *args, **kwargs):
        window = getattr(cfg, "sliding_window", None)
        if window is not None and window < cfg.max_position_embeddings:
            raise NotImplementedError(f"Mixtral with sliding_window={window} is not supported yet")
        super().__init__(cfg, *args, **kwargs)

    def moe_block(self, cfg, i, prefix, dtype, quant_config, linear_backend, moe):
        router = RouterConfig(cfg_get(cfg, "num_local_experts", "num_experts"), cfg.num_experts_per_tok, "softmax",
                              renormalize=True)
        return SparseMoeBlock(prefix=prefix, hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.intermediate_size,
                              router=router, dtype=dtype, quant_config=quant_config, moe_backend=moe.moe_backend,
                              linear_backend=linear_backend, fuse_shared_experts=moe.fuse_shared_experts,
                              platform=moe.platform)
