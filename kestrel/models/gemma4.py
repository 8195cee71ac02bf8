"""Gemma 4 text (Gemma4ForCausalLM; the text part of Gemma4ForConditionalGeneration): Gemma 3's sandwich-normed
decoder (scaled embeddings, final soft-capping) with these options, each read from the config:
- attention: head size and KV-head count per layer (transformers' per_layer_config: 256 local / 512 global), scale
  1.0, per-head q/k norms with a plain weight and an unweighted v norm, K = V on the global layers
  (`attention_k_eq_v`), "proportional" partial RoPE on the global layers (rope_parameters), and the last
  `num_kv_shared_layers` layers reading the cache of the last earlier layer of their type (a SharedKVSpec);
- the MoE block beside the dense MLP (`enable_moe_block`, 26B-A4B): the router reads the residual stream
  (RMSNorm * scale * d^-1/2, a per-expert scale), GELU-tanh experts their own pre-norm, the MLP's and the experts'
  outputs post-normed and summed;
- per-layer inputs (`hidden_size_per_layer_input`, E2B/E4B): per token and layer, a vector from a second embedding
  table and a projection of the embeddings, gating a residual branch after each layer's MLP;
- `layer_scalar`: each layer's output stream times a learned scalar; a double-wide MLP on the KV-shared layers
  (`use_double_wide_mlp`)."""
from __future__ import annotations

import logging
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.attention.layer import Attention
from kestrel.errors import ConfigError
from kestrel.layers.activation import gated_activation
from kestrel.layers.embedding import VocabEmbedding
from kestrel.layers.linear import Linear
from kestrel.layers.moe import RouterConfig
from kestrel.layers.norm import Float32RMSNorm, L2Norm
from kestrel.layers.norm_linear import NormLinear
from kestrel.layers.rotary import RotaryEmbedding
from kestrel.models.context import ModelContext, layer_index
from kestrel.models.gemma3 import Gemma3ForCausalLM
from kestrel.models.llama import LlamaMLP, layer_config, rank_heads, sliding_window_of
from kestrel.models.moe_base import MoEForCausalLM, moe_block_from_ctx

logger = logging.getLogger(__name__)

# checkpoint names of the MoE block's tensors (beside the MLP, on the layer) -> ours (under the layer's `moe`)
MOE_NAMES = {".router.proj.": ".moe.gate.", ".router.": ".moe.gate.", ".experts.": ".moe.experts."}


def kv_source_index(cfg, idx: int) -> int | None:
    """The layer whose KV cache layer idx reads: from the first of the last `num_kv_shared_layers` layers on, the
    last earlier layer of the same type; None for a layer that keeps its own."""
    first = cfg.num_hidden_layers - (getattr(cfg, "num_kv_shared_layers", 0) or 0)
    if idx < first:
        return None
    same = [j for j in range(first) if cfg.layer_types[j] == cfg.layer_types[idx]]
    if not same:
        raise ConfigError(f"Gemma 4 layer {idx} shares the KV cache of an earlier {cfg.layer_types[idx]} layer, "
                          "and there is none")
    return same[-1]


def check_supported(cfg) -> None:
    if getattr(cfg, "use_bidirectional_attention", None) == "all":
        raise ConfigError("Gemma 4 with use_bidirectional_attention='all' (an encoder) is not supported")
    if cfg.hidden_activation not in ("gelu_pytorch_tanh", "gelu_new"):
        raise ConfigError(f"Gemma 4 with hidden_activation {cfg.hidden_activation!r} is not supported "
                          "(GELU-tanh only)")


