"""LLaVA-NeXT: CLIP tower (up to `vision_feature_layer`) -> two-layer MLP projector -> anyres packing (tiles,
unpadding, image-newline; kestrel/models/vision/anyres.py) -> a Llama, Mistral or Qwen2 decoder."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from kestrel.models.context import ModelContext
from kestrel.models.llama import LlamaForCausalLM
from kestrel.models.multimodal import ImageTextModel, mm_weights, tie_output_embeddings
from kestrel.models.qwen import Qwen2ForCausalLM
from kestrel.models.vision import anyres
from kestrel.models.vision.clip import CLIPVisionTransformer
from kestrel.models.vision.encoder import activation, vision_linear
from kestrel.models.weights import load_named_weights, materialize

DECODERS = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}


class LlavaNextProjector(nn.Module):
    def __init__(self, ctx, prefix: str, hf):
        super().__init__()
        bias = getattr(hf, "multimodal_projector_bias", True)
        h = ctx.text.hidden_size
        self.linear_1 = vision_linear(ctx, hf.vision_config.hidden_size, h, f"{prefix}.linear_1", bias)
        self.linear_2 = vision_linear(ctx, h, h, f"{prefix}.linear_2", bias)
        self.act = activation(hf.projector_hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def _check_config(hf) -> None:
    if not isinstance(hf.vision_feature_layer, int):
        raise NotImplementedError("LLaVA-NeXT with several vision feature layers is not supported")
    if hf.vision_feature_select_strategy != "default":
        raise NotImplementedError(f"vision_feature_select_strategy {hf.vision_feature_select_strategy!r} "
                                  "is not supported (only 'default': the class token is dropped)")
    if hf.vision_config.model_type != "clip_vision_model":
        raise NotImplementedError(f"LLaVA-NeXT vision tower {hf.vision_config.model_type!r} is not supported")


class LlavaNextForConditionalGeneration(ImageTextModel):
    # LoRA: the decoder per step token, the CLIP tower and the projector per image row (kestrel/lora/manager.py)
    lora_stages = (("language_model.", "decoder"), ("vision_tower.", "tower"), ("multi_modal_projector.", "connector"))

    def __init__(self, ctx: ModelContext, prefix: str = "model"):
        super().__init__()
        hf, text = ctx.config.hf, ctx.text
        _check_config(hf)
        if text.model_type not in DECODERS:
            raise NotImplementedError(f"LLaVA-NeXT with a {text.model_type!r} decoder is not supported; "
                                      f"supported: {', '.join(DECODERS)}")
        decoder_cls = DECODERS[text.model_type]
        self.config = text
        self.hf = hf
        self.packed_modules = decoder_cls.packed_modules
        self.vision_tower = CLIPVisionTransformer(ctx, "vision_tower", hf.vision_config, hf.vision_feature_layer)
        self.multi_modal_projector = LlavaNextProjector(ctx, "multi_modal_projector", hf)
        self.image_newline = nn.Parameter(torch.empty(text.hidden_size, dtype=ctx.dtype), requires_grad=False)
        self.language_model = decoder_cls(ctx, "language_model")
        self.tied = tie_output_embeddings(self, hf)

    # ---- frontend side
    @staticmethod
    def split_images(hf_config, processed) -> list[dict[str, torch.Tensor]]:
        """The processor pads every image's tiles to the batch's most; each image keeps the tiles its size needs."""
        tile = hf_config.vision_config.image_size
        out = []
        for pv, size in zip(processed["pixel_values"], processed["image_sizes"]):
            n = anyres.num_tiles(tuple(size.tolist()), hf_config.image_grid_pinpoints, tile)
            out.append({"pixel_values": pv[:n], "image_sizes": size})
        return out

    @staticmethod
    def num_image_tokens(hf_config, image: dict[str, torch.Tensor]) -> int:
        v = hf_config.vision_config
        size = tuple(image["image_sizes"].tolist())
        tiles = image["pixel_values"].shape[0]
        expected = anyres.num_tiles(size, hf_config.image_grid_pinpoints, v.image_size)
        if tiles != expected:
            raise ValueError(f"{tiles} tiles for an image of size {size}; its anyres grid needs {expected}")
        return anyres.num_image_tokens(size, hf_config.image_grid_pinpoints, v.image_size, v.image_size // v.patch_size)

    # ---- runner side
    def dummy_image_inputs(self) -> dict[str, torch.Tensor]:
        """An image the size of the pinpoint with the most tiles: the most tiles and embeddings one image gives."""
        tile = self.hf.vision_config.image_size
        ph, pw = max(self.hf.image_grid_pinpoints, key=lambda p: (p[0] // tile) * (p[1] // tile))
        tiles = anyres.num_tiles((ph, pw), self.hf.image_grid_pinpoints, tile)
        return {"pixel_values": torch.zeros(tiles, 3, tile, tile), "image_sizes": torch.tensor([ph, pw])}

    def embed_image(self, image: dict[str, torch.Tensor]) -> torch.Tensor:
        features = self.vision_tower(image["pixel_values"])[:, 1:]  # drop the class token
        t, n, c = features.shape
        projected = self.multi_modal_projector(features.reshape(t * n, c)).view(t, n, -1)
        return anyres.pack_image_features(projected, tuple(image["image_sizes"].tolist()),
                                          self.hf.image_grid_pinpoints, self.hf.vision_config.image_size,
                                          self.image_newline)

    def lora_encoder_tokens(self, image: dict[str, torch.Tensor]) -> dict[str, int]:
        """Rows the tower and the projector process for one image, from its tiles: each tile's patches and class
        token in the tower, the patches alone in the projector."""
        tiles = image["pixel_values"].shape[0]
        patches = self.vision_tower.num_positions - 1
        return {"tower": tiles * (patches + 1), "connector": tiles * patches}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rest():
            for name, tensor in mm_weights(self, weights, self.tied):
                if name == "image_newline":  # a parameter of the model itself
                    self.image_newline.data.copy_(materialize(tensor))
                else:
                    yield name, tensor
        return load_named_weights(self, rest(), self.packed_modules, strip="")
