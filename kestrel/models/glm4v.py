"""GLM-4.1V-Thinking, GLM-4.6V-Flash (`glm4v`): GLM-4.5V's tower, positions and image handling
(kestrel/models/glm4v_moe.py) on the dense GLM-4 decoder (kestrel/models/glm4.py) with sectioned M-RoPE. Its text
config (`glm4v_text`) has no bias flag: q/k/v always carry one; and the whole head rotates unless
`partial_rotary_factor` says otherwise (the released configs: 0.5). transformers' `glm46v` layout is the same
tower over either text model, by text_config's model type; its processor (Glm46VProcessor) samples video frames by
duration and writes frame times as "{t:.1f} seconds"."""
from kestrel.errors import ConfigError
from kestrel.models.glm4 import Glm4ForCausalLM
from kestrel.models.glm4v_moe import Glm4vMoeForConditionalGeneration
from kestrel.models.qwen2_5_vl import mrope_decoder


class Glm4vForConditionalGeneration(Glm4vMoeForConditionalGeneration):
    text_model_cls = mrope_decoder(Glm4ForCausalLM, ([8, 12, 12], False), qkv_bias_default=True,
                                   rope_fraction_default=1.0)


class Glm46VForConditionalGeneration(Glm4vMoeForConditionalGeneration):
    video_style = "glm46v"
    text_models = {"glm4v_text": Glm4vForConditionalGeneration.text_model_cls,
                   "glm4v_moe_text": Glm4vMoeForConditionalGeneration.text_model_cls}

    def __init__(self, ctx, prefix: str = "model"):
        kind = getattr(ctx.config.hf.text_config, "model_type", None)
        if kind not in self.text_models:
            raise ConfigError(f"GLM-4.6V with a {kind!r} text model is not supported: only "
                              f"{' or '.join(self.text_models)}")
        self.text_model_cls = self.text_models[kind]
        super().__init__(ctx, prefix)

    @staticmethod
    def frame_time(seconds: float) -> str:
        return f"{seconds:.1f} seconds"
