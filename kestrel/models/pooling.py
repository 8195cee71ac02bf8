"""Pooling heads over a decoder: a *ForSequenceClassification checkpoint is its decoder (model.*) plus a `score`
linear (hidden -> labels) read at the last token; an embedding checkpoint is the decoder alone (*Model: no head;
the pooled hidden state is the embedding). The pooler (kestrel/worker/addons/pooling.py) calls `pool_head`."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from kestrel.core.pooling import num_labels
from kestrel.models.context import ModelContext


class SequenceClassifierMixin:
    """Put before a decoder class (class X(SequenceClassifierMixin, Qwen3ForCausalLM)): adds the score head."""

    def __init__(self, ctx: ModelContext, prefix: str = "model"):
        super().__init__(ctx, prefix)
        self.score = nn.Linear(ctx.text.hidden_size, num_labels(ctx.config.hf), bias=False, dtype=ctx.dtype)

    def pool_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.score(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((n, w) for n, w in weights if n != "lm_head.weight")


def classifier_class(decoder_cls: type) -> type:
    return type(decoder_cls.__name__.replace("ForCausalLM", "ForSequenceClassification"),
                (SequenceClassifierMixin, decoder_cls), {})


def pool_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The model's head over pooled hidden states: its classifier's logits, else the states (embeddings)."""
    head = getattr(model, "pool_head", None)
    return head(hidden) if head is not None else hidden
