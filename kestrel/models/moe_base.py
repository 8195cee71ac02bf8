"""The shared half of the MoE families: a Llama-style decoder layer whose MLP is dense or an MoE block, the
model-wide fused-shared-experts record, and the weight loader that reads it.

A family subclasses `MoEDecoderLayer` (its attention class, the MLP's checkpoint name, and `moe_block(ctx, prefix)`
returning a `SparseMoeBlock` or None for a dense layer) and points an `MoEForCausalLM` subclass at it.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from kestrel.layers.moe import RouterConfig, SparseMoeBlock, check_fse_consistency
from kestrel.layers.norm import RMSNorm
from kestrel.models.context import ModelContext
from kestrel.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from kestrel.models.weights import load_named_weights


def cfg_get(cfg, *names, default=None):
    """The first of `names` the config has (configs rename fields across transformers versions)."""
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def moe_block_from_ctx(ctx: ModelContext, prefix: str, router: RouterConfig, moe_intermediate_size: int,
                       shared_intermediate_size: int = 0, shared_gated: bool = False,
                       shared_name: str = "shared_experts", weights_on_input: bool = False,
                       activation: str = "silu") -> SparseMoeBlock:
    """A SparseMoeBlock with the model context's dtype, quantization and kernel options."""
    return SparseMoeBlock(prefix=prefix, hidden_size=ctx.text.hidden_size, moe_intermediate_size=moe_intermediate_size,
                          router=router, dtype=ctx.dtype, shared_intermediate_size=shared_intermediate_size,
                          shared_gated=shared_gated, shared_name=shared_name, quant_config=ctx.quant_config,
                          moe_backend=ctx.moe_backend, linear_backend=ctx.linear_backend,
                          fuse_shared_experts=ctx.fuse_shared_experts, tp=ctx.parallel,
                          weights_on_input=weights_on_input, activation=activation)


class MoEDecoderLayer(nn.Module):
    attention_cls = LlamaAttention
    mlp_name = "mlp"
    dense_intermediate = "intermediate_size"  # the config field sizing the dense layers' MLP
    norm_cls = RMSNorm

    def __init__(self, ctx: ModelContext, prefix: str):
        super().__init__()
        cfg = ctx.text
        self.input_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.post_attention_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.self_attn = self.attention_cls(ctx, f"{prefix}.self_attn", self.input_layernorm)
        mlp_prefix = f"{prefix}.{self.mlp_name}"
        mlp = self.moe_block(ctx, mlp_prefix)
        self.is_moe = mlp is not None
        if mlp is None:
            mlp = LlamaMLP(ctx, mlp_prefix, self.post_attention_layernorm,
                           intermediate_size=getattr(cfg, self.dense_intermediate))
        setattr(self, self.mlp_name, mlp)

    def moe_block(self, ctx: ModelContext, prefix: str) -> SparseMoeBlock | None:
        raise NotImplementedError

    def forward(self, positions, hidden, residual, ctx):
        hidden, residual = self.self_attn(positions, hidden, residual, ctx)
        mlp = getattr(self, self.mlp_name)
        if not self.is_moe:
            return mlp(hidden, residual)  # the norm runs inside gate_up where the kernel fuses it
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return mlp(hidden), residual


class MoEForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = MoEDecoderLayer

    def __init__(self, ctx: ModelContext, prefix: str = "model"):
        super().__init__(ctx, prefix)
        blocks = self.moe_blocks()
        check_fse_consistency([b.fse for b in blocks.values()], [type(b.experts.kernel) for b in blocks.values()])
        # The record the weight loader reads: decided once, at construction, never re-derived.
        self.fse_decisions = {name: b.fse for name, b in blocks.items()}

    def moe_blocks(self) -> dict[str, SparseMoeBlock]:
        return {m.prefix: m for m in self.modules() if isinstance(m, SparseMoeBlock)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        blocks = self.moe_blocks()
        mlp = f".{self.decoder_layer_cls.mlp_name}."
        moe_loaded: set[str] = set()

        def dense(stream):  # MoE-block tensors go to their block; the rest to the generic loader
            for name, tensor in stream:
                head, sep, rel = name.partition(mlp)
                block = f"{head}{mlp[:-1]}" if sep else None
                if block in blocks:
                    blocks[block].load_weight(rel, tensor, self.fse_decisions[block])
                    moe_loaded.add(name)
                else:
                    yield name, tensor

        loaded = load_named_weights(self, dense(weights), self.packed_modules,
                                    skip_lm_head=getattr(self.config, "tie_word_embeddings", False))
        return loaded | moe_loaded


__all__ = ["MoEDecoderLayer", "MoEForCausalLM", "cfg_get", "moe_block_from_ctx"]
