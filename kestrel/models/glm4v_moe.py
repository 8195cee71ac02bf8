"""GLM-4.5V / GLM-4.6V (`glm4v_moe`): the GLM-4.xV vision tower (kestrel/models/vision/glm4v_vit.py) on the
GLM-4-MoE decoder (kestrel/models/glm4_moe.py) with sectioned M-RoPE ([8, 12, 12] unless the config says
otherwise); positions, image splitting and loading as Qwen2.5-VL's (kestrel/models/qwen2_5_vl.py); videos as
GlmFrameVideos writes them. The dense text model's forms (GLM-4.1V, and transformers' `glm46v` layout over either
text model) are in kestrel/models/glm4v.py."""
import numpy as np

from kestrel.models.glm4_moe import Glm4MoeForCausalLM
from kestrel.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration, mrope_decoder
from kestrel.models.qwen3_vl import FrameVideos
from kestrel.models.vision.glm4v_vit import Glm4vVisionTransformer


class GlmFrameVideos(FrameVideos):
    """Videos as transformers' Glm4vProcessor writes them (frames from kestrel/frontend/glm_video.py): in the
    prompt's <|begin_of_video|><|video|><|end_of_video|>, the video token becomes, per frame group, image start /
    image placeholders / image end then the group's first frame time (`frame_time`). The placeholders are the image
    token: a video's are those between video start and end. Each frame group is its own feature of grid (1, h, w),
    positioned as an image (transformers' get_rope_index splits video grids so)."""
    video_style = "glm4v"

    @staticmethod
    def frame_time(seconds: float) -> str:
        return str(int(seconds))

    @classmethod
    def video_replacements(cls, hf_config, processed: dict, tokens: dict[str, str]) -> list[str]:
        merge = hf_config.vision_config.spatial_merge_size ** 2
        temporal = hf_config.vision_config.temporal_patch_size
        out = []
        for g, meta in zip(processed["video_grid_thw"], processed["video_metadata"]):
            t = int(g[0])
            times = meta.timestamps[::temporal][:t]
            times += [times[-1] if times else 0] * (t - len(times))
            frame = tokens["image_start"] + tokens["image"] * int(g[1:].prod() // merge) + tokens["image_end"]
            out.append("".join(frame + cls.frame_time(s) for s in times))
        return out

    @staticmethod
    def video_placeholders(hf_config, ids: list[int]) -> list[int]:
        ids = np.asarray(ids)
        inside = np.cumsum(ids == hf_config.video_start_token_id) > np.cumsum(ids == hf_config.video_end_token_id)
        return np.flatnonzero(inside & (ids == hf_config.image_token_id)).tolist()


class Glm4vMoeForConditionalGeneration(GlmFrameVideos, Qwen2_5_VLForConditionalGeneration):
    text_model_cls = mrope_decoder(Glm4MoeForCausalLM, ([8, 12, 12], False))
    tower_cls = Glm4vVisionTransformer
    max_pixels = 28 * 28 * 15000  # Glm4vImageProcessor's default longest_edge
