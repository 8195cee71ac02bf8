"""Qwen2-MoE (sigmoid-gated shared expert, q/k/v bias) and Qwen3-MoE (no shared expert, q/k norm).

Sparse layers: i not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0; the others are dense MLPs of
`intermediate_size`. Router: softmax top-k, renormalized when `norm_topk_prob`."""
from __future__ import annotations

from kestrel.layers.moe import RouterConfig, SparseMoeBlock
from kestrel.models.moe_base import MoEForCausalLM, cfg_get
from kestrel.models.qwen import Qwen3Attention
from kestrel.models.llama import LlamaAttention


class Qwen2MoeAttention(LlamaAttention):
    def __init__(self, cfg, *args):
        self.qkv_bias_default = bool(getattr(cfg, "qkv_bias", True))
        super().__init__(cfg, *args)


def is_sparse_layer(cfg, i: int) -> bool:
    step = cfg_get(cfg, "decoder_sparse_step", default=1)
    return (i not in (cfg_get(cfg, "mlp_only_layers", default=[]))
            and cfg_get(cfg, "num_experts", "num_local_experts", default=0) > 0 and (i + 1) % step == 0)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    attention_cls = Qwen3Attention
    shared = False

    def moe_block(self, cfg, i, prefix, dtype, quant_config, linear_backend, moe):
        if not is_sparse_layer(cfg, i):
            return None
        router = RouterConfig(cfg_get(cfg, "num_experts", "num_local_experts"), cfg.num_experts_per_tok, "softmax",
                              bool(getattr(cfg, "norm_topk_prob", False)))
        shared = dict(shared_intermediate_size=cfg.shared_expert_intermediate_size, shared_gated=True,
                      shared_name="shared_expert") if self.shared else {}
        return SparseMoeBlock(prefix=prefix, hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
                              router=router, dtype=dtype, quant_config=quant_config, moe_backend=moe.moe_backend,
                              linear_backend=linear_backend, fuse_shared_experts=moe.fuse_shared_experts,
                              platform=moe.platform, **shared)


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    attention_cls = Qwen2MoeAttention
    shared = True
