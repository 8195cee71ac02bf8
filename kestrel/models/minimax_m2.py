"""MiniMax-M2 (M2, M2.1, M2.5, M2.7): Olmo's attention (one q/k RMSNorm over all heads together, all-reduced
across tensor-parallel ranks) with partial rotary (`rotary_dim` or partial_rotary_factor); every layer an MoE block
(`block_sparse_moe`, experts w1/w3/w2) routed by sigmoid scores whose top-k choice a correction bias steers,
renormalized, no shared expert. Checkpoints are FP8 with 128x128 block scales (the loader's FP8 path)."""
from __future__ import annotations

from kestrel.layers.moe import RouterConfig
from kestrel.models.moe_base import MoEDecoderLayer, MoEForCausalLM, cfg_get, moe_block_from_ctx
from kestrel.models.olmo import OlmoAttention


class MiniMaxM2DecoderLayer(MoEDecoderLayer):
    attention_cls = OlmoAttention
    mlp_name = "block_sparse_moe"

    def moe_block(self, ctx, prefix):
        cfg = ctx.text
        router = RouterConfig(cfg_get(cfg, "num_local_experts", "num_experts"), cfg.num_experts_per_tok, "sigmoid",
                              renormalize=True, correction_bias=True)
        return moe_block_from_ctx(ctx, prefix, router, cfg.intermediate_size)


class MiniMaxM2ForCausalLM(MoEForCausalLM):
    decoder_layer_cls = MiniMaxM2DecoderLayer
