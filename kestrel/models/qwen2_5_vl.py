"""Qwen2.5-VL: the native-resolution ViT (kestrel/models/vision/qwen_vit.py) -> a Qwen2 decoder whose rotary is
sectioned M-RoPE ([16, 24, 24] unless the config says otherwise). Its positions are the MRoPE scheme
(kestrel/core/positions.py): each image's tokens at its merged grid's coordinates."""
from __future__ import annotations

from typing import Iterable

import torch

from kestrel.core.positions import MRoPE
from kestrel.models.context import ModelContext
from kestrel.models.interfaces import HasPositionScheme
from kestrel.models.multimodal import ImageTextModel, tie_output_embeddings
from kestrel.models.qwen import Qwen2ForCausalLM
from kestrel.models.vision.qwen_vit import Qwen2_5VisionTransformer
from kestrel.models.weights import load_named_weights


def mrope_decoder(decoder: type, default: tuple[list[int], bool], **attention_options) -> type:
    """A Llama-style decoder class whose attention takes M-RoPE, `default` the family's (sections, interleaved);
    `attention_options`: other class options of the attention where the multimodal text config's defaults differ
    from the text family's (GLM-4.1V: q/k/v bias always, the whole head rotating unless the config says)."""
    layer = decoder.decoder_layer_cls
    attention = type(f"MRoPE{layer.attention_cls.__name__}", (layer.attention_cls,),
                     {"mrope_default": default, **attention_options})
    layer = type(f"MRoPE{layer.__name__}", (layer,), {"attention_cls": attention})
    return type(f"MRoPE{decoder.__name__}", (decoder,), {"decoder_layer_cls": layer})


Qwen2_5_VLTextModel = mrope_decoder(Qwen2ForCausalLM, ([16, 24, 24], False))


