"""Hunyuan-A13B (HunYuanMoEV1): Llama attention with a per-head q/k RMSNorm applied after the rotary
(query_layernorm / key_layernorm) and an NTK-alpha rope base (rope_parameters `alpha`: rotary.py); every layer an
MoE block: softmax top-k renormalized (`gate.wg`), plus an ungated shared MLP (`shared_mlp`). Per-layer lists
(num_experts, moe_topk, moe_intermediate_size, num_shared_expert) are read at the layer's index."""
from __future__ import annotations

from kestrel.layers.moe import RouterConfig
from kestrel.models.context import layer_index
from kestrel.models.llama import LlamaAttention
from kestrel.models.moe_base import MoEDecoderLayer, MoEForCausalLM, moe_block_from_ctx


class HunYuanAttention(LlamaAttention):
    use_qk_norm = True
    qk_norm_after_rope = True
    qk_norm_names = ("query_layernorm", "key_layernorm")


def at_layer(value, i: int):
    return value[i] if isinstance(value, (list, tuple)) else value


class HunYuanMoEV1DecoderLayer(MoEDecoderLayer):
    attention_cls = HunYuanAttention

    def moe_block(self, ctx, prefix):
        cfg, i = ctx.text, layer_index(prefix)
        router = RouterConfig(at_layer(cfg.num_experts, i), at_layer(cfg.moe_topk, i), "softmax", renormalize=True)
        inter = at_layer(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size, i)
        shared = cfg.intermediate_size * at_layer(getattr(cfg, "num_shared_expert", 1), i)
        return moe_block_from_ctx(ctx, prefix, router, inter, shared, shared_name="shared_mlp")


class HunYuanMoEV1ForCausalLM(MoEForCausalLM):
    decoder_layer_cls = HunYuanMoEV1DecoderLayer
