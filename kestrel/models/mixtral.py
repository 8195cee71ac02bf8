"""Mixtral: Llama attention, every layer a sparse MoE (`block_sparse_moe`, experts w1/w3/w2), softmax top-k
renormalized (the same numbers as a softmax over the top-k logits), no shared experts."""
from __future__ import annotations

from kestrel.layers.moe import RouterConfig
from kestrel.models.moe_base import MoEDecoderLayer, MoEForCausalLM, cfg_get, moe_block_from_ctx


class MixtralDecoderLayer(MoEDecoderLayer):
    mlp_name = "block_sparse_moe"

    def moe_block(self, ctx, prefix):
        cfg = ctx.text
        router = RouterConfig(cfg_get(cfg, "num_local_experts", "num_experts"), cfg.num_experts_per_tok, "softmax",
                              renormalize=True)
        return moe_block_from_ctx(ctx, prefix, router, cfg.intermediate_size)


class MixtralForCausalLM(MoEForCausalLM):
    decoder_layer_cls = MixtralDecoderLayer

    def __init__(self, ctx, prefix: str = "model"):
        window = getattr(ctx.text, "sliding_window", None)
        if window is not None and window < ctx.max_positions:
            raise NotImplementedError(f"Mixtral with sliding_window={window} is not supported yet")
        super().__init__(ctx, prefix)