def image_grid(image: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    """An image's patch grid (t, h, w) from its processed inputs."""
    t, h, w = image["image_grid_thw"].reshape(3).tolist()
    return int(t), int(h), int(w)


class Qwen2_5_VLForConditionalGeneration(ImageTextModel, HasPositionScheme):
    lora_stages = (("model.", "decoder"),)  # the decoder's layer names (a text checkpoint's); the tower takes none
    text_model_cls = Qwen2_5_VLTextModel
    tower_cls = Qwen2_5VisionTransformer
    max_pixels = 12845056  # Qwen2-VL's image processor default (3584 x 3584): 128 x 128 patches of 14

    def __init__(self, ctx: ModelContext, prefix: str = "model"):
        super().__init__()
        hf = ctx.config.hf
        self.hf, self.config = hf, ctx.text
        self.packed_modules = self.text_model_cls.packed_modules
        if getattr(hf, "tie_word_embeddings", None) is not None:  # transformers 5 ties by the top-level flag, and
            ctx.text.tie_word_embeddings = hf.tie_word_embeddings  # the decoder ties (and loads) by its config's
        self.visual = self.tower_cls(ctx, "visual", hf.vision_config)
        self.language_model = self.text_model_cls(ctx, "model")  # named as a text checkpoint: its loader reads it
        self.tied = tie_output_embeddings(self, hf)

    @classmethod
    def position_scheme(cls, hf_config) -> MRoPE:
        merge = hf_config.vision_config.spatial_merge_size
        per_second = getattr(hf_config.vision_config, "tokens_per_second", 1)

        def grid(feature) -> tuple[int, int, int]:
            t, h, w = image_grid({"image_grid_thw": feature.data["image_grid_thw"].to_tensor()})
            return t, h // merge, w // merge

        def time_step(feature) -> float:
            """A video's temporal positions per frame group: its seconds per group x tokens_per_second."""
            seconds = feature.data.get("second_per_grid_t")
            return 1.0 if seconds is None else float(seconds.to_tensor()) * per_second
        return MRoPE(grid, time_step)

    # ---- videos (the processor's frames -> one placeholder run per video)
    video_style = "qwen2_vl"  # kestrel/frontend/qwen_video.py: transformers' Qwen2VLVideoProcessor

    @staticmethod
    def video_replacements(hf_config, processed: dict, tokens: dict[str, str]) -> list[str]:
        """Each video's placeholder text, as transformers' Qwen2.5-VL processor writes it (one video token per
        merged patch); sets `second_per_grid_ts` (seconds per temporal patch: temporal_patch_size / sampled fps)."""
        merge = hf_config.vision_config.spatial_merge_size ** 2
        temporal = hf_config.vision_config.temporal_patch_size
        processed["second_per_grid_ts"] = torch.tensor([temporal / m.sampled_fps for m in processed["video_metadata"]])
        return [tokens["video"] * int(g.prod() // merge) for g in processed["video_grid_thw"]]

    @staticmethod
    def split_videos(hf_config, processed) -> list[dict[str, torch.Tensor]]:
        """Each video as the tower reads an image of t > 1 frame groups, with its seconds per group."""
        out, start = [], 0
        seconds = processed.get("second_per_grid_ts")
        for i, g in enumerate(processed["video_grid_thw"]):
            n = int(g.prod())
            video = {"pixel_values": processed["pixel_values_videos"][start:start + n], "image_grid_thw": g}
            if seconds is not None:
                video["second_per_grid_t"] = torch.as_tensor(seconds[i], dtype=torch.float32).reshape(1)
            out.append(video)
            start += n
        return out

    # ---- frontend side
    @staticmethod
    def split_images(hf_config, processed) -> list[dict[str, torch.Tensor]]:
        """The processor concatenates every image's patches; each image keeps its t*h*w rows and its grid."""
        out, start = [], 0
        for g in processed["image_grid_thw"]:
            n = int(g.prod())
            out.append({"pixel_values": processed["pixel_values"][start:start + n], "image_grid_thw": g})
            start += n
        return out

    @staticmethod
    def num_image_tokens(hf_config, image: dict[str, torch.Tensor]) -> int:
        t, h, w = image_grid(image)
        if image["pixel_values"].shape[0] != t * h * w:
            raise ValueError(f"{image['pixel_values'].shape[0]} patches for a {t}x{h}x{w} patch grid")
        return t * h * w // hf_config.vision_config.spatial_merge_size ** 2

    # ---- runner side
    def dummy_image_inputs(self) -> dict[str, torch.Tensor]:
        """The largest image the family's processor makes by default (`max_pixels`), as a square grid (the memory
        profile then holds room for any image; a lower --mm-processor-kwargs max_pixels is not read here)."""
        v = self.hf.vision_config
        unit = v.patch_size * v.spatial_merge_size
        side = int(self.max_pixels ** 0.5) // unit * v.spatial_merge_size
        width = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
        return {"pixel_values": torch.zeros(side * side, width), "image_grid_thw": torch.tensor([1, side, side])}

    def embed_image(self, image: dict[str, torch.Tensor]) -> torch.Tensor:
        """A video's frame groups one at a time: the towers attend within a frame group only, so this is the
        whole video's encoding at one frame group's peak memory (what the memory profile's largest image holds)."""
        t, h, w = image_grid(image)
        pixels = image["pixel_values"]
        if t == 1:
            return self.visual(pixels, (t, h, w))
        return torch.cat([self.visual(pixels[i * h * w:(i + 1) * h * w], (1, h, w)) for i in range(t)])

    def lora_module_name(self, path: str) -> str | None:
        """An adapter's module path -> our decoder layer's name; a tower module keeps its name (no LoRA layer has it:
        the adapter is refused naming it)."""
        name = our_name(path)
        if not name.startswith("language_model."):
            return name
        rest = name[len("language_model."):]
        return rest if rest.startswith("lm_head") else "model." + rest

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's tensors stream through its own loader (named as in a text checkpoint); the tower's, a
        small part, are kept aside and loaded after."""
        tower: list = []

        def text():
            for name, t in weights:
                name = our_name(name)
                if not name.startswith("language_model."):
                    tower.append((name, t))
                    continue
                rest = name[len("language_model."):]
                yield rest if rest.startswith(("lm_head.", "mtp.")) else "model." + rest, t
        loaded = self.language_model.load_weights(self.text_weights(text()))
        return loaded | load_named_weights(self.visual, tower, self.packed_modules, strip="visual.")

    def text_weights(self, weights: Iterable) -> Iterable:
        """The decoder's tensors as its loader reads them (a family changes layouts here)."""
        return weights


# checkpoint prefixes, both layouts (the released one: model.layers / visual / lm_head; transformers 5's own:
# model.language_model / model.visual) -> our modules
_PREFIXES = (("model.visual.", "visual."), ("model.language_model.", "language_model."),
             ("model.", "language_model."), ("lm_head.", "language_model.lm_head."),
             ("mtp.", "language_model.mtp."))  # Qwen3.5's multi-token-prediction head: its decoder's loader skips it


def our_name(name: str) -> str:
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name
