"""Per-device int32 counters for kernels whose last program to finish a tile reduces it (split-K GEMM, split
decode). Every such kernel resets the counters it used before it ends, so they are zero between launches and
the kernels can be captured in CUDA graphs. Launches on one stream run in order, so kernels can share them."""
from __future__ import annotations

import functools

import torch

CAPACITY = 1 << 16


@functools.cache
def tile_counters(device: torch.device) -> torch.Tensor:
    return torch.zeros(CAPACITY, dtype=torch.int32, device=device)
