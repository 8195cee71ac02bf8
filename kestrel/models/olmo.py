"""Olmo 2 and Olmo 3: the Llama decoder with norms on each sublayer's output instead of its input (post-norm) and
one q/k RMSNorm over all heads together; Olmo 3 adds sliding-window attention on three of every four layers
(`layer_types`, with a rope per layer type), which the Llama attention reads from the config."""
from kestrel.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class OlmoAttention(LlamaAttention):
    use_qk_norm = True
    qk_norm_all_heads = True


class OlmoDecoderLayer(LlamaDecoderLayer):
    attention_cls = OlmoAttention
    norm_placement = "post"


class Olmo3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = OlmoDecoderLayer
