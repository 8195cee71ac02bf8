"""Structured outputs in the runner: a launched step's token bitmask (filled on the host by the engine core's
grammars, kestrel/structured_output/) masks the constrained rows' logits on the device before sampling."""
from __future__ import annotations

import torch

from kestrel.structured_output.bitmask import apply_token_bitmask
from kestrel.worker.addons.base import StepAddon


class GrammarBitmask(StepAddon):
    def before_sample(self, logits: torch.Tensor, inf) -> None:
        if inf.bitmask is not None:
            apply_token_bitmask(logits, inf.bitmask.mask, inf.bitmask.rows)
