"""Cross-encoders and classifiers on BERT-style encoders (BertForSequenceClassification: ms-marco MiniLM, BGE
reranker v1; XLMRobertaForSequenceClassification: BGE-reranker-v2-m3, multilingual rerankers), served by
/classify, /score and /rerank. The pooler (kestrel/worker/addons/pooling.py) hands `pool_head` the [CLS] token's
last hidden state; the head is the checkpoint's: BERT's pooler (dense + tanh) then its `classifier` linear,
RoBERTa's `classifier` (dense + tanh + out_proj). A BERT text pair's second text has token type 1
(kestrel/models/bert.py pair_segments), found by the [SEP] id that `read_checkpoint` takes from the tokenizer."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kestrel.core.pooling import num_labels
from kestrel.errors import ConfigError
from kestrel.models.bert import BertModel, XLMRobertaModel
from kestrel.models.context import ModelContext


def _linear(ctx: ModelContext, out_features: int) -> nn.Linear:
    return nn.Linear(ctx.text.hidden_size, out_features, bias=True, dtype=ctx.dtype)


class BertPooler(nn.Module):
    def __init__(self, ctx: ModelContext):
        super().__init__()
        self.dense = _linear(ctx, ctx.text.hidden_size)


class BertForSequenceClassification(BertModel):
    dropped_heads = ("lm_head.", "cls.")  # keeps pooler.* (the head's first half)
    types_pairs = True

    def __init__(self, ctx: ModelContext, prefix: str = ""):
        super().__init__(ctx, prefix)
        self.pooler = BertPooler(ctx)
        self.classifier = _linear(ctx, num_labels(ctx.config.hf))

    def pool_head(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler.dense(cls_hidden)))

    @classmethod
    def read_checkpoint(cls, config, path: Path) -> None:
        """The [SEP] id that splits a text pair, where config.json does not name it: the checkpoint's tokenizer's."""
        text = config.text
        if getattr(text, "type_vocab_size", 1) < 2 or getattr(text, "sep_token_id", None) is not None:
            return
        from transformers import AutoTokenizer

        try:
            sep = AutoTokenizer.from_pretrained(str(path)).sep_token_id
        except (OSError, ValueError) as e:
            raise ConfigError(f"{config.architecture}: its tokenizer (for the [SEP] id that splits a text pair) "
                              f"cannot be read from {path}: {e}") from None
        text.sep_token_id = sep


class RobertaClassificationHead(nn.Module):
    def __init__(self, ctx: ModelContext):
        super().__init__()
        self.dense = _linear(ctx, ctx.text.hidden_size)
        self.out_proj = _linear(ctx, num_labels(ctx.config.hf))

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls_hidden)))


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """One token type (RoBERTa's vocabularies have none for pairs: `</s></s>` separates the texts)."""

    def __init__(self, ctx: ModelContext, prefix: str = ""):
        super().__init__(ctx, prefix)
        self.classifier = RobertaClassificationHead(ctx)

    def pool_head(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(cls_hidden)
