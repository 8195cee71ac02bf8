"""The pooler: a pooling runner's add-on (--runner pooling). A pooling request's last prefill step ends here
instead of in the sampler: the hidden state of its last token goes through the model's head (a classifier's score
linear; none for an embedder), then the request's PoolingParams (Matryoshka truncation + L2 norm for embeddings,
softmax / sigmoid for class scores). The request then finishes like a one-token request (its KV is freed)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.core.device import to_device
from kestrel.core.pooling import PoolingParams
from kestrel.core.step import ScheduledChunk
from kestrel.models.pooling import pool_head
from kestrel.worker.addons.base import StepAddon
from kestrel.worker.input_batch import RequestState

POOLED_TOKEN = 0  # the placeholder "token" a pooled request finishes with (the frontend reads its vector)


def finish_pooled(logits: torch.Tensor, p: PoolingParams) -> torch.Tensor:
    """One request's head output [features] (float32) -> what it asked for."""
    if p.task == "classify":
        if not p.activation:
            return logits
        return logits.sigmoid() if logits.numel() == 1 else logits.softmax(-1)
    if p.dimensions:
        logits = logits[:p.dimensions]
    return F.normalize(logits, dim=-1) if p.normalize else logits


class Pooler(StepAddon):
    def __init__(self, model, device: torch.device):
        self.model, self.device = model, device

    def supports_graphs(self) -> bool:
        return False  # every pooling step is a prefill (a 1-token prompt would look like a decode row)

    def pool(self, chunks: list[ScheduledChunk], states: list[RequestState], hidden: torch.Tensor,
             query_start_loc: list[int]) -> dict[str, list[float]]:
        rows = [(c.request_id, query_start_loc[b + 1] - 1, st.extras.pooling)
                for b, (c, st) in enumerate(zip(chunks, states)) if c.samples and st.extras.pooling is not None]
        if not rows:
            return {}
        last = hidden[to_device([r for _, r, _ in rows], torch.int64, self.device)]
        heads = pool_head(self.model, last).float()
        return {rid: finish_pooled(h, p).tolist() for (rid, _, p), h in zip(rows, heads)}