class Gemma4Attention(nn.Module):
    def __init__(self, ctx: ModelContext, prefix: str, input_norm: nn.Module):
        super().__init__()
        cfg, idx = ctx.text, layer_index(prefix)
        kind, d = cfg.layer_types[idx], layer_config(cfg, idx).head_dim
        heads, kv_heads = cfg.num_attention_heads, layer_config(cfg, idx).num_key_value_heads
        src = kv_source_index(cfg, idx)
        k_eq_v = bool(cfg.attention_k_eq_v) and kind != "sliding_attention"
        kv_parts = 0 if src is not None else 1 if k_eq_v else 2  # what the projection gives beside the queries
        (q0, nq), (kv0, nkv) = rank_heads(ctx.parallel, heads, kv_heads)
        self.qkv_proj = Linear.from_ctx(ctx, cfg.hidden_size, [heads * d] + [kv_heads * d] * kv_parts,
                                        f"{prefix}.qkv_proj", cfg.attention_bias, "column",
                                        [(q0 * d, nq * d)] + [(kv0 * d, nkv * d)] * kv_parts)
        self.o_proj = Linear.from_ctx(ctx, heads * d, cfg.hidden_size, f"{prefix}.o_proj", cfg.attention_bias, "row")
        self.q_norm = Float32RMSNorm(d, cfg.rms_norm_eps, ctx.dtype)
        self.k_norm = Float32RMSNorm(d, cfg.rms_norm_eps, ctx.dtype) if src is None else None
        rotary = ctx.shared(f"rotary.{kind}", lambda: RotaryEmbedding(cfg, d, ctx.max_positions, ctx.dtype,
                                                                       layer_type=kind))
        source = None if src is None else prefix.replace(f"layers.{idx}.", f"layers.{src}.") + ".attn"
        self.attn = Attention(ctx, f"{prefix}.attn", nq, d, nkv, rotary, scale=1.0, q_norm=self.q_norm,
                              k_norm=self.k_norm, sliding_window=sliding_window_of(cfg, idx, ctx.max_positions),
                              v_norm=None if src is not None else L2Norm(eps=cfg.rms_norm_eps), k_eq_v=k_eq_v,
                              kv_source=source)
        self.qkv = NormLinear(input_norm, self.qkv_proj)

    def forward(self, positions, hidden, residual, ctx):
        qkv, residual = self.qkv(hidden, residual)
        return self.o_proj(self.attn(qkv, positions, ctx)), residual


class Gemma4DecoderLayer(nn.Module):
    mlp_name = "moe"  # the MoE block's name (MoEForCausalLM.load_weights)

    def __init__(self, ctx: ModelContext, prefix: str):
        super().__init__()
        cfg, idx = ctx.text, layer_index(prefix)
        norm = lambda: Float32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma4Attention(ctx, f"{prefix}.self_attn", self.input_layernorm)
        wide = 2 if cfg.use_double_wide_mlp and kv_source_index(cfg, idx) is not None else 1
        self.mlp = LlamaMLP(ctx, f"{prefix}.mlp", self.pre_feedforward_layernorm,
                            gated_activation(cfg.hidden_activation), cfg.intermediate_size * wide)
        self.moe = None
        if cfg.enable_moe_block:
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = norm(), norm()
            router = RouterConfig(cfg.num_experts, cfg.top_k_experts, renormalize=True, input_norm=True,
                                  per_expert_scale=True, eps=cfg.rms_norm_eps)
            self.moe = moe_block_from_ctx(ctx, f"{prefix}.moe", router, cfg.moe_intermediate_size, activation="gelu")
        if cfg.hidden_size_per_layer_input:
            p = cfg.hidden_size_per_layer_input
            self.per_layer_input_gate = Linear.from_ctx(ctx, cfg.hidden_size, p, f"{prefix}.per_layer_input_gate")
            self.per_layer_projection = Linear.from_ctx(ctx, p, cfg.hidden_size, f"{prefix}.per_layer_projection")
            self.post_per_layer_input_norm = norm()
        self.register_buffer("layer_scalar", torch.ones(1, dtype=ctx.dtype))

    def forward(self, positions, hidden, residual, ctx, per_layer_input=None):
        """Returns (the residual stream, None): the stream is scaled whole, so it is not carried in two parts."""
        attn, residual = self.self_attn(positions, hidden, residual, ctx)
        out, stream = self.mlp(self.post_attention_layernorm(attn), residual)
        if self.moe is not None:
            experts = self.moe(self.pre_feedforward_layernorm_2(stream), router_input=stream)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)
        stream = stream + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:
            gate = F.gelu(self.per_layer_input_gate(stream), approximate="tanh") * per_layer_input
            stream = stream + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return stream * self.layer_scalar, None


