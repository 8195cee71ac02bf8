"""Qwen3.5 / Qwen3.6 (dense, `qwen3_5`) and their MoE form (`qwen3_5_moe`): the Gated DeltaNet hybrid
(kestrel/models/gated_deltanet.py) with a SwiGLU MLP, or with MoE blocks on every layer (softmax top-k always
renormalised, a sigmoid-gated shared expert); the full-attention layers rotate by interleaved M-RoPE (plain RoPE on
text). The *ForConditionalGeneration checkpoints take images: Qwen3-VL's vision tower without DeepStack
(kestrel/models/vision/qwen3_vit.py) on this decoder, the rest as Qwen2.5-VL (kestrel/models/qwen2_5_vl.py)."""
from kestrel.layers.norm import GemmaRMSNorm
from kestrel.models.gated_deltanet import GATED_QKV, HybridWeights, mrope_mixer
from kestrel.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kestrel.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from kestrel.models.qwen3_next import Qwen3NextDecoderLayer, Qwen3NextForCausalLM
from kestrel.models.qwen3_vl import FrameVideos, Qwen3VLForConditionalGeneration
from kestrel.models.vision.qwen3_vit import Qwen3VisionTransformer


class Qwen3_5DecoderLayer(LlamaDecoderLayer):
    attention_cls = staticmethod(mrope_mixer)
    norm_cls = GemmaRMSNorm


class Qwen3_5ForCausalLM(HybridWeights, LlamaForCausalLM):
    decoder_layer_cls = Qwen3_5DecoderLayer
    norm_cls = GemmaRMSNorm
    packed_modules = {**GATED_QKV, "gate_up_proj": ("gate_proj", "up_proj")}


class Qwen3_5MoeDecoderLayer(Qwen3NextDecoderLayer):
    attention_cls = staticmethod(mrope_mixer)
    norm_topk = True


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    decoder_layer_cls = Qwen3_5MoeDecoderLayer


class Qwen3_5ForConditionalGeneration(FrameVideos, Qwen2_5_VLForConditionalGeneration):
    text_model_cls = Qwen3_5ForCausalLM
    tower_cls = Qwen3VisionTransformer  # no deepstack_visual_indexes in its config: no DeepStack levels
    max_pixels = Qwen3VLForConditionalGeneration.max_pixels


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    text_model_cls = Qwen3_5MoeForCausalLM
