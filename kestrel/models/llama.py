"""Llama-family decoder (Llama, SmolLM2, Mistral-style), also the base of Qwen2 (q/k/v bias) and Qwen3 (q/k norm)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from kestrel.attention.layer import Attention, ForwardContext
from kestrel.errors import ConfigError
from kestrel.layers.activation import SiluAndMul, gated_activation
from kestrel.layers.embedding import LMHead, VocabEmbedding
from kestrel.layers.linear import Linear
from kestrel.layers.norm import RMSNorm
from kestrel.layers.norm_linear import NormLinear
from kestrel.layers.rotary import RotaryEmbedding
from kestrel.models.interfaces import SupportsLoRA
from kestrel.models.context import ModelContext
from kestrel.models.weights import load_named_weights


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def rank_heads(tp, num_heads: int, num_kv_heads: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(first, count) of this rank's query heads and KV heads. With fewer KV heads than ranks, each KV head is
    replicated over the ranks whose query heads read it."""
    q = tp.shard(num_heads, "num_attention_heads")
    if num_kv_heads >= tp.size:
        return q, tp.shard(num_kv_heads, "num_key_value_heads")
    if tp.size % num_kv_heads:
        raise ConfigError(f"--tensor-parallel-size {tp.size} is neither a divisor nor a multiple of "
                          f"num_key_value_heads = {num_kv_heads}")
    return q, (tp.rank * num_kv_heads // tp.size, 1)


class LlamaAttention(nn.Module):
    """q/k/v projection (with the input norm), attention, o_proj. `output_gate` (gated attention, Qwen3-Next and
    Qwen3.5): the projection also gives a gate per query channel (its 4th shard, `q_gate`; the checkpoint's q_proj
    holds it after each head's queries) and the attention output is multiplied by sigmoid(gate) before o_proj."""
    qkv_bias_default = False
    use_qk_norm = False
    norm_cls = RMSNorm
    output_gate = False

    def __init__(self, ctx: ModelContext, prefix: str, input_norm: nn.Module, **attn_kw):
        super().__init__()
        cfg = ctx.text
        num_heads = cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        head_dim = head_dim_of(cfg)
        bias = getattr(cfg, "attention_bias", False) or self.qkv_bias_default
        (q0, nq), (kv0, nkv) = rank_heads(ctx.parallel, num_heads, num_kv_heads)
        kv_rows, q_rows = (kv0 * head_dim, nkv * head_dim), (q0 * head_dim, nq * head_dim)
        gate = [num_heads * head_dim] if self.output_gate else []
        self.gate_size = nq * head_dim if self.output_gate else 0  # this rank's gate columns
        self.qkv_proj = Linear.from_ctx(ctx, cfg.hidden_size, [num_heads * head_dim, num_kv_heads * head_dim,
                                                               num_kv_heads * head_dim] + gate, f"{prefix}.qkv_proj",
                                        bias, "column", [q_rows, kv_rows, kv_rows] + [q_rows] * len(gate))
        self.o_proj = Linear.from_ctx(ctx, num_heads * head_dim, cfg.hidden_size, f"{prefix}.o_proj",
                                      getattr(cfg, "attention_bias", False), "row")
        num_heads, num_kv_heads = nq, nkv  # this rank's
        self.q_norm = self.k_norm = None
        if self.use_qk_norm:
            self.q_norm = self.norm_cls(head_dim, cfg.rms_norm_eps, ctx.dtype)
            self.k_norm = self.norm_cls(head_dim, cfg.rms_norm_eps, ctx.dtype)
        rotary = attn_kw.pop("rotary", None) or ctx.shared("rotary", lambda: RotaryEmbedding(
            cfg, head_dim, ctx.max_positions, ctx.dtype))
        self.attn = Attention(ctx, f"{prefix}.attn", num_heads, head_dim, num_kv_heads, rotary,
                              q_norm=self.q_norm, k_norm=self.k_norm, **attn_kw)
        self.qkv = NormLinear(input_norm, self.qkv_proj)

    def forward(self, positions, hidden, residual, ctx: ForwardContext):
        """(attention output, residual stream) from the layer input and the residual stream so far."""
        qkv, residual = self.qkv(hidden, residual)
        if self.gate_size:
            qkv, gate = qkv.split([qkv.shape[-1] - self.gate_size, self.gate_size], dim=-1)
            return self.o_proj(self.attn(qkv, positions, ctx) * torch.sigmoid(gate)), residual
        return self.o_proj(self.attn(qkv, positions, ctx)), residual


class LlamaMLP(nn.Module):
    """gate_up (with the post-attention norm) -> SiLU-and-mul -> down."""

    def __init__(self, ctx: ModelContext, prefix: str, input_norm: nn.Module, act: nn.Module | None = None):
        super().__init__()
        cfg = ctx.text
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = Linear.from_ctx(ctx, cfg.hidden_size, [cfg.intermediate_size] * 2,
                                            f"{prefix}.gate_up_proj", bias, "column")
        self.down_proj = Linear.from_ctx(ctx, cfg.intermediate_size, cfg.hidden_size, f"{prefix}.down_proj", bias,
                                         "row")
        self.act = act or SiluAndMul()
        self.gate_up = NormLinear(input_norm, self.gate_up_proj, self.act)

    def forward(self, hidden, residual):
        act, residual = self.gate_up(hidden, residual)
        return self.down_proj(act), residual


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention
    norm_cls = RMSNorm

    def __init__(self, ctx: ModelContext, prefix: str):
        super().__init__()
        cfg = ctx.text
        self.input_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.post_attention_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.self_attn = self.attention_cls(ctx, f"{prefix}.self_attn", self.input_layernorm)
        self.mlp = LlamaMLP(ctx, f"{prefix}.mlp", self.post_attention_layernorm,
                            gated_activation(getattr(cfg, "hidden_act", "silu")))

    def forward(self, positions, hidden, residual, ctx):
        # residual is None before the first layer; each norm adds the residual stream first
        hidden, residual = self.self_attn(positions, hidden, residual, ctx)
        return self.mlp(hidden, residual)


class LlamaForCausalLM(nn.Module, SupportsLoRA):
    decoder_layer_cls = LlamaDecoderLayer
    norm_cls = RMSNorm
    # our merged module -> the checkpoint's modules it stacks, in shard order
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, ctx: ModelContext, prefix: str = "model"):
        super().__init__()
        cfg = ctx.text
        self.config = cfg
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.dtype, ctx.parallel)
        self.layers = nn.ModuleList(self.decoder_layer_cls(ctx, f"{prefix}.layers.{i}")
                                    for i in range(cfg.num_hidden_layers))
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        tied = getattr(cfg, "tie_word_embeddings", False)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, ctx.dtype, tied_to=self.embed_tokens if tied else None,
                              tp=ctx.parallel)

    # The embedding contract: forward(inputs_embeds=embed_input_ids(ids)) == forward(input_ids=ids).
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, ctx: ForwardContext, inputs_embeds=None) -> torch.Tensor:
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(self, weights, self.packed_modules,
                                  skip_lm_head=getattr(self.config, "tie_word_embeddings", False))
