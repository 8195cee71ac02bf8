"""Where the fused Triton elementwise kernels apply: CUDA tensors with Triton importable (the gate table in
kestrel/platform/triton_gates.py). Elsewhere the layers run their plain PyTorch path."""
from __future__ import annotations

import functools

import torch


@functools.cache
def _fused_ops():
    from kestrel.platform import triton_gates as gates

    if not gates.triton_importable()[0]:
        return None
    from kestrel.kernels.triton_ops import fused_ops

    return fused_ops


def fused_ops_for(x: torch.Tensor):
    return _fused_ops() if x.is_cuda else None
