"""gpt-oss (20b, 120b): Llama attention with q/k/v/o biases, attention sinks, sliding (128) and full layers
alternating by `layer_types`, YaRN rotary; every layer an MoE block (`mlp`: `router` with a bias, softmax over the
top-k logits; experts stacked in one tensor, gate/up interleaved, with biases and the clamped SwiGLU). The released
checkpoints store the experts in MXFP4 (`*_blocks` / `*_scales`: the mxfp4 expert format)."""
from __future__ import annotations

from kestrel.errors import ConfigError
from kestrel.kernels.moe import SWIGLU_OAI_LIMIT
from kestrel.layers.moe import RouterConfig, StackedExperts
from kestrel.models.llama import LlamaAttention
from kestrel.models.moe_base import MoEDecoderLayer, MoEForCausalLM, moe_block_from_ctx


class GptOssAttention(LlamaAttention):
    attention_sinks = True


class GptOssDecoderLayer(MoEDecoderLayer):
    attention_cls = GptOssAttention

    def moe_block(self, ctx, prefix):
        cfg = ctx.text
        limit = getattr(cfg, "swiglu_limit", SWIGLU_OAI_LIMIT)  # the released configs say 7.0, as the activation
        if limit != SWIGLU_OAI_LIMIT:
            raise ConfigError(f"gpt-oss with swiglu_limit {limit} is not supported (only {SWIGLU_OAI_LIMIT})")
        router = RouterConfig(cfg.num_local_experts, cfg.num_experts_per_tok, "softmax", renormalize=True,
                              logit_bias=True)
        return moe_block_from_ctx(ctx, prefix, router, cfg.intermediate_size, activation="swigluoai",
                                  expert_bias=True, stacked=StackedExperts(transposed=True, interleaved=True))


class GptOssForCausalLM(MoEForCausalLM):
    decoder_layer_cls = GptOssDecoderLayer
