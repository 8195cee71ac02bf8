"""The target's hidden states a runner drafter reads (kestrel/spec_decode/drafters.py), captured during the target's
forward. A drafter declares which ones (taps: FinalNormInput, LayerInput); their hooks copy them into one static
buffer on the device (HiddenCapture), so eager steps and CUDA graph replays (decode and verify graphs are captured
with the hooks in place) fill it alike; after the forward the runner takes the step's rows."""
from __future__ import annotations

from dataclasses import dataclass

import torch


class FinalNormInput:
    """The input of the target's final norm (hidden + residual: the norm's second output where it fuses the add),
    as MTP reads it. A forward hook on model.norm."""

    def attach(self, model, write) -> None:
        model.norm.register_forward_hook(lambda module, args, output: write(
            output[1] if isinstance(output, tuple) else args[0]))


class LayerInput:
    """The residual stream entering one of the target's decoder layers (called as layer(positions, hidden,
    residual, ...): hidden + residual; the embeddings for layer 0), as EAGLE-3 reads it. A forward pre-hook."""

    def __init__(self, layer: int):
        self.layer = layer

    def attach(self, model, write) -> None:
        model.layers[self.layer].register_forward_pre_hook(
            lambda module, args: write(args[1]) if args[2] is None else write(args[1], args[2]))


class HiddenCapture:
    """The target hidden states a drafter reads (`taps`, each `width` wide, side by side in tap order), one row per
    token of the last forward, in a buffer [max_tokens, len(taps) * width] allocated once. The taps' hooks copy
    into it on the device: the copies are kernels of the forward, so a CUDA graph captured with the hooks in place
    refills the buffer on every replay, and an eager step runs the very same hooks."""

    def __init__(self, model, taps: list, width: int, max_tokens: int, device, dtype):
        self.buffer = torch.zeros(max_tokens, len(taps) * width, dtype=dtype, device=device)
        for i, tap in enumerate(taps):
            tap.attach(model, self._writer(self.buffer[:, i * width:(i + 1) * width]))

    @staticmethod
    def _writer(columns: torch.Tensor):
        def write(hidden: torch.Tensor, residual: torch.Tensor | None = None) -> None:
            n = hidden.shape[0]
            if n > columns.shape[0]:
                raise RuntimeError(f"a target forward of {n} tokens; the drafter's capture holds "
                                   f"{columns.shape[0]} (max_num_batched_tokens)")
            if residual is None:
                columns[:n].copy_(hidden)
            else:  # the sum in the inputs' type, rounded once into the buffer's
                torch.add(hidden, residual, out=columns[:n])
        return write

    def rows(self, num_tokens: int) -> torch.Tensor:
        """The last forward's first `num_tokens` rows, copied (queued behind the forward): the next step's forward
        may overwrite the buffer before the drafter reads them (pipelined steps)."""
        return self.buffer[:num_tokens].clone()


@dataclass
class KeptPositions:
    """What one chunk of a collected step computed and kept: positions start .. start + len(next_ids) - 1 (its
    known tokens and accepted drafts, not the rejected ones), captured at rows first_row.., and the token after
    each (negative: a placeholder, a pipelined step's token not known yet). `drafts`: the request sampled and the
    step drafts."""
    request_id: str
    state: object  # the runner's RequestState
    start: int
    first_row: int
    next_ids: list[int]
    drafts: bool


def kept_positions(inf, out, requests, max_batch: int | None) -> tuple[torch.Tensor | None, list[KeptPositions]]:
    """The captured rows of a collected step (None for an empty step) and, per chunk of a live request, the
    positions it kept. Above `max_batch` sampling rows (disable_by_batch_size) the engine asks for no drafts."""
    if inf.target_hidden is None:
        return None, []
    hidden, qsl, chunks = inf.target_hidden
    inf.target_hidden = None
    drafting = max_batch is None or len(inf.rows) <= max_batch
    kept = []
    for b, c in enumerate(chunks):
        rid, st = c.request_id, requests.get(c.request_id)
        if st is None:
            continue
        m = c.num_new_tokens - len(c.draft_token_ids) + len(out.more_sampled.get(rid, ()))
        start = c.num_computed_tokens
        kept.append(KeptPositions(rid, st, start, qsl[b], st.tokens_slice(start + 1, start + m + 1),
                                  c.samples and rid in out.sampled and drafting))
    return hidden, kept
