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


def iter_safetensors(folder: Path, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    files = safetensors_files(folder)
    handles = [safe_open(str(f), framework="pt") for f in files]
    total = sum(len(list(h.keys())) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress, leave=False) as bar:
        for h in handles:
            for name in h.keys():
                yield name, h.get_tensor(name)
                bar.update(1)
