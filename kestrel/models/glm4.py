"""GLM-4 dense (`glm4`: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): the Llama decoder with sandwich norms (each
sublayer's output normed as well: post_self_attn_layernorm, post_mlp_layernorm), GLM-4-MoE's attention (q/k/v
bias by `attention_bias`, o_proj never; half of each head rotating unless `partial_rotary_factor` says otherwise)
with GPT-J pair rotary, and gate_up_proj fused in the checkpoint (loaded as our gate/up shards)."""
from __future__ import annotations

from typing import Iterable

import torch

from kestrel.models.glm4_moe import Glm4MoeAttention
from kestrel.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kestrel.models.weights import split_fused


class Glm4Attention(Glm4MoeAttention):
    rope_interleaved = True


class Glm4DecoderLayer(LlamaDecoderLayer):
    attention_cls = Glm4Attention
    norm_placement = "sandwich"


class Glm4ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Glm4DecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(split_fused(weights, "gate_up_proj", self.packed_modules["gate_up_proj"]))
