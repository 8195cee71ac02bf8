"""Qwen3-Next (Qwen3-Next-80B-A3B): the Gated DeltaNet hybrid (kestrel/models/gated_deltanet.py) under Qwen2-MoE
blocks: softmax top-k (renormalised by norm_topk_prob) plus a sigmoid-gated shared expert; sparse layers by
decoder_sparse_step / mlp_only_layers as in Qwen2/3-MoE. Its GDN input projections are grouped per key head."""
from kestrel.layers.norm import GemmaRMSNorm
from kestrel.models.gated_deltanet import GATED_QKV, HybridWeights, hybrid_mixer
from kestrel.models.moe_base import MoEForCausalLM
from kestrel.models.qwen_moe import Qwen3MoeDecoderLayer


class Qwen3NextDecoderLayer(Qwen3MoeDecoderLayer):
    attention_cls = staticmethod(hybrid_mixer)
    norm_cls = GemmaRMSNorm
    shared = True


class Qwen3NextForCausalLM(HybridWeights, MoEForCausalLM):
    decoder_layer_cls = Qwen3NextDecoderLayer
    norm_cls = GemmaRMSNorm
    packed_modules = {**GATED_QKV, "gate_up_proj": ("gate_proj", "up_proj")}
