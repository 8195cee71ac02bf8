"""Llama 4 text (Scout, Maverick): iRoPE attention and a top-1 MoE. Attention, from the config: chunked local
attention (`attention_chunk_size`) on the rotary layers (`layer_types` "chunked_attention"), full-context NoPE
layers (`no_rope_layers`) whose queries are temperature-tuned by position (`attn_temperature_tuning`), GPT-J pair
rotary, and an unweighted L2 q/k norm after the rotary on the rotary layers (`use_qk_norm`). Feed-forward
(`feed_forward`): MoE on `moe_layers` (top-1 sigmoid routing applied to the expert's input, plus an ungated shared
expert), dense MLPs of `intermediate_size_mlp` elsewhere. Checkpoints keep the experts stacked, [E, H, 2I] and
[E, I, H]: transposed to the MoE block's layout on load."""
from __future__ import annotations

from typing import Iterable

import torch

from kestrel.layers.linear import materialize
from kestrel.layers.moe import RouterConfig
from kestrel.layers.norm import L2Norm
from kestrel.models.context import layer_index
from kestrel.models.llama import LlamaAttention, uses_rope
from kestrel.models.moe_base import MoEDecoderLayer, MoEForCausalLM, moe_block_from_ctx


class Llama4Attention(LlamaAttention):
    rope_interleaved = True
    qk_norm_after_rope = True
    norm_cls = L2Norm

    def __init__(self, ctx, prefix, input_norm, **kw):
        cfg = ctx.text
        self.use_qk_norm = bool(getattr(cfg, "use_qk_norm", False)) and uses_rope(cfg, layer_index(prefix))
        super().__init__(ctx, prefix, input_norm, **kw)


class Llama4DecoderLayer(MoEDecoderLayer):
    attention_cls = Llama4Attention
    mlp_name = "feed_forward"
    dense_intermediate = "intermediate_size_mlp"

    def moe_block(self, ctx, prefix):
        cfg = ctx.text
        if layer_index(prefix) not in cfg.moe_layers:
            return None
        router = RouterConfig(cfg.num_local_experts, cfg.num_experts_per_tok, "sigmoid")
        return moe_block_from_ctx(ctx, prefix, router, cfg.intermediate_size, cfg.intermediate_size,
                                  shared_name="shared_expert", weights_on_input=True)


class Llama4ForCausalLM(MoEForCausalLM):
    decoder_layer_cls = Llama4DecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def layout(stream):
            for name, t in stream:
                if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    t = materialize(t).transpose(1, 2)
                yield name, t

        return super().load_weights(layout(weights))
