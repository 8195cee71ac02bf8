"""Llama-family decoder (Llama, SmolLM2, Mistral-style), also the base of Qwen2 (q/k/v bias) and Qwen3 (q/k norm)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from kestrel.attention.layer import Attention, ForwardContext
from kestrel.errors import ConfigError
from kestrel.layers.activation import SiluAndMul, gated_activation
from kestrel.layers.embedding import LMHead, VocabEmbedding
from kestrel.layers.linear import Linear, materialize
from kestrel.layers.norm import AllHeadsRMSNorm, ResidualAdd, RMSNorm
from kestrel.layers.norm_linear import NormLinear
from kestrel.layers.rotary import QueryScale, RotaryEmbedding, mrope_option, rope_fraction
from kestrel.models.interfaces import SupportsLoRA
from kestrel.models.context import ModelContext, layer_index
from kestrel.models.weights import load_named_weights


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def layer_config(cfg, idx: int):
    """Layer idx's view of the config: transformers' per-layer overrides (`per_layer_config`: Gemma 4's head size
    and KV-head count on its global layers) where the config has them, else the config itself."""
    return cfg.per_layer_config[idx] if getattr(cfg, "is_heterogeneous", False) else cfg


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


def layer_type_of(cfg, idx: int) -> str | None:
    types = getattr(cfg, "layer_types", None)
    return types[idx] if types else None


def sliding_window_of(cfg, idx: int, max_positions: int) -> int | None:
    """Layer idx's window: by `layer_types` where the config has them (Qwen2/3, Olmo 3, SmolLM3), else the config's
    `sliding_window` on every layer (Mistral, Ministral 3) unless `use_sliding_window` is off. A window no shorter
    than the context changes nothing and is dropped."""
    window = getattr(cfg, "sliding_window", None)
    kind = layer_type_of(cfg, idx)
    if kind is not None:
        window = window if kind == "sliding_attention" else None
    elif not getattr(cfg, "use_sliding_window", True):
        window = None
    return window if window and window < max_positions else None


def uses_rope(cfg, idx: int) -> bool:
    """`no_rope_layers[idx]` 0 marks a NoPE layer (SmolLM3, Llama 4; 1 = rotary)."""
    flags = getattr(cfg, "no_rope_layers", None)
    return bool(flags[idx]) if flags else True


class LlamaAttention(nn.Module):
    """q/k/v projection (with the input norm), attention, o_proj. Options, set by a family (class attributes) or
    read from the config:
      bias: q/k/v by `attention_bias` (or `qkv_bias_default`); o_proj by `attention_out_bias` where the config has
        it (Seed-OSS), else as q/k/v unless `o_bias_follows_qkv` is off (GLM-4-MoE)
      q/k norm: `use_qk_norm` per head (Qwen3), `qk_norm_all_heads` (one norm over all heads: Olmo 3, MiniMax-M2;
        all-reduced under tensor parallelism), `qk_norm_after_rope` (Hunyuan), `norm_cls` (an unweighted L2Norm:
        Llama 4), `qk_norm_names` (the checkpoint's module names)
      rotary: `rope_interleaved` (GPT-J pairs: ERNIE 4.5, Llama 4), M-RoPE where rope_parameters carry
        `mrope_section` or the family has `mrope_default` (sections, interleaved), a share of each head
        (`partial_rotary_factor`, or `rope_fraction_default`), per layer type (rope_parameters keyed by `layer_types`: Olmo 3), none on NoPE
        layers (`no_rope_layers`)
      sliding window per layer (sliding_window_of), chunked local attention (`layer_types` "chunked_attention":
        Llama 4), query scaling by position (QueryScale: Ministral 3, Llama 4)
      `output_gate` (gated attention: Qwen3-Next, Qwen3.5): the projection also gives a gate per query channel (its
        4th shard, `q_gate`; the checkpoint's q_proj holds it after each head's queries) and the attention output
        is multiplied by sigmoid(gate) before o_proj
      `attention_sinks` (gpt-oss): a learned logit per query head in the softmax denominator, the checkpoint's
        `self_attn.sinks` (load_weight takes this rank's heads)"""
    qkv_bias_default = False
    o_bias_follows_qkv = True
    use_qk_norm = False
    qk_norm_all_heads = False
    qk_norm_after_rope = False
    qk_norm_names = ("q_norm", "k_norm")
    norm_cls = RMSNorm
    rope_interleaved = False
    rope_fraction_default = 1.0
    mrope_default: tuple[list[int], bool] | None = None
    output_gate = False
    attention_sinks = False

    def __init__(self, ctx: ModelContext, prefix: str, input_norm: nn.Module, **attn_kw):
        super().__init__()
        cfg = ctx.text
        num_heads = cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        head_dim = head_dim_of(cfg)
        bias = getattr(cfg, "attention_bias", False) or self.qkv_bias_default
        o_bias = getattr(cfg, "attention_out_bias", None)
        if o_bias is None:
            o_bias = bias if self.o_bias_follows_qkv else False
        (q0, nq), (kv0, nkv) = rank_heads(ctx.parallel, num_heads, num_kv_heads)
        kv_rows, q_rows = (kv0 * head_dim, nkv * head_dim), (q0 * head_dim, nq * head_dim)
        gate = [num_heads * head_dim] if self.output_gate else []
        self.gate_size = nq * head_dim if self.output_gate else 0  # this rank's gate columns
        self.qkv_proj = Linear.from_ctx(ctx, cfg.hidden_size, [num_heads * head_dim, num_kv_heads * head_dim,
                                                               num_kv_heads * head_dim] + gate, f"{prefix}.qkv_proj",
                                        bias, "column", [q_rows, kv_rows, kv_rows] + [q_rows] * len(gate))
        self.o_proj = Linear.from_ctx(ctx, num_heads * head_dim, cfg.hidden_size, f"{prefix}.o_proj", o_bias, "row")
        idx = layer_index(prefix)
        rope = uses_rope(cfg, idx)
        q_norm = k_norm = None
        if self.use_qk_norm and self.qk_norm_all_heads:
            tp = ctx.parallel
            q_norm = AllHeadsRMSNorm(num_heads * head_dim, cfg.rms_norm_eps, ctx.dtype, tp, q_rows)
            k_norm = AllHeadsRMSNorm(num_kv_heads * head_dim, cfg.rms_norm_eps, ctx.dtype, tp, kv_rows,
                                     replicas=tp.size * nkv // num_kv_heads)
        elif self.use_qk_norm:
            q_norm, k_norm = (self.norm_cls(head_dim, cfg.rms_norm_eps, ctx.dtype),
                              self.norm_cls(head_dim, cfg.rms_norm_eps, ctx.dtype))
        if q_norm is not None:
            for name, norm in zip(self.qk_norm_names, (q_norm, k_norm)):
                setattr(self, name, norm)
        rotary = attn_kw.pop("rotary", None) or (self.build_rotary(ctx, idx, head_dim) if rope else None)
        attn_kw.setdefault("sliding_window", sliding_window_of(cfg, idx, ctx.max_positions))
        if layer_type_of(cfg, idx) == "chunked_attention":
            attn_kw.setdefault("attention_chunk_size", cfg.attention_chunk_size)
        attn_kw.setdefault("query_scale", QueryScale.from_config(cfg, nope_layer=not rope))
        self.q_heads = (q0, nq)
        self.attn = Attention(ctx, f"{prefix}.attn", nq, head_dim, nkv, rotary, q_norm=q_norm, k_norm=k_norm,
                              qk_norm_all_heads=self.qk_norm_all_heads, qk_norm_after_rope=self.qk_norm_after_rope,
                              sinks=self.attention_sinks, **attn_kw)
        self.qkv = NormLinear(input_norm, self.qkv_proj)

    def build_rotary(self, ctx: ModelContext, idx: int, head_dim: int) -> RotaryEmbedding:
        """One rotary per model (per layer type where rope_parameters are keyed by layer type), shared by layers."""
        cfg = ctx.text
        kind = layer_type_of(cfg, idx)
        params = getattr(cfg, "rope_parameters", None) or {}
        kind = kind if kind in params else None
        dim = getattr(cfg, "rotary_dim", None) or int(head_dim * rope_fraction(cfg, self.rope_fraction_default))
        return ctx.shared("rotary" if kind is None else f"rotary.{kind}", lambda: RotaryEmbedding(
            cfg, dim, ctx.max_positions, ctx.dtype, layer_type=kind, interleaved=self.rope_interleaved,
            mrope=mrope_option(cfg, self.mrope_default)))

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """A tensor of this module itself (not of a projection): the attention sinks, this rank's heads."""
        if not name.endswith(".sinks") or self.attn.sinks is None:
            raise KeyError(f"{name}: not a tensor of this attention (sinks only where `attention_sinks` is on)")
        self.attn.sinks.data.copy_(materialize(tensor).narrow(0, *self.q_heads))

    def forward(self, positions, hidden, residual, ctx: ForwardContext):
        """(attention output, residual stream) from the layer input and the residual stream so far."""
        qkv, residual = self.qkv(hidden, residual)
        if self.gate_size:
            qkv, gate = qkv.split([qkv.shape[-1] - self.gate_size, self.gate_size], dim=-1)
            return self.o_proj(self.attn(qkv, positions, ctx) * torch.sigmoid(gate)), residual
        return self.o_proj(self.attn(qkv, positions, ctx)), residual


class LlamaMLP(nn.Module):
    """gate_up (with the post-attention norm) -> SiLU-and-mul -> down."""

    def __init__(self, ctx: ModelContext, prefix: str, input_norm: nn.Module, act: nn.Module | None = None,
                 intermediate_size: int | None = None):
        super().__init__()
        cfg = ctx.text
        bias = getattr(cfg, "mlp_bias", False)
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear.from_ctx(ctx, cfg.hidden_size, [inter] * 2, f"{prefix}.gate_up_proj", bias, "column")
        self.down_proj = Linear.from_ctx(ctx, inter, cfg.hidden_size, f"{prefix}.down_proj", bias, "row")
        self.act = act or SiluAndMul()
        self.gate_up = NormLinear(input_norm, self.gate_up_proj, self.act)

    def forward(self, hidden, residual):
        act, residual = self.gate_up(hidden, residual)
        return self.down_proj(act), residual


# where a decoder layer's norms sit: (attention input, MLP input, attention output, MLP output), each slot the
# norm's checkpoint name or None (no norm there)
NORM_PLACEMENTS = {
    "pre": ("input_layernorm", "post_attention_layernorm", None, None),
    "post": (None, None, "post_attention_layernorm", "post_feedforward_layernorm"),  # Olmo 2/3
    "sandwich": ("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm",
                 "post_mlp_layernorm"),  # GLM-4 (its names)
}


class LlamaDecoderLayer(nn.Module):
    """Attention then MLP, each added to the residual stream. `norm_placement` (NORM_PLACEMENTS) "pre": a norm on
    each sublayer's input; "post": a norm on each sublayer's output instead (Olmo 2/3); "sandwich": both (GLM-4)."""
    attention_cls = LlamaAttention
    norm_cls = RMSNorm
    norm_placement = "pre"

    def __init__(self, ctx: ModelContext, prefix: str):
        super().__init__()
        cfg = ctx.text
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"unknown norm_placement {self.norm_placement!r}")
        names = NORM_PLACEMENTS[self.norm_placement]
        norms = [None if n is None else self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype) for n in names]
        for name, norm in zip(names, norms):
            if norm is not None:
                setattr(self, name, norm)
        # an input slot without a norm only adds the residual stream
        attn_in, mlp_in = (ResidualAdd() if n is None else n for n in norms[:2])
        self._out_norms = tuple(norms[2:])
        self.self_attn = self.attention_cls(ctx, f"{prefix}.self_attn", attn_in)
        self.mlp = LlamaMLP(ctx, f"{prefix}.mlp", mlp_in, gated_activation(getattr(cfg, "hidden_act", "silu")))

    def forward(self, positions, hidden, residual, ctx):
        # residual is None before the first layer; each input norm adds the residual stream first
        attn_out, mlp_out = self._out_norms
        hidden, residual = self.self_attn(positions, hidden, residual, ctx)
        if attn_out is not None:
            hidden = attn_out(hidden)
        hidden, residual = self.mlp(hidden, residual)
        return (mlp_out(hidden) if mlp_out is not None else hidden), residual


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
