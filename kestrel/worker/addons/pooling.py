"""The pooler: a pooling runner's add-on (--runner pooling). A pooling request's last prefill step ends here
instead of in the sampler: the pooled hidden state (its last token's; an encoder's first or mean) goes through
the model's head (a classifier's score linear; none for an embedder), then the request's PoolingParams (Matryoshka truncation + L2 norm for embeddings,
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
    """`method`: which hidden states of a request's last step make its vector: "last" (its last token: a decoder,
    whose prompt may come in chunks), "cls" (its first) or "mean" (all): an encoder's prompt is one step, so
    that step's rows are the whole prompt."""

    def __init__(self, model, device: torch.device, method: str = "last"):
        self.model, self.device, self.method = model, device, method

    def supports_graphs(self) -> bool:
        return False  # every pooling step is a prefill (a 1-token prompt would look like a decode row)

    def _pooled(self, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
        if self.method == "mean":
            return hidden[start:end].float().mean(0)
        return hidden[start if self.method == "cls" else end - 1].float()

    def pool(self, chunks: list[ScheduledChunk], states: list[RequestState], hidden: torch.Tensor,
             query_start_loc: list[int]) -> dict[str, list[float]]:
        rows = [(c.request_id, query_start_loc[b], query_start_loc[b + 1], st.extras.pooling)
                for b, (c, st) in enumerate(zip(chunks, states)) if c.samples and st.extras.pooling is not None]
        if not rows:
            return {}
        if self.method == "last":  # one gather for the batch
            pooled = hidden[to_device([e - 1 for _, _, e, _ in rows], torch.int64, self.device)]
        else:
            pooled = torch.stack([self._pooled(hidden, s, e) for _, s, e, _ in rows]).to(hidden.dtype)
        heads = pool_head(self.model, pooled).float()
        return {rid: finish_pooled(h, p).tolist() for (rid, _, _, p), h in zip(rows, heads)}
