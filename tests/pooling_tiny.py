"""Tiny random pooling checkpoints (transformers writes them) and transformers' reference outputs on the same
weights: a Qwen3ForSequenceClassification (classifier / cross-encoder) and a bare Qwen3Model (a last-token
embedder, Qwen3-Embedding style)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny import BASE

QWEN3 = dict(BASE, num_key_value_heads=2, head_dim=32)


def _randomize(model, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)


def make_classifier(root: Path, tokenizer, num_labels: int = 3, name: str | None = None, seed: int = 0) -> Path:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    labels = {i: f"class_{i}" for i in range(num_labels)}
    cfg = AutoConfig.for_model("qwen3", **QWEN3, num_labels=num_labels, id2label=labels,
                               label2id={v: k for k, v in labels.items()})
    model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    out = root / (name or f"qwen3_cls{num_labels}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_embedder(root: Path, tokenizer, seed: int = 1, **config) -> Path:
    from transformers import AutoConfig, AutoModel

    cfg = AutoConfig.for_model("qwen3", **QWEN3, **config)
    model = AutoModel.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    out = root / "qwen3_embed"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@torch.no_grad()
def hf_embedding(path: Path, ids: list[int]) -> torch.Tensor:
    """transformers' last-token hidden state, L2-normalised (Qwen3-Embedding's recipe)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1)


@torch.no_grad()
def hf_class_logits(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    return model(torch.tensor([ids])).logits[0]