class Gemma4ForCausalLM(MoEForCausalLM, Gemma3ForCausalLM):
    decoder_layer_cls = Gemma4DecoderLayer
    norm_cls = Float32RMSNorm

    def __init__(self, ctx: ModelContext, prefix: str = "model"):
        check_supported(ctx.text)
        super().__init__(ctx, prefix)
        cfg = ctx.text
        self.ple_dim = cfg.hidden_size_per_layer_input or 0
        if self.ple_dim:
            n = cfg.num_hidden_layers * self.ple_dim
            self.embed_tokens_per_layer = VocabEmbedding(cfg.vocab_size_per_layer_input, n, ctx.dtype, ctx.parallel)
            self.per_layer_model_projection = Linear.from_ctx(ctx, cfg.hidden_size, n,
                                                              f"{prefix}.per_layer_model_projection")
            self.per_layer_projection_norm = Float32RMSNorm(self.ple_dim, cfg.rms_norm_eps, ctx.dtype)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, layers, P]: the token's row of the per-layer table (scaled by sqrt(P)) and the normed projection of
        its embedding, averaged in (a + b) / sqrt(2)."""
        t, p = embeds.shape[0], self.ple_dim
        tokens = self.embed_tokens_per_layer(self.text_ids(input_ids))
        tokens = tokens * torch.tensor(p ** 0.5, dtype=tokens.dtype)
        proj = self.per_layer_model_projection(embeds) * self.config.hidden_size ** -0.5
        proj = self.per_layer_projection_norm(proj.view(t, -1, p))
        return (proj + tokens.view(t, -1, p)) * 2 ** -0.5

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_input_ids(self.text_ids(input_ids))

    def text_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids the embedding tables see (a multimodal checkpoint's placeholders read as padding)."""
        return input_ids

    def forward(self, input_ids, positions, ctx, inputs_embeds=None) -> torch.Tensor:
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        per_layer = self.per_layer_inputs(input_ids, hidden) if self.ple_dim else None
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, ctx, None if per_layer is None else per_layer[:, i])
        return self.norm(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skipped = []

        def renamed(stream):
            for name, tensor in stream:
                ours = self.checkpoint_name(name)
                if ours is None:
                    skipped.append(name)
                    continue
                yield next((ours.replace(a, b, 1) for a, b in MOE_NAMES.items() if a in ours), ours), tensor

        loaded = super().load_weights(renamed(weights))
        if skipped:
            logger.info("Skipped %d tensors outside the text model (%s): text only", len(skipped),
                        ", ".join(sorted({n.split(".")[1] for n in skipped})))
        return loaded

    def checkpoint_name(self, name: str) -> str | None:
        """The text model's name of a checkpoint tensor (None: not the text model's)."""
        return name


TEXT_ONLY = ("the vision and audio towers of Gemma 4 checkpoints are not supported yet: this server serves their "
             "text part only")
TOWERS = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The text model of a Gemma 4 vision(-audio)-language checkpoint: `model.language_model.*` read as
    `model.*`; the towers' tensors skipped with one log line; images refused with `images_refused`. An image,
    video or audio placeholder id in the text embeds as the padding token, as transformers' model does (it never
    gets the tower's rows here)."""
    images_refused = TEXT_ONLY

    def __init__(self, ctx: ModelContext, prefix: str = "model"):
        super().__init__(ctx, prefix)
        hf = ctx.config.hf
        ids = [getattr(hf, n, None) for n in ("image_token_id", "video_token_id", "audio_token_id")]
        self.register_buffer("placeholder_ids", torch.tensor([i for i in ids if i is not None], dtype=torch.long),
                             persistent=False)
        self.pad_token_id = ctx.text.pad_token_id or 0

    def text_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.isin(input_ids, self.placeholder_ids), self.pad_token_id, input_ids)

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(TOWERS):
            return None
        return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name
