"""What image-text models share: checkpoint names mapped onto our modules, the text token embedding with image
tokens out of the vocabulary kept in range, and `ImageTextModel`, their common base: the text-side interface over
the decoder in `self.language_model`, `lora_module_name`, and the declared `SupportsImages` + `SupportsLoRA`
interfaces (kestrel/models/interfaces.py) each model class implements. `embed_image` returns the embeddings at
the magnitude the decoder expects in the placeholder rows of `forward(inputs_embeds=...)`."""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from kestrel.models.interfaces import SupportsImages, SupportsLoRA

# checkpoint prefixes (legacy and transformers 5 layouts) -> our module names
_RENAMES = [
    (re.compile(r"^(model\.)?language_model\.model\."), "language_model."),
    (re.compile(r"^(model\.)?language_model\.lm_head\."), "language_model.lm_head."),
    (re.compile(r"^model\.language_model\."), "language_model."),
    (re.compile(r"^lm_head\."), "language_model.lm_head."),
    (re.compile(r"^(model\.)?vision_tower\.vision_model\.embeddings\."), "vision_tower."),
    (re.compile(r"^(model\.)?vision_tower\.vision_model\."), "vision_tower."),
    (re.compile(r"^(model\.)?vision_tower\.embeddings\."), "vision_tower."),
    (re.compile(r"^model\.vision_tower\."), "vision_tower."),
    (re.compile(r"^model\.(multi_modal_projector|image_newline)"), r"\1"),
]


def rename_checkpoint(name: str) -> str:
    for pattern, repl in _RENAMES:
        new = pattern.sub(repl, name, count=1)
        if new != name:
            return new
    return name


def mm_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], tied: bool):
    """Checkpoint tensors under our names; tensors of modules the model does not build (CLIP layers past the
    feature layer, its pooled-output norm, a tied lm_head) are dropped."""
    for name, tensor in weights:
        ours = rename_checkpoint(name)
        if tied and ours == "language_model.lm_head.weight":
            continue
        owner = ours.rsplit(".", 1)[0]
        m = re.match(r"vision_tower\.encoder\.layers\.(\d+)\.", ours)
        if m and int(m.group(1)) >= len(model.vision_tower.encoder.layers):
            continue
        if owner == "vision_tower.post_layernorm" and not hasattr(model.vision_tower, "post_layernorm"):
            continue
        yield ours, tensor


def checkpoint_module_name(model: torch.nn.Module, path: str, tied: bool) -> str | None:
    """A checkpoint's module path (an adapter's target) under our names, as mm_weights maps its weights; None for a
    module the model does not build."""
    kept = [ours for ours, _ in mm_weights(model, [(f"{path}.weight", None)], tied)]
    return kept[0].removesuffix(".weight") if kept else None


def tie_output_embeddings(model: torch.nn.Module, hf_config) -> bool:
    """transformers 5 ties the decoder's lm_head to its embeddings by the top-level config's flag (PaliGemma sets it
    there, not in text_config). Returns whether they are tied."""
    lm = model.language_model
    tied = getattr(hf_config, "tie_word_embeddings", None)
    if tied is None:
        tied = getattr(hf_config.get_text_config(), "tie_word_embeddings", False)
    if tied:
        lm.lm_head.weight = lm.embed_tokens.weight
    return bool(tied)


def image_token_id(hf_config) -> int:
    tid = getattr(hf_config, "image_token_id", None)
    return getattr(hf_config, "image_token_index", None) if tid is None else tid


class ImageTextModel(nn.Module, SupportsLoRA, SupportsImages):
    """The text side of an image-text model: token embeddings, forward and logits go to `self.language_model`;
    `self.config` is the decoder's config, `self.tied` whether its lm_head is its embedding. `position_offset` is
    added to the positions the decoder sees (PaliGemma counts them from 1)."""
    position_offset = 0

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Image placeholder ids lie past the decoder's vocabulary: they embed as token 0 (their rows are replaced
        by image embeddings)."""
        vocab = self.config.vocab_size
        return self.language_model.embed_input_ids(torch.where(input_ids < vocab, input_ids, 0))

    def forward(self, input_ids, positions, ctx, inputs_embeds=None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        if self.position_offset:
            positions = positions + self.position_offset
        return self.language_model(input_ids, positions, ctx, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def lora_module_name(self, path: str) -> str | None:
        return checkpoint_module_name(self, path, self.tied)
