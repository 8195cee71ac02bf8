"""The shared half of the MoE families: a Llama-style decoder whose MLP is dense or an MoE block, the model-wide
fused-shared-experts record, and the weight loader that reads it.

A family says how its config describes the MoE (`moe_block(cfg, layer_index, prefix, ...)` -> an MoE block or
None for a dense layer) and what its attention is; everything else is here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from kestrel.attention.layer import ForwardContext
from kestrel.layers.embedding import LMHead, VocabEmbedding
from kestrel.layers.linear import Linear
from kestrel.layers.moe import FusedExperts, SparseMoeBlock, check_fse_consistency
from kestrel.layers.norm import RMSNorm
from kestrel.layers.rotary import RotaryEmbedding
from kestrel.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


@dataclass(frozen=True)
class MoEOptions:
    """What the engine's kernel config says about MoE layers (KernelConfig.moe_backend / fuse_shared_experts)."""

    moe_backend: str = "auto"
    fuse_shared_experts: str = "auto"
    platform: object = None  # tests: build for a fake device


def cfg_get(cfg, *names, default=None):
    """The first of `names` the config has (configs rename fields across transformers versions)."""
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


class MoEDecoderLayer(nn.Module):
    def __init__(self, attn: nn.Module, mlp: nn.Module, mlp_name: str, hidden_size: int, eps: float, dtype):
        super().__init__()
        self.self_attn = attn
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype)

    def forward(self, positions, hidden, residual, ctx):
        attn = self.self_attn
        qkv, residual = attn.qkv_proj.forward_rms_norm(self.input_layernorm, hidden, residual)
        hidden = attn.attend(positions, qkv, ctx)
        mlp = getattr(self, self.mlp_name)
        if isinstance(mlp, LlamaMLP):
            act, residual = mlp.gate_up_proj.forward_rms_norm_silu(self.post_attention_layernorm, hidden, residual,
                                                                   mlp.act)
            return mlp.down_proj(act), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return mlp(hidden), residual


class MoEForCausalLM(LlamaForCausalLM):
    attention_cls = LlamaAttention
    mlp_name = "mlp"

    def __init__(self, cfg, dtype: torch.dtype, max_positions: int, quant_config=None, linear_backend: str = "auto",
                 moe: MoEOptions | None = None):
        nn.Module.__init__(self)
        moe = moe or MoEOptions()
        self.config = cfg
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        rotary = RotaryEmbedding(cfg, self.rotary_dim(cfg), max_positions, dtype)
        layers = []
        for i in range(cfg.num_hidden_layers):
            prefix = f"model.layers.{i}"
            attn = self.attention_cls(cfg, i, dtype, f"{prefix}.self_attn", quant_config, linear_backend, rotary)
            mlp_prefix = f"{prefix}.{self.mlp_name}"
            mlp = self.moe_block(cfg, i, mlp_prefix, dtype, quant_config, linear_backend, moe)
            if mlp is None:
                mlp = LlamaMLP(self.dense_mlp_config(cfg), dtype, mlp_prefix, quant_config, linear_backend)
            layers.append(MoEDecoderLayer(attn, mlp, self.mlp_name, cfg.hidden_size, cfg.rms_norm_eps, dtype))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        tied = getattr(cfg, "tie_word_embeddings", False)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype, tied_to=self.embed_tokens if tied else None)
        blocks = self.moe_blocks()
        check_fse_consistency([b.fse for b in blocks.values()], [type(b.experts.kernel) for b in blocks.values()])
        # The record the weight loader reads: decided once, above, never re-derived.
        self.fse_decisions = {name: b.fse for name, b in blocks.items()}

    # ---- what a family describes
    @staticmethod
    def rotary_dim(cfg) -> int:
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @staticmethod
    def dense_mlp_config(cfg):
        return cfg

    def moe_block(self, cfg, layer_index, prefix, dtype, quant_config, linear_backend, moe: MoEOptions):
        raise NotImplementedError

    # ---- model-wide views
    def moe_blocks(self) -> dict[str, SparseMoeBlock]:
        return {m.prefix: m for m in self.modules() if isinstance(m, SparseMoeBlock)}

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        blocks = self.moe_blocks()
        loaded: set[str] = set()
        for name, tensor in weights:
            head = name.split(f".{self.mlp_name}.", 1)
            block_prefix = f"{head[0]}.{self.mlp_name}" if len(head) == 2 else None
            if block_prefix in blocks:
                blocks[block_prefix].load_weight(head[1], tensor, self.fse_decisions[block_prefix])
                loaded.add(name)
                continue
            target = self._resolve(name)
            if target is None:
                continue
            module, param, shard = target
            if isinstance(module, Linear):
                module.load_weight(param, tensor, shard)
            else:
                p = getattr(module, param)
                if p.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(p.shape)}")
                p.data.copy_(tensor)
            loaded.add(name)
        for m in self.modules():
            if isinstance(m, (Linear, FusedExperts)):
                m.process_weights_after_loading()
        return loaded


__all__ = ["MoEDecoderLayer", "MoEForCausalLM", "MoEOptions", "cfg_get"]
