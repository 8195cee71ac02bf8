"""Qwen3.5 / Qwen3.6 (dense, `qwen3_5`) and their MoE form (`qwen3_5_moe`): the Gated DeltaNet hybrid
(kestrel/models/gated_deltanet.py) with a SwiGLU MLP, or with MoE blocks on every layer (softmax top-k always
renormalised, a sigmoid-gated shared expert). The *ForConditionalGeneration checkpoints serve their text part: the
vision tower's tensors are skipped (one log line) and image requests refused with the reason (M-RoPE with t = h = w
is plain RoPE, so text needs nothing more)."""
from kestrel.layers.norm import GemmaRMSNorm
from kestrel.models.gated_deltanet import GATED_QKV, HybridWeights, hybrid_mixer
from kestrel.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kestrel.models.qwen3_next import Qwen3NextDecoderLayer, Qwen3NextForCausalLM

TEXT_ONLY = "the vision tower of Qwen3.5 checkpoints is not supported yet: this server serves their text part only"


class Qwen3_5DecoderLayer(LlamaDecoderLayer):
    attention_cls = staticmethod(hybrid_mixer)
    norm_cls = GemmaRMSNorm


class Qwen3_5ForCausalLM(HybridWeights, LlamaForCausalLM):
    decoder_layer_cls = Qwen3_5DecoderLayer
    norm_cls = GemmaRMSNorm
    packed_modules = {**GATED_QKV, "gate_up_proj": ("gate_proj", "up_proj")}


class Qwen3_5MoeDecoderLayer(Qwen3NextDecoderLayer):
    norm_topk = True


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    decoder_layer_cls = Qwen3_5MoeDecoderLayer


class TextPart:
    """A vision-language checkpoint's text model: `model.language_model.*` read as `model.*`, `model.visual.*`
    skipped; images refused with `images_refused` (kestrel/frontend/processor.py)."""
    images_refused = TEXT_ONLY
    skipped_what = "the vision tower (model.visual.*): text only"

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith("model.visual."):
            return None
        return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name


class Qwen3_5ForConditionalGeneration(TextPart, Qwen3_5ForCausalLM):
    pass


class Qwen3_5MoeForConditionalGeneration(TextPart, Qwen3_5MoeForCausalLM):
    pass
