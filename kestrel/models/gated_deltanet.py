"""The Gated DeltaNet hybrids' shared pieces (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): three of every four layers
(`layer_types` "linear_attention") are Gated DeltaNet, linear attention with a per-request recurrent state that runs
on the KDA paths (kestrel/attention/kda.py with kda_ref.DeltaOptions: q/k heads repeated to the value heads, one
decay per head, a SiLU-gated RMSNorm); the others are full attention with an output gate (q_proj doubled per head,
output times sigmoid(gate)), RMSNorm on each head of q and k, and partial RoPE. Every RMSNorm outside the GDN
output norm scales by (1 + weight).

Checkpoint names: GDN tensors sit under `linear_attn` (conv1d, A_log, dt_bias, norm, out_proj, and the input
projections: Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, or Qwen3-Next's in_proj_qkvz / in_proj_ba
grouped per key head, which the loader regroups); `mtp.*` (the multi-token-prediction head) is skipped."""
from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

from kestrel.attention.kda import DeltaAttention
from kestrel.errors import ConfigError
from kestrel.kernels.kda_ref import DeltaOptions
from kestrel.layers.linear import Linear, materialize
from kestrel.layers.norm import GemmaRMSNorm, pre_norm
from kestrel.models.context import ModelContext, layer_index
from kestrel.models.kimi_linear import load_decay_or_norm
from kestrel.models.llama import LlamaAttention

logger = logging.getLogger(__name__)


