"""Kimi K2.5 / K2.6 (model_type kimi_k25): a DeepSeek-V3 text model (its routed experts INT4, layers/quant/int4.py)
behind a vision tower. The text part is served: `language_model.model.*` read as `model.*` and
`language_model.lm_head.*` as `lm_head.*` (transformers' own names, `model.language_model.*`, too); the vision
tower and projector are skipped with one log line, and images are refused naming why."""
from __future__ import annotations

import logging
from typing import Iterable

import torch

from kestrel.models.deepseek_v2 import DeepseekV3ForCausalLM

logger = logging.getLogger(__name__)

TEXT_ONLY = ("the vision tower of Kimi K2.5 / K2.6 checkpoints is not supported yet: this server serves their text "
             "part only")
RENAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
           ("model.language_model.", "model."))
VISION = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")


class KimiK25ForConditionalGeneration(DeepseekV3ForCausalLM):
    images_refused = TEXT_ONLY

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skipped = [0]

        def text_part(stream):
            for name, tensor in stream:
                if name.startswith(VISION):
                    skipped[0] += 1
                    continue
                old = next((o for o, _ in RENAMES if name.startswith(o)), None)
                yield (name if old is None else dict(RENAMES)[old] + name[len(old):]), tensor

        loaded = super().load_weights(text_part(weights))
        logger.info("Kimi K2.5: loaded the text model; skipped the vision tower and projector (%d tensors): %s",
                    skipped[0], TEXT_ONLY)
        return loaded
