"""The bidirectional-prefix attention mask (models that declare HasBidirectionalPrefix, PaliGemma): a chunk
inside its request's prefix (RequestExtras.bidirectional_len) attends both ways there. The per-row prefix lengths
go into the step's attention metadata, which the backend (supports_bidirectional_prefix) reads."""
from __future__ import annotations

from kestrel.core.step import ScheduledChunk
from kestrel.worker.addons.base import StepAddon
from kestrel.worker.input_batch import RequestState


class BidirectionalPrefix(StepAddon):
    backend_requires = ("supports_bidirectional_prefix",)

    def attention_fields(self, chunks: list[ScheduledChunk], states: list[RequestState]) -> dict:
        lens = [st.extras.bidirectional_len if c.num_computed_tokens < st.extras.bidirectional_len else 0
                for c, st in zip(chunks, states)]
        return {"bidirectional_lens_cpu": lens} if any(lens) else {}
