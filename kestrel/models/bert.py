"""BERT-style encoders served as embedding models (BertModel: BGE, E5, MiniLM; XLMRobertaModel: multilingual E5,
BGE-M3's dense part). Every token attends to the whole prompt (EncoderOnly: the prompt is one bidirectional
prefix, computed in one step), positions are learned absolute embeddings (XLM-R's start after its padding id),
one token type (single texts), and each sub-layer ends in a LayerNorm after its residual (post-LN). The pooler
(kestrel/worker/addons/pooling.py) pools the last hidden states: CLS or mean, as the checkpoint says."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from kestrel.attention.layer import Attention, ForwardContext
from kestrel.errors import ConfigError
from kestrel.layers.linear import Linear
from kestrel.models.context import ModelContext
from kestrel.models.interfaces import EncoderOnly
from kestrel.models.llama import rank_heads
from kestrel.models.vision.encoder import activation
from kestrel.models.weights import load_named_weights

CHECKPOINT_PREFIXES = ("bert.", "roberta.")  # checkpoints saved from a *ForMaskedLM / task model


class NoRotary:
    """Absolute position embeddings are added to the input: the attention layer rotates nothing."""
    rot_dim = 0

    def __call__(self, positions, q, k):
        return q, k


class BertSelfAttention(nn.Module):
    def __init__(self, ctx: ModelContext, prefix: str):
        super().__init__()
        cfg = ctx.text
        heads = cfg.num_attention_heads
        head_dim = cfg.hidden_size // heads
        (q0, nq), _ = rank_heads(ctx.parallel, heads, heads)
        rows = (q0 * head_dim, nq * head_dim)
        self.qkv_proj = Linear.from_ctx(ctx, cfg.hidden_size, [cfg.hidden_size] * 3, f"{prefix}.qkv_proj", True,
                                        "column", [rows] * 3)
        self.attn = Attention(ctx, f"{prefix}.attn", nq, head_dim, nq, ctx.shared("no_rotary", NoRotary))


class BertSubLayerOutput(nn.Module):
    """dense -> + residual -> LayerNorm (BertSelfOutput and BertOutput)."""

    def __init__(self, ctx: ModelContext, prefix: str, input_size: int):
        super().__init__()
        cfg = ctx.text
        self.dense = Linear.from_ctx(ctx, input_size, cfg.hidden_size, f"{prefix}.dense", True, "row")
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=ctx.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, ctx: ModelContext, prefix: str):
        super().__init__()
        self.add_module("self", BertSelfAttention(ctx, f"{prefix}.self"))  # the checkpoint's module names
        self.output = BertSubLayerOutput(ctx, f"{prefix}.output", ctx.text.hidden_size)

    def forward(self, hidden, positions, ctx: ForwardContext):
        inner = getattr(self, "self")
        return self.output(inner.attn(inner.qkv_proj(hidden), positions, ctx), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, ctx: ModelContext, prefix: str):
        super().__init__()
        cfg = ctx.text
        self.dense = Linear.from_ctx(ctx, cfg.hidden_size, cfg.intermediate_size, f"{prefix}.dense", True, "column")
        self.act = activation(cfg.hidden_act)

    def forward(self, x):
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, ctx: ModelContext, prefix: str):
        super().__init__()
        self.attention = BertAttention(ctx, f"{prefix}.attention")
        self.intermediate = BertIntermediate(ctx, f"{prefix}.intermediate")
        self.output = BertSubLayerOutput(ctx, f"{prefix}.output", ctx.text.intermediate_size)

    def forward(self, hidden, positions, ctx):
        hidden = self.attention(hidden, positions, ctx)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, ctx: ModelContext, prefix: str):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(ctx, f"{prefix}.layer.{i}") for i in range(ctx.text.num_hidden_layers))


class BertEmbeddings(nn.Module):
    def __init__(self, ctx: ModelContext, position_offset: int):
        super().__init__()
        cfg = ctx.text
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=ctx.dtype)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype=ctx.dtype)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size, dtype=ctx.dtype)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=ctx.dtype)
        self.position_offset = position_offset

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        # one text: every token has type 0; a cross-encoder's text pair: its second text has type 1
        types = self.token_type_embeddings.weight[0] if token_types is None else self.token_type_embeddings(token_types)
        x = inputs_embeds + self.position_embeddings(positions + self.position_offset) + types
        return self.LayerNorm(x)


def pair_segments(input_ids: torch.Tensor, positions: torch.Tensor, sep_token_id: int) -> torch.Tensor:
    """Token types of flattened prompts (each starts at position 0; an encoder's prompt is one step): 0 up to and
    including a prompt's first [SEP], 1 after it, as a BERT tokenizer types a text pair ([CLS] a [SEP] b [SEP]).
    No host sync: the SEPs before each token, less those before its prompt's start (a running maximum)."""
    is_sep = (input_ids == sep_token_id).to(torch.int64)
    before = torch.cumsum(is_sep, 0) - is_sep
    base = torch.cummax(torch.where(positions == 0, before, torch.zeros_like(before)), 0).values
    return (before > base).to(torch.int64)


class BertModel(nn.Module, EncoderOnly):
    packed_modules = {"qkv_proj": ("query", "key", "value")}
    dropped_heads = ("pooler.", "lm_head.", "cls.")  # checkpoint heads that sentence embeddings do not use
    types_pairs = False  # a cross-encoder (kestrel/models/bert_classifier.py): a text pair's second text is type 1

    def __init__(self, ctx: ModelContext, prefix: str = ""):
        super().__init__()
        cfg = ctx.text
        if getattr(cfg, "position_embedding_type", "absolute") not in ("absolute", None):
            raise ConfigError(f"{type(self).__name__}: position_embedding_type {cfg.position_embedding_type!r} is "
                              f"not implemented (absolute only)")
        offset = self.position_offset(cfg)
        if ctx.max_positions + offset > cfg.max_position_embeddings:
            raise ConfigError(f"--max-model-len {ctx.max_positions}: this encoder has "
                              f"{cfg.max_position_embeddings - offset} positions")
        self.config = cfg
        self.sep_token_id = getattr(cfg, "sep_token_id", None) if self.types_pairs and cfg.type_vocab_size > 1 \
            else None
        if self.types_pairs and cfg.type_vocab_size > 1 and self.sep_token_id is None:
            raise ConfigError(f"{type(self).__name__}: no [SEP] token id (config.json sep_token_id, or the "
                              f"checkpoint's tokenizer) to tell a text pair's two texts apart")
        self.embeddings = BertEmbeddings(ctx, offset)
        self.encoder = BertEncoder(ctx, f"{prefix}encoder")

    @staticmethod
    def position_offset(cfg) -> int:
        return 0

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings.word_embeddings(input_ids)

    def forward(self, input_ids, positions, ctx: ForwardContext, inputs_embeds=None) -> torch.Tensor:
        embeds = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        types = pair_segments(input_ids, positions, self.sep_token_id) \
            if self.sep_token_id is not None and input_ids is not None else None
        hidden = self.embeddings(embeds, positions, types)
        for layer in self.encoder.layer:
            hidden = layer(hidden, positions, ctx)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores over the vocabulary by the word embeddings: the runner's start-up profile and warm-up call it;
        no request samples from an encoder."""
        return hidden @ self.embeddings.word_embeddings.weight.T

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def ours(named):
            for name, w in named:
                name = next((name[len(p):] for p in CHECKPOINT_PREFIXES if name.startswith(p)), name)
                if not name.startswith(self.dropped_heads):
                    yield name, w
        return load_named_weights(self, ours(weights), self.packed_modules, strip="")


class XLMRobertaModel(BertModel):
    @staticmethod
    def position_offset(cfg) -> int:
        return cfg.pad_token_id + 1  # RoBERTa numbers positions after the padding id
