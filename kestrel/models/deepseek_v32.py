"""DeepSeek-V3.2 and GLM-5.x: DeepSeek-V3's MLA + MoE with DeepSeek Sparse Attention (kestrel/attention/
sparse_mla.py). Each attention layer has a lightning indexer whose projections live here: the indexer query from
the compressed MLA query (wq_b), one shared key from the layer input (wk, then a LayerNorm with bias), and per-head
weights (weights_proj, kept in float32 as transformers does). Rotary applies to the first qk_rope_head_dim dims of
the indexer's query and key, with the family's layout: DeepSeek-V3.2 half-split (NeoX), GLM-5 interleaved, unless
the config says otherwise (`indexer_rope_interleave`).

GLM-5.2 marks layers "shared" in `indexer_types`: such a layer has no indexer (no weights, its cache's index part
unused) and attends to the previous full layer's selection. Checkpoint layers past num_hidden_layers (multi-token
prediction) are skipped on load (DeepseekV2ForCausalLM.load_weights)."""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from kestrel.attention.sparse_mla import SparseMLAAttention
from kestrel.layers.linear import Linear
from kestrel.layers.rotary import RotaryEmbedding
from kestrel.models.context import ModelContext, layer_index
from kestrel.models.deepseek_v2 import DeepseekV2Attention, DeepseekV3DecoderLayer, DeepseekV3ForCausalLM


class Indexer(nn.Module):
    """The indexer's projections -> (q [T, H_I, D_I], k [T, D_I]) rotated, and w [T, H_I] float32 with the
    n_heads^-1/2 and head_dim^-1/2 scales folded in (both positive: they commute with the ReLU)."""

    def __init__(self, ctx: ModelContext, prefix: str, rotary: RotaryEmbedding):
        super().__init__()
        cfg = ctx.text
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear.from_ctx(ctx, cfg.q_lora_rank, self.n_heads * self.head_dim, f"{prefix}.wq_b")
        self.wk = Linear.from_ctx(ctx, cfg.hidden_size, self.head_dim, f"{prefix}.wk")
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=ctx.dtype)
        # float32, unquantized: transformers keeps it so (_keep_in_fp32_modules), FP8 checkpoints ship it unscaled
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, False, torch.float32, f"{prefix}.weights_proj",
                                   None, ctx.linear_backend, None, ctx.parallel)
        self.weight_scale = (self.n_heads * self.head_dim) ** -0.5
        self.rotary = rotary

    def forward(self, x: torch.Tensor, q_c: torch.Tensor, positions: torch.Tensor, queries: bool = True):
        """queries=False (a step that scores nothing): the keys alone, (None, k, None)."""
        t = x.shape[0]
        k = self.k_norm(self.wk(x)).view(t, 1, self.head_dim)
        if not queries:
            (k,) = self.rotary.rotate_copies(positions, k)
            return None, k.view(t, self.head_dim), None
        q = self.wq_b(q_c).view(t, self.n_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        w = self.weights_proj(x.float()) * self.weight_scale
        return q, k.view(t, self.head_dim), w


class DeepseekV32Attention(DeepseekV2Attention):
    indexer_rope_interleave: ClassVar[bool] = False  # the family's layout when the config does not say

    def __init__(self, ctx: ModelContext, prefix: str, input_norm: nn.Module):
        super().__init__(ctx, prefix, input_norm)
        cfg = ctx.text
        if not self.q_lora_rank:
            raise ValueError("DSA's indexer reads the compressed query: the config needs q_lora_rank")
        types = getattr(cfg, "indexer_types", None)
        idx = layer_index(prefix)
        self.indexer = None
        if not types or types[idx] == "full":
            interleaved = getattr(cfg, "indexer_rope_interleave", None)
            interleaved = self.indexer_rope_interleave if interleaved is None else bool(interleaved)
            rotary = ctx.shared(f"indexer_rotary_{interleaved}", lambda: RotaryEmbedding(
                cfg, cfg.qk_rope_head_dim, ctx.max_positions, ctx.dtype, interleaved=interleaved))
            self.indexer = Indexer(ctx, f"{prefix}.indexer", rotary)
        elif types[idx] != "shared":
            raise ValueError(f"indexer_types[{idx}] = {types[idx]!r}: expected 'full' or 'shared'")
        elif idx == 0 or "full" not in types[:idx]:
            raise ValueError(f"layer {idx} shares the top-k of a previous full indexer layer, but none precedes it")

    def build_mla(self, ctx: ModelContext, prefix: str, *args) -> nn.Module:
        cfg = ctx.text
        return SparseMLAAttention(ctx, prefix, *args, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk)

    def attend(self, q, kv_c, k_pe, positions, ctx, x, q_c):
        index = (None, None, None)
        if self.indexer is not None:  # keys always (they are cached); queries only where the step scores
            index = self.indexer(x, q_c, positions, queries=self.mla_attn.num_scored_tokens(ctx) > 0)
        return self.mla_attn(q, kv_c, k_pe, positions, ctx, *index)


class GlmMoeDsaAttention(DeepseekV32Attention):
    indexer_rope_interleave = True


class DeepseekV32DecoderLayer(DeepseekV3DecoderLayer):
    attention_cls = DeepseekV32Attention


class GlmMoeDsaDecoderLayer(DeepseekV3DecoderLayer):
    attention_cls = GlmMoeDsaAttention


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    decoder_layer_cls = DeepseekV32DecoderLayer


class GlmMoeDsaForCausalLM(DeepseekV3ForCausalLM):
    decoder_layer_cls = GlmMoeDsaDecoderLayer
