"""The target's hidden states a runner drafter reads (kestrel/worker/drafters.py), captured during the target's
forward. A drafter declares which ones (taps: FinalNormInput, LayerInput); their hooks copy them into one static
buffer on the device (HiddenCapture), so eager steps and CUDA graph replays (decode and verify graphs are captured
with the hooks in place) fill it alike; after the forward the runner takes the step's rows."""
from __future__ import annotations

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
