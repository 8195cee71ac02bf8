"""ERNIE-4.5-MoE: Llama attention with GPT-J pair rotary and bias on q/k/v/o by `use_bias`; MoE layers where
(i + 1) % moe_layer_interval == 0 within [moe_layer_start_index, moe_layer_end_index], routed by a softmax whose
top-k choice a correction bias steers (the weights are the unbiased scores, renormalized), plus ungated shared
experts (moe_num_shared_experts x moe_intermediate_size)."""
from __future__ import annotations

from kestrel.layers.moe import RouterConfig
from kestrel.models.context import layer_index
from kestrel.models.llama import LlamaAttention
from kestrel.models.moe_base import MoEDecoderLayer, MoEForCausalLM, moe_block_from_ctx


class Ernie4_5_MoeAttention(LlamaAttention):
    rope_interleaved = True

    def __init__(self, ctx, prefix, input_norm, **kw):
        self.qkv_bias_default = bool(getattr(ctx.text, "use_bias", False))
        super().__init__(ctx, prefix, input_norm, **kw)


def is_moe_layer(cfg, i: int) -> bool:
    end = cfg.moe_layer_end_index if cfg.moe_layer_end_index >= 0 else cfg.num_hidden_layers - 1
    return (i + 1) % cfg.moe_layer_interval == 0 and cfg.moe_layer_start_index <= i <= end


class Ernie4_5_MoeDecoderLayer(MoEDecoderLayer):
    attention_cls = Ernie4_5_MoeAttention

    def moe_block(self, ctx, prefix):
        cfg = ctx.text
        if getattr(cfg, "use_bias", False):
            raise NotImplementedError("ERNIE-4.5-MoE with use_bias (MLP biases) is not supported")
        if not is_moe_layer(cfg, layer_index(prefix)):
            return None
        router = RouterConfig(cfg.moe_num_experts, cfg.moe_k, "softmax", renormalize=True, correction_bias=True)
        return moe_block_from_ctx(ctx, prefix, router, cfg.moe_intermediate_size,
                                  cfg.moe_num_shared_experts * cfg.moe_intermediate_size)


class Ernie4_5_MoeForCausalLM(MoEForCausalLM):
    decoder_layer_cls = Ernie4_5_MoeDecoderLayer
