"""Tiny random pooling checkpoints (transformers writes them) and transformers' reference outputs on the same
weights: a Qwen3ForSequenceClassification (classifier / cross-encoder), a bare Qwen3Model (a last-token
embedder, Qwen3-Embedding style) and BERT-style encoders (BertModel, XLMRobertaModel), optionally with a
sentence-transformers pooling config. sentence-transformers is not installed: the encoders' reference pooling
(CLS / mean, then L2 norm) is plain torch over transformers' last hidden states."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny import BASE, VOCAB_SIZE

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


ENCODER = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, type_vocab_size=2)


def make_encoder(root: Path, tokenizer, model_type: str = "bert", pooling: str | None = None, seed: int = 4) -> Path:
    """A tiny random encoder checkpoint; `pooling` ("cls" | "mean") writes sentence-transformers' modules.json
    and 1_Pooling/config.json as a BGE / E5 checkpoint has them."""
    import json

    from transformers import AutoConfig, AutoModel

    extra = dict(max_position_embeddings=514, pad_token_id=1, type_vocab_size=1) if model_type == "xlm-roberta" \
        else dict(max_position_embeddings=512)
    cfg = AutoConfig.for_model(model_type, **{**ENCODER, **extra})
    model = AutoModel.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    with torch.no_grad():  # LayerNorm weights and biases away from 1 and 0, so that they matter
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    out = root / f"{model_type}_{pooling or 'plain'}"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if pooling:
        (out / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (out / "1_Pooling").mkdir()
        (out / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 64, "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_lasttoken": False}))
    return out


@torch.no_grad()
def hf_encoder_embedding(path: Path, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' last hidden states of one unpadded prompt, pooled in plain torch as sentence-transformers
    pools them (cls: the first token; mean: all tokens, no padding to mask), then L2-normalised."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    hidden = model(torch.tensor([ids])).last_hidden_state[0]
    pooled = hidden[0] if pooling == "cls" else hidden.mean(0)
    return torch.nn.functional.normalize(pooled, dim=-1)
