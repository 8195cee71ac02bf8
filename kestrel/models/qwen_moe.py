"""Qwen2-MoE (sigmoid-gated shared expert, q/k/v bias by `qkv_bias`) and Qwen3-MoE (no shared expert, q/k norm).

Sparse layers: i not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0; the others are dense MLPs of
`intermediate_size`. Router: softmax top-k, renormalized when `norm_topk_prob`."""
from __future__ import annotations

from kestrel.layers.moe import RouterConfig
from kestrel.models.context import layer_index
from kestrel.models.llama import LlamaAttention
from kestrel.models.moe_base import MoEDecoderLayer, MoEForCausalLM, cfg_get, moe_block_from_ctx
from kestrel.models.qwen import Qwen3Attention


class Qwen2MoeAttention(LlamaAttention):
    def __init__(self, ctx, prefix, input_norm, **kw):
        self.qkv_bias_default = bool(getattr(ctx.text, "qkv_bias", True))
        super().__init__(ctx, prefix, input_norm, **kw)


def is_sparse_layer(cfg, i: int) -> bool:
    step = cfg_get(cfg, "decoder_sparse_step", default=1)
    return (i not in cfg_get(cfg, "mlp_only_layers", default=[])
            and cfg_get(cfg, "num_experts", "num_local_experts", default=0) > 0 and (i + 1) % step == 0)


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    attention_cls = Qwen3Attention
    shared = False
    norm_topk: bool | None = None  # renormalise the top-k weights; None: the config's norm_topk_prob

    def moe_block(self, ctx, prefix):
        cfg = ctx.text
        if not is_sparse_layer(cfg, layer_index(prefix)):
            return None
        renorm = bool(getattr(cfg, "norm_topk_prob", False)) if self.norm_topk is None else self.norm_topk
        router = RouterConfig(cfg_get(cfg, "num_experts", "num_local_experts"), cfg.num_experts_per_tok, "softmax",
                              renorm)
        shared = dict(shared_intermediate_size=cfg.shared_expert_intermediate_size, shared_gated=True,
                      shared_name="shared_expert") if self.shared else {}
        return moe_block_from_ctx(ctx, prefix, router, cfg.moe_intermediate_size, **shared)


class Qwen2MoeDecoderLayer(Qwen3MoeDecoderLayer):
    attention_cls = Qwen2MoeAttention
    shared = True


class Qwen3MoeForCausalLM(MoEForCausalLM):
    decoder_layer_cls = Qwen3MoeDecoderLayer


class Qwen2MoeForCausalLM(MoEForCausalLM):
    decoder_layer_cls = Qwen2MoeDecoderLayer
