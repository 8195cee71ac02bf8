"""Positions as the model's: what the rotary of each token reads. A model declares its position scheme
(kestrel/models/interfaces.py `HasPositionScheme`; the default is `ONE_D`, a token's index in its sequence). The
input processor computes a prompt's positions with the prompt (`PositionScheme.prompt_positions`, after the image
processor placed the images' tokens) where they are not the index; the request carries them (`RequestExtras.positions`) and the runner lays
`rows` rows of them per token into its position buffer ([T] for one row, [rows, T] otherwise), past the prompt
each token's index plus the prompt's delta in every row (`stage_rows`). The runner, its CUDA graphs, speculative
decoding and the prefix cache never ask which scheme: a prefix's positions follow from its tokens and the images
among them, which the prefix cache keys already.

`MRoPE` is multimodal RoPE (Qwen2-VL onwards, GLM-4.xV): rows (time, height, width), equal for text; an image's
tokens take its merged patch grid's coordinates from the position after the text before it, and the text after
it continues from its largest coordinate + 1 (transformers' `get_rope_index`)."""
from __future__ import annotations

from typing import Callable, ClassVar, Sequence

import msgspec
import numpy as np


class PromptPositions(msgspec.Struct, frozen=True, array_like=True):
    """A prompt's positions where they differ from its token indices: [rows, T] int64 as raw bytes, and the delta
    every later token adds to its index (transformers' rope delta)."""
    data: bytes
    rows: int
    delta: int

    @classmethod
    def from_array(cls, positions: np.ndarray, delta: int) -> "PromptPositions":
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        return cls(positions.tobytes(), positions.shape[0], int(delta))

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.int64).reshape(self.rows, -1)


def stage_rows(out: np.ndarray, prompt: np.ndarray | None, delta: int, start: int) -> None:
    """Positions of tokens start .. start + n - 1 of one request into `out` [rows, n]: its prompt's where given,
    past them the index + delta; without prompt positions, the index in every row."""
    n = out.shape[1]
    index = np.arange(start, start + n)
    if prompt is None:
        out[:] = index
        return
    k = min(max(prompt.shape[1] - start, 0), n)
    if k:
        out[:, :k] = prompt[:, start:start + k]
    out[:, k:] = index[k:] + delta


class PositionScheme:
    """One row: a token's index (every text model, and an image model whose positions count tokens)."""
    rows: ClassVar[int] = 1

    def prompt_positions(self, token_ids: Sequence[int], features: Sequence) -> PromptPositions | None:
        """`features`: the prompt's MMFeatures in prompt order. None: the positions are the token indices."""
        return None


ONE_D = PositionScheme()


class MRoPE(PositionScheme):
    """`grid(feature)` -> (t, h, w) of an image in tokens the decoder sees (after the spatial merge);
    `time_step(feature)`: how far apart a video's frame groups sit on the time row (Qwen2.5-VL: seconds per group x
    tokens_per_second; group i at floor(i x step)), 1 where not given."""
    rows = 3

    def __init__(self, grid: Callable[[object], tuple[int, int, int]],
                 time_step: Callable[[object], float] | None = None):
        self.grid = grid
        self.time_step = time_step

    def prompt_positions(self, token_ids: Sequence[int], features: Sequence) -> PromptPositions | None:
        if not features:
            return None
        total = len(token_ids)
        out = np.empty((3, total), dtype=np.int64)
        at = nxt = 0  # the next token to place; the position the next text token takes
        for f in sorted(features, key=lambda f: f.offset):
            out[:, at:f.offset] = nxt + np.arange(f.offset - at)
            nxt += f.offset - at
            t, h, w = self.grid(f)
            if t * h * w != f.length:
                raise ValueError(f"an image grid of {t}x{h}x{w} for {f.length} placeholder tokens")
            times = np.arange(t)
            if t > 1 and self.time_step is not None:
                times = np.floor(times * self.time_step(f)).astype(np.int64)
            tt, hh, ww = np.meshgrid(times, np.arange(h), np.arange(w), indexing="ij")
            out[:, f.offset:f.end] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + nxt
            nxt += max(h, w)  # as transformers: the time row does not advance the text after it
            at = f.end
        out[:, at:] = nxt + np.arange(total - at)
        return PromptPositions.from_array(out, int(out.max()) + 1 - total)
