"""GLM-4.5V / GLM-4.6V (`glm4v_moe`): the GLM-4.xV vision tower (kestrel/models/vision/glm4v_vit.py) on the
GLM-4-MoE decoder (kestrel/models/glm4_moe.py) with sectioned M-RoPE ([8, 12, 12] unless the config says
otherwise); positions, image splitting and loading as Qwen2.5-VL's (kestrel/models/qwen2_5_vl.py). Images only: no
video style, so videos are refused. The dense text model's forms (GLM-4.1V, and transformers' `glm46v` layout over
either text model) are in kestrel/models/glm4v.py."""
from kestrel.models.glm4_moe import Glm4MoeForCausalLM
from kestrel.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration, mrope_decoder
from kestrel.models.vision.glm4v_vit import Glm4vVisionTransformer


class Glm4vMoeForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    text_model_cls = mrope_decoder(Glm4MoeForCausalLM, ([8, 12, 12], False))
    tower_cls = Glm4vVisionTransformer
    max_pixels = 28 * 28 * 15000  # Glm4vImageProcessor's default longest_edge
    video_style = None
