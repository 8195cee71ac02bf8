"""HF checkpoint folders: config.json + *.safetensors (single file or sharded with an index json)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


class LazyTensor:
    """A checkpoint tensor not read yet: its `shape`, and `narrow` (one slice) or `read` (all of it), so that a
    tensor-parallel rank reads only its own rows or columns. `counter` adds up the bytes actually read."""

    def __init__(self, sl, counter: list[int], device: torch.device | str = "cpu"):
        self._slice = sl
        self.shape = tuple(sl.get_shape())
        self._counter = counter
        self._device = device

    def dim(self) -> int:
        return len(self.shape)

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        self._counter[0] += t.numel() * t.element_size()
        return t.to(self._device)

    def read(self) -> torch.Tensor:
        return self._count(self._slice[...])  # `...`, not `:`: a 0-dim tensor (a per-tensor scale) reads too

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = tuple([slice(None)] * dim + [slice(start, start + length)])
        return self._count(self._slice[index])


def iter_safetensors(folder: Path, progress: bool = True, lazy: bool = False, counter: list[int] | None = None,
                     device: torch.device | str = "cpu") -> Iterator[tuple[str, "torch.Tensor | LazyTensor"]]:
    """(name, tensor) for every checkpoint tensor; `lazy` yields LazyTensor slices that read on demand."""
    files = safetensors_files(folder)
    handles = [safe_open(str(f), framework="pt") for f in files]
    total = sum(len(list(h.keys())) for h in handles)
    counter = counter if counter is not None else [0]
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress, leave=False) as bar:
        for h in handles:
            for name in h.keys():
                yield name, LazyTensor(h.get_slice(name), counter, device) if lazy else h.get_tensor(name)
                bar.update(1)
