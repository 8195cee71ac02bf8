"""Gemma (PaliGemma's decoder): the Llama decoder with RMSNorm scaling by (1 + weight), a GeLU-tanh gated MLP,
embeddings scaled by sqrt(hidden_size) and tied output embeddings."""
from __future__ import annotations

import torch

from kestrel.layers.norm import GemmaRMSNorm
from kestrel.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class GemmaAttention(LlamaAttention):
    norm_cls = GemmaRMSNorm


class GemmaDecoderLayer(LlamaDecoderLayer):
    attention_cls = GemmaAttention
    norm_cls = GemmaRMSNorm


class GemmaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        # the normalizer is rounded to the model's dtype first, as transformers does
        embeds = self.embed_tokens(input_ids)
        return embeds * torch.tensor(self.config.hidden_size ** 0.5, dtype=embeds.dtype)
