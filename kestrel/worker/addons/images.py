"""Images in the runner: the encoder cache and the placeholder merge. An image is encoded whole the first time
any of its placeholders is scheduled and kept until the step that computes its last placeholder (chunked
prefill across an image runs the encoder once); the step's input embeddings get each scheduled placeholder's
row. Steps that merge image rows run eagerly (the decode graphs embed token ids)."""
from __future__ import annotations

import torch

from kestrel.core.step import ScheduledChunk
from kestrel.worker.addons.base import StepAddon
from kestrel.worker.input_batch import RequestState


class ImageEncoderCache(StepAddon):
    def __init__(self, model, device: torch.device, lora=None):
        """`model` declares SupportsImages; `lora`: the LoRA add-on (sets the vision parts' mappings), or None."""
        self.model, self.device, self.lora = model, device, lora
        self.cache: dict[str, dict[int, torch.Tensor]] = {}  # request id -> image index -> its embeddings
        self._merged = False

    def remove_request(self, st: RequestState) -> None:
        self.cache.pop(st.request_id, None)

    def _encode(self, lora_id: int, image: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.lora is not None:
            self.lora.before_encode(lora_id, image)
        return self.model.embed_image(image)

    def inputs_embeds(self, chunks: list[ScheduledChunk], states: list[RequestState],
                      input_ids: torch.Tensor) -> torch.Tensor | None:
        spans = []
        t = 0
        for c, st in zip(chunks, states):
            start, end = c.num_computed_tokens, c.num_computed_tokens + c.num_new_tokens
            for i, f in enumerate(st.extras.mm_features):
                if f.offset >= end or f.end <= start:
                    continue
                cache = self.cache.setdefault(c.request_id, {})
                emb = cache.get(i)
                if emb is None:
                    emb = self._encode(st.extras.lora_id, f.tensors(self.device))
                    if emb.shape[0] != f.length:
                        raise RuntimeError(f"image {i} of {c.request_id}: {emb.shape[0]} embeddings for "
                                           f"{f.length} placeholders")
                    cache[i] = emb
                lo, hi = max(start, f.offset), min(end, f.end)
                spans.append((t + lo - start, emb[lo - f.offset:hi - f.offset]))
                if hi == f.end:
                    del cache[i]  # every placeholder is computed by this step
            t += c.num_new_tokens
        self._merged = bool(spans)
        if not spans:
            return None
        embeds = self.model.embed_input_ids(input_ids)
        for row, emb in spans:
            embeds[row:row + emb.shape[0]] = emb.to(embeds.dtype)
        return embeds

    def step_graph_ok(self) -> bool:
        return not self._merged

    @torch.inference_mode()
    def warm_up(self) -> torch.Tensor:
        """The vision encoder on the largest image the model takes, so that the memory profile counts its
        activations and the first requests do not pay its kernels' first calls."""
        image = {k: v.to(self.device) for k, v in self.model.dummy_image_inputs().items()}
        return self._encode(0, image)
