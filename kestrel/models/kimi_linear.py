"""Kimi Linear (Kimi-Linear-48B-A3B): Kimi Delta Attention layers (linear attention with a per-request recurrent
state, kestrel/attention/kda.py) interleaved with MLA layers that use no position encoding, under DeepSeek-V3
MoE blocks (sigmoid router with the correction bias, one ungated shared expert) after dense first layers.

Which layer is which comes from the config's `layer_types` (built by transformers from the checkpoint's 1-indexed
`linear_attn_config` lists), dense or sparse MLP from `mlp_layer_types`. Checkpoint names: KDA tensors sit under
`self_attn` ({q,k,v}_proj, {q,k,v}_conv1d, f_a/f_b_proj, A_log, dt_bias, b_proj, g_a/g_b_proj, o_norm, o_proj);
every MLP, dense or MoE, under `block_sparse_moe` except dense ones under `mlp`."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from kestrel.attention.kda import DeltaAttention
from kestrel.errors import ConfigError
from kestrel.kernels.kda_ref import DeltaOptions
from kestrel.layers.linear import Linear, materialize
from kestrel.layers.norm import pre_norm
from kestrel.models.context import ModelContext, layer_index
from kestrel.models.deepseek_moe import deepseek_moe_block, deepseek_router
from kestrel.models.deepseek_v2 import DeepseekV2Attention
from kestrel.models.moe_base import MoEDecoderLayer, MoEForCausalLM


class KimiMLAAttention(DeepseekV2Attention):
    """DeepSeek-V2-style MLA without query compression and without rotary (NoPE)."""
    use_rope = False


class KimiDeltaAttention(nn.Module):
    """A KDA layer's projections around DeltaAttention: one GEMM for q|k|v (before the short convolution), the
    forget-gate and output-gate down-projections and beta; then the gates' up-projections; o_proj after."""

    def __init__(self, ctx: ModelContext, prefix: str, input_norm: nn.Module):
        super().__init__()
        cfg = ctx.text
        if ctx.parallel.size > 1:
            raise ConfigError("Kimi Delta Attention layers do not support tensor parallelism yet")
        h, d, width = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
        hd = h * d
        self.num_heads, self.head_dim, self.norm_eps = h, d, cfg.rms_norm_eps
        self._input_norm = (input_norm,)  # registered by the decoder layer
        # q | k | v | f_a | g_a | b: everything that reads the layer input
        self.in_sizes = [hd, hd, hd, d, d, h]
        self.in_proj = Linear.from_ctx(ctx, cfg.hidden_size, self.in_sizes, f"{prefix}.in_proj")
        self.f_b_proj = Linear.from_ctx(ctx, d, hd, f"{prefix}.f_b_proj")
        self.g_b_proj = Linear.from_ctx(ctx, d, hd, f"{prefix}.g_b_proj")
        self.o_proj = Linear.from_ctx(ctx, hd, cfg.hidden_size, f"{prefix}.o_proj")
        self.conv_weight = nn.Parameter(torch.zeros(3 * hd, width, dtype=ctx.dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(h, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(hd, dtype=torch.float32), requires_grad=False)
        self.o_norm_weight = nn.Parameter(torch.ones(d, dtype=ctx.dtype), requires_grad=False)
        self.delta = DeltaOptions(h, d)  # per-channel decay, sigmoid output gate
        self.kda = DeltaAttention(ctx, f"{prefix}.kda", self.delta, width)

    def forward(self, positions, hidden, residual, ctx):
        x, residual = pre_norm(self._input_norm[0], hidden, residual)
        qkv_size = 3 * self.num_heads * self.head_dim
        qkv, f_a, g_a, beta_logits = self.in_proj(x).split([qkv_size] + self.in_sizes[3:], dim=-1)
        f = self.f_b_proj(f_a.contiguous())
        gate = self.g_b_proj(g_a.contiguous())
        out = self.kda(self, qkv, f, beta_logits, gate, ctx)
        return self.o_proj(out), residual

    _IN_PROJ = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "f_a_proj": 3, "g_a_proj": 4, "b_proj": 5}
    _CONV = {"q_conv1d": 0, "k_conv1d": 1, "v_conv1d": 2}

    @torch.no_grad()
    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor, `name` relative to this layer (e.g. 'q_conv1d.weight', 'A_log')."""
        head, _, param = name.partition(".")
        hd = self.num_heads * self.head_dim
        if head in self._IN_PROJ:  # Linear layers read lazy tensors themselves; the rest is materialized here
            self.in_proj.load_weight(param, tensor, self._IN_PROJ[head])
        elif head in ("f_b_proj", "g_b_proj", "o_proj"):
            getattr(self, head).load_weight(param, tensor)
        elif head in self._CONV:
            i, tensor = self._CONV[head], materialize(tensor)
            self.conv_weight[i * hd:(i + 1) * hd].copy_(tensor.reshape(hd, -1))
        else:
            load_decay_or_norm(self, name, tensor, "o_norm", "Kimi Delta Attention")


def load_decay_or_norm(layer: nn.Module, name: str, tensor: torch.Tensor, norm_name: str, what: str) -> None:
    """The tail of a delta-rule layer's (KDA, Gated DeltaNet) load_weight: the decay's A_log and dt_bias, the output
    norm's weight (checkpoint name `norm_name`); any other tensor is not the layer's (a KeyError naming `what`)."""
    head = name.partition(".")[0]
    if head in ("A_log", "dt_bias"):
        getattr(layer, head).copy_(materialize(tensor).reshape(-1))
    elif head == norm_name:
        layer.o_norm_weight.copy_(materialize(tensor))
    else:
        raise KeyError(f"{name}: not a {what} tensor")


def _attention(ctx: ModelContext, prefix: str, input_norm: nn.Module) -> nn.Module:
    if ctx.text.layer_types[layer_index(prefix)] == "linear_attention":
        return KimiDeltaAttention(ctx, prefix, input_norm)
    return KimiMLAAttention(ctx, prefix, input_norm)


class KimiLinearDecoderLayer(MoEDecoderLayer):
    attention_cls = staticmethod(_attention)
    mlp_name = "block_sparse_moe"

    def moe_block(self, ctx: ModelContext, prefix: str):
        if ctx.text.mlp_layer_types[layer_index(prefix)] != "sparse":
            return None
        return deepseek_moe_block(ctx, prefix, deepseek_router(ctx.text))


class KimiLinearForCausalLM(MoEForCausalLM):
    decoder_layer_cls = KimiLinearDecoderLayer
    packed_modules = {"gate_up_proj": ("gate_proj", "up_proj")}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        kda = {f"model.layers.{i}.self_attn.": layer.self_attn for i, layer in enumerate(self.layers)
               if isinstance(layer.self_attn, KimiDeltaAttention)}
        loaded: set[str] = set()

        def rest(stream):  # KDA tensors to their layer; dense MLPs under the MoE blocks' name; the rest on
            for name, tensor in stream:
                head, sep, rel = name.partition(".self_attn.")
                if sep and f"{head}{sep}" in kda:
                    kda[f"{head}{sep}"].load_weight(rel, tensor)
                    loaded.add(name)
                else:
                    yield name.replace(".mlp.", ".block_sparse_moe."), tensor

        return super().load_weights(rest(weights)) | loaded
