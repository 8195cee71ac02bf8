"""Pooling heads and methods. Heads over a decoder: a *ForSequenceClassification checkpoint is its decoder
(model.*) plus a `score` linear (hidden -> labels) read at the last token; an embedding checkpoint is the decoder alone (*Model: no head;
the pooled hidden state is the embedding). The pooler (kestrel/worker/addons/pooling.py) calls `pool_head`.
Which hidden states are pooled (the last token's, the first's, their mean) is `resolve_pooling`'s answer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from kestrel.core.pooling import num_labels
from kestrel.errors import ConfigError
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


POOLING_METHODS = ("last", "cls", "mean")
ST_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                    "pooling_mode_lasttoken": "last"}


def sentence_transformers_pooling(model_dir: Path) -> str | None:
    """The pooling a sentence-transformers checkpoint declares (modules.json -> its Pooling module's
    config.json), None without one. Pooling we do not implement (max, weighted mean, several at once) is
    refused rather than replaced."""
    modules = model_dir / "modules.json"
    if not modules.is_file():
        return None
    entry = next((m for m in json.loads(modules.read_text()) if str(m.get("type", "")).endswith(".Pooling")), None)
    if entry is None:
        return None
    cfg = json.loads((model_dir / entry.get("path", "") / "config.json").read_text())
    named = cfg.get("pooling_mode")
    if isinstance(named, str):
        modes = [{"cls_token": "cls", "cls": "cls", "mean_tokens": "mean", "mean": "mean",
                  "lasttoken": "last", "last": "last"}.get(named, named)]
    else:
        modes = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
        modes = [ST_POOLING_FLAGS.get(k, k) for k in modes]
    if len(modes) != 1 or modes[0] not in POOLING_METHODS:
        raise ConfigError(f"{entry.get('path')}/config.json asks for pooling {modes}: only one of cls, mean or "
                          f"last token is implemented")
    return modes[0]


def resolve_pooling(config, path) -> "HFConfig":
    """Set `config.encoder_only` and `config.pooling_method` (an HFConfig, returned) from the model class and
    the checkpoint folder: sentence-transformers' pooling config wins, else the class's default (CLS for a BERT
    encoder, as vLLM's; the last token for a decoder). A decoder pools only its last token: its prompt may be
    computed in chunks, so the earlier tokens' states are gone by the last step."""
    from kestrel.models.interfaces import is_encoder_only
    from kestrel.models.registry import get_model_class, is_supported

    if not is_supported(config.architecture):
        return config
    cls = get_model_class(config.architecture)
    config.encoder_only = is_encoder_only(cls)
    path = Path(path)
    method = (sentence_transformers_pooling(path) if path.is_dir() else None) or getattr(cls, "default_pooling",
                                                                                          "last")
    if method != "last" and not config.encoder_only:
        raise ConfigError(f"{config.architecture} is a decoder: only last-token pooling is implemented for it, "
                          f"not {method} (its sentence-transformers config)")
    config.pooling_method = method
    read = getattr(cls, "read_checkpoint", None)  # what a model class reads beside config.json (a [SEP] id)
    if read is not None and path.is_dir():
        read(config, path)
    return config
