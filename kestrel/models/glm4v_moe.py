"""GLM-4.5V / GLM-4.6V (`glm4v_moe`, and transformers' `glm46v` layout with the MoE text model): the GLM-4.xV vision tower (kestrel/models/vision/glm4v_vit.py) on the
GLM-4-MoE decoder (kestrel/models/glm4_moe.py) with sectioned M-RoPE ([8, 12, 12] unless the config says
otherwise); positions, image splitting and loading as Qwen2.5-VL's (kestrel/models/qwen2_5_vl.py). Images only: no
video style, so videos are refused."""
from kestrel.errors import ConfigError
from kestrel.models.glm4_moe import Glm4MoeForCausalLM
from kestrel.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration, mrope_decoder
from kestrel.models.vision.glm4v_vit import Glm4vVisionTransformer


class Glm4vMoeForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    text_model_cls = mrope_decoder(Glm4MoeForCausalLM, ([8, 12, 12], False))
    tower_cls = Glm4vVisionTransformer
    max_pixels = 28 * 28 * 15000  # Glm4vImageProcessor's default longest_edge
    video_style = None


class Glm46VForConditionalGeneration(Glm4vMoeForConditionalGeneration):
    """transformers' `glm46v` layout: the same tower (glm4v_vision) over a text model of any GLM-4V kind; served
    where that is the MoE one (glm4v_moe_text)."""

    def __init__(self, ctx, prefix: str = "model"):
        kind = getattr(ctx.config.hf.text_config, "model_type", None)
        if kind != "glm4v_moe_text":
            raise ConfigError(f"GLM-4.6V with a {kind!r} text model is not supported: only its MoE one "
                              f"(glm4v_moe_text)")
        super().__init__(ctx, prefix)