class GatedDeltaNet(nn.Module):
    """A GDN layer's projections around DeltaAttention: one GEMM for q|k|v (before the short convolution), the
    output gate z, beta's and the decay's logits; out_proj after."""

    def __init__(self, ctx: ModelContext, prefix: str, input_norm: nn.Module):
        super().__init__()
        cfg = ctx.text
        if ctx.parallel.size > 1:
            raise ConfigError("Gated DeltaNet layers do not support tensor parallelism yet")
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, width = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        self.delta = DeltaOptions(hv, dk, hk, dv, per_head_decay=True, gate_act="silu")
        self.norm_eps = cfg.rms_norm_eps
        self._input_norm = (input_norm,)  # registered by the decoder layer
        # q|k|v | z | b | a: everything that reads the layer input
        self.in_sizes = [self.delta.conv_channels, hv * dv, hv, hv]
        self.in_proj = Linear.from_ctx(ctx, cfg.hidden_size, self.in_sizes, f"{prefix}.in_proj")
        self.out_proj = Linear.from_ctx(ctx, hv * dv, cfg.hidden_size, f"{prefix}.out_proj")
        self.conv_weight = nn.Parameter(torch.zeros(self.delta.conv_channels, width, dtype=ctx.dtype),
                                        requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(hv, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(hv, dtype=torch.float32), requires_grad=False)
        self.o_norm_weight = nn.Parameter(torch.ones(dv, dtype=ctx.dtype), requires_grad=False)
        self.gdn = DeltaAttention(ctx, f"{prefix}.gdn", self.delta, width)

    def forward(self, positions, hidden, residual, ctx):
        x, residual = pre_norm(self._input_norm[0], hidden, residual)
        qkv, z, b, a = self.in_proj(x).split(self.in_sizes, dim=-1)
        return self.out_proj(self.gdn(self, qkv, a, b, z, ctx)), residual

    _IN_PROJ = {"in_proj_qkv": 0, "in_proj_z": 1, "in_proj_b": 2, "in_proj_a": 3}

    @torch.no_grad()
    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor, `name` relative to this layer (e.g. 'conv1d.weight', 'A_log')."""
        head, _, param = name.partition(".")
        if head in self._IN_PROJ:
            self.in_proj.load_weight(param, tensor, self._IN_PROJ[head])
        elif head in ("in_proj_qkvz", "in_proj_ba"):
            if param != "weight":
                raise KeyError(f"{name}: Qwen3-Next's grouped projections are read unquantized only")
            for shard, part in enumerate(self._ungroup(head, materialize(tensor)), 0 if head == "in_proj_qkvz" else 2):
                self.in_proj.load_weight(param, part, shard)
        elif head == "out_proj":
            self.out_proj.load_weight(param, tensor)
        elif head == "conv1d":
            self.conv_weight.copy_(materialize(tensor).reshape(self.conv_weight.shape))
        else:
            load_decay_or_norm(self, name, tensor, "norm", "Gated DeltaNet")

    def _ungroup(self, head: str, w: torch.Tensor) -> list[torch.Tensor]:
        """Qwen3-Next's projections hold, per key head, [q, k, v, z] (v and z: the value heads that read it) and
        [b, a]: -> [q|k|v (all heads), z] or [b, a], in the flat order of Qwen3.5's separate projections."""
        o = self.delta
        hk, dk, r = o.key_heads, o.head_dim, o.num_heads // o.key_heads
        cols = w.shape[-1]
        if head == "in_proj_ba":
            b, a = w.view(hk, 2 * r, cols).split([r, r], dim=1)
            return [b.reshape(-1, cols), a.reshape(-1, cols)]
        q, k, v, z = w.view(hk, -1, cols).split([dk, dk, r * o.v_dim, r * o.v_dim], dim=1)
        return [torch.cat([x.reshape(-1, cols) for x in (q, k, v)]), z.reshape(-1, cols)]


class GatedAttention(LlamaAttention):
    """Full attention with the output gate (attn_output_gate, on unless the config says otherwise), (1 + w) q/k
    norms and partial RoPE (partial_rotary_factor, 0.25 in these models: LlamaAttention's rotary options)."""
    use_qk_norm = True
    norm_cls = GemmaRMSNorm

    def __init__(self, ctx: ModelContext, prefix: str, input_norm: nn.Module):
        self.output_gate = bool(getattr(ctx.text, "attn_output_gate", True))
        super().__init__(ctx, prefix, input_norm)  # partial RoPE: LlamaAttention's rope_fraction


class MRoPEGatedAttention(GatedAttention):
    """Qwen3.5's full attention: its rotary is interleaved M-RoPE, [11, 11, 10] unless the config says otherwise
    (transformers' Qwen3.5 rotary; with [T] positions, a text prompt's, it is plain RoPE)."""
    mrope_default = ([11, 11, 10], True)


def hybrid_mixer(ctx: ModelContext, prefix: str, input_norm: nn.Module, attention: type = GatedAttention
                 ) -> nn.Module:
    """The token mixer of layer `prefix` by the config's layer_types (checkpoint name: linear_attn for GDN);
    `attention`: the full-attention layers' class."""
    if ctx.text.layer_types[layer_index(prefix)] == "linear_attention":
        return GatedDeltaNet(ctx, prefix.replace(".self_attn", ".linear_attn"), input_norm)
    return attention(ctx, prefix, input_norm)


def mrope_mixer(ctx: ModelContext, prefix: str, input_norm: nn.Module) -> nn.Module:
    """hybrid_mixer with Qwen3.5's M-RoPE attention."""
    return hybrid_mixer(ctx, prefix, input_norm, MRoPEGatedAttention)


# the gate rows of gated attention: one more shard of the merged q/k/v projection (kestrel/models/llama.py)
GATED_QKV = {"qkv_proj": ("q_proj", "k_proj", "v_proj", "q_gate")}


class HybridWeights:
    """load_weights for the GDN hybrids (a mixin before the model's base class): GDN tensors to their layer, each
    gated-attention q_proj cut into its queries and gates, `mtp.*` skipped with one log line; the rest to the base's
    loader. A multimodal checkpoint's class renames its text part's tensors (`checkpoint_name`) and says what
    else it skipped (`skipped_what`)."""
    skipped_what = ""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        gdn = {f"model.layers.{i}.linear_attn.": layer.self_attn for i, layer in enumerate(self.layers)
               if isinstance(layer.self_attn, GatedDeltaNet)}
        loaded: set[str] = set()
        skipped: dict[str, int] = {}

        def rest(stream):
            for name, tensor in stream:
                name = self.checkpoint_name(name)
                if name is None or name.startswith("mtp."):
                    kind = "mtp" if name else "skipped"
                    skipped[kind] = skipped.get(kind, 0) + 1
                    continue
                head, sep, rel = name.partition(".linear_attn.")
                if sep and f"{head}{sep}" in gdn:
                    gdn[f"{head}{sep}"].load_weight(rel, tensor)
                    loaded.add(name)
                elif ".self_attn.q_proj." in name:
                    yield from self._split_gated_q(name, tensor)
                else:
                    yield name, tensor

        out = super().load_weights(rest(weights)) | loaded
        if skipped.get("mtp"):
            logger.info("Skipped %d mtp.* tensors (the multi-token-prediction head: no speculative decoding "
                        "reads it yet)", skipped["mtp"])
        if skipped.get("skipped"):
            logger.info("Skipped %d tensors outside the text model: %s", skipped["skipped"], self.skipped_what)
        return out

    def checkpoint_name(self, name: str) -> str | None:
        """The text model's name of a checkpoint tensor (None: not the text model's)."""
        return name

    def _split_gated_q(self, name: str, tensor):
        layer = self.layers[layer_index(name)].self_attn
        if not getattr(layer, "gate_size", 0):
            yield name, tensor
            return
        d = layer.attn.head_dim
        t = materialize(tensor)
        q, gate = t.view(-1, 2, d, *t.shape[1:]).unbind(1)  # per head: [queries, gates]
        yield name, q.reshape(-1, *t.shape[1:])
        yield name.replace(".q_proj.", ".q_gate."), gate.reshape(-1, *t.shape[1:])
