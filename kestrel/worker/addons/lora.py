"""LoRA in the runner: each step's token -> adapter-slot mapping (the decoder's), and an image's mapping for the
vision parts (asked by the image add-on before it encodes). The LoRAManager (kestrel/lora/manager.py) holds the
adapters and device slots; this add-on only tells it which adapters the live requests use."""
from __future__ import annotations

from collections import Counter

import torch

from kestrel.core.step import ScheduledChunk
from kestrel.lora.manager import LoRAManager
from kestrel.worker.addons.base import StepAddon
from kestrel.worker.input_batch import RequestState


class LoRAAddon(StepAddon):
    def __init__(self, manager: LoRAManager, model):
        self.manager, self.model = manager, model
        self.live: Counter[int] = Counter()  # adapter id -> live requests using it (their slots are not evicted)

    def add_request(self, st: RequestState) -> None:
        if st.extras.lora_id:
            self.live[st.extras.lora_id] += 1

    def remove_request(self, st: RequestState) -> None:
        i = st.extras.lora_id
        if i:
            self.live[i] -= 1
            if not self.live[i]:
                del self.live[i]

    def prepare(self, chunks: list[ScheduledChunk], states: list[RequestState]) -> None:
        self.manager.set_mapping([st.extras.lora_id for st in states], [c.num_new_tokens for c in chunks],
                                 self.live.keys())

    def failed_requests(self, chunks: list[ScheduledChunk], states: list[RequestState]) -> dict[str, str]:
        """Requests whose adapter could not be read again at this step (they ran without it)."""
        bad = self.manager.unreadable
        if not bad:
            return {}
        return {c.request_id: bad[st.extras.lora_id] for c, st in zip(chunks, states) if st.extras.lora_id in bad}

    def supports_graphs(self) -> bool:
        return self.manager.backend == "triton"  # the PyTorch reference reads the mapping on the host

    def before_encode(self, lora_id: int, image: dict[str, torch.Tensor]) -> None:
        """The vision tower's and connector's mappings for one image: its request's adapter on every row, the row
        counts from the image's processed inputs (the model's lora_encoder_tokens)."""
        if self.manager.encoder_mappings:
            self.manager.set_encoder_mapping(lora_id, self.model.lora_encoder_tokens(image), self.live.keys())
