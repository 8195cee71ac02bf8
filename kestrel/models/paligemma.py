"""PaliGemma: SigLIP tower -> one linear projector -> the Gemma decoder.

As transformers 5 runs generation: the image and prompt tokens (the prefix) attend to each other bidirectionally
and generated tokens causally (the class declares HasBidirectionalPrefix: the request's extras carry the prefix
length, the backend's metadata the per-row lengths, and the scheduler computes the prefix in one chunk);
positions are 1-based. The projector's output goes into the placeholder rows as is: Gemma's sqrt(hidden) scaling
belongs to the token embedding (`embed_input_ids`), so nothing rescales image embeddings either way (a legacy
inverse scaling, dividing them by sqrt(hidden), gave wrong magnitudes; tests/models/test_multimodal.py guards it)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from kestrel.layers.rotary import RotaryEmbedding
from kestrel.models.context import ModelContext
from kestrel.models.interfaces import HasBidirectionalPrefix
from kestrel.models.gemma import GemmaForCausalLM
from kestrel.models.llama import head_dim_of
from kestrel.models.multimodal import ImageTextModel, mm_weights, tie_output_embeddings
from kestrel.models.vision.encoder import vision_linear
from kestrel.models.vision.siglip import HEAD_PREFIX, SiglipVisionTransformer
from kestrel.models.weights import load_named_weights


class PaliGemmaForConditionalGeneration(ImageTextModel, HasBidirectionalPrefix):
    position_offset = 1
    packed_modules = GemmaForCausalLM.packed_modules
    lora_stages = (("language_model.", "decoder"),)  # LoRA on the decoder only (not on the SigLIP tower)

    def __init__(self, ctx: ModelContext, prefix: str = "model"):
        super().__init__()
        hf, text = ctx.config.hf, ctx.text
        self.config = text
        # 1-based positions: the rotary table needs one row more than the context
        ctx.shared("rotary", lambda: RotaryEmbedding(text, head_dim_of(text), ctx.max_positions + 1, ctx.dtype))
        vcfg = hf.vision_config
        self.image_size = vcfg.image_size
        self.vision_tower = SiglipVisionTransformer(ctx, "vision_tower", vcfg)
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.linear = vision_linear(ctx, vcfg.hidden_size, hf.projection_dim,
                                                          "multi_modal_projector.linear")
        self.language_model = GemmaForCausalLM(ctx, "language_model")
        self.tied = tie_output_embeddings(self, hf)

    # ---- frontend side (class level: no weights needed)
    @staticmethod
    def split_images(hf_config, processed) -> list[dict[str, torch.Tensor]]:
        return [{"pixel_values": pv} for pv in processed["pixel_values"]]

    @staticmethod
    def num_image_tokens(hf_config, image: dict[str, torch.Tensor]) -> int:
        patch = hf_config.vision_config.patch_size
        h, w = image["pixel_values"].shape[-2:]
        return (h // patch) * (w // patch)

    # ---- runner side
    def dummy_image_inputs(self) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.zeros(3, self.image_size, self.image_size)}

    def embed_image(self, image: dict[str, torch.Tensor]) -> torch.Tensor:
        features = self.vision_tower(image["pixel_values"][None])[0]
        n, c = features.shape
        return self.multi_modal_projector.linear(features).view(n, -1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        head = f"vision_tower.{HEAD_PREFIX}"  # SigLIP's pooling head: saved with vision_use_head, never run
        kept = ((name, t) for name, t in mm_weights(self, weights, self.tied) if not name.startswith(head))
        return load_named_weights(self, kept, self.packed_modules, strip="")
