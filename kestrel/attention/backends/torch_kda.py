"""Kimi Delta Attention in plain PyTorch (kestrel/kernels/kda_ref.py): the chunked form for prefills and
chunks, one request at a time (or fla's batched chunk_kda where the gate row `fla_chunk_kda` is open: see
kestrel/attention/kda.py), and the unfused decode chain vectorised over requests (graph-safe). Runs anywhere; the
CPU backend and the fallback where the fused decode kernel's gate is closed."""
from __future__ import annotations

import torch

from kestrel.attention.kda import KDABackend, KDAImpl


class TorchKDAImpl(KDAImpl):
    pass


class TorchKDABackend(KDABackend):
    name = "torch_kda"
    devices = ("cpu", "cuda")
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supports_cuda_graphs = True
    impl_cls = TorchKDAImpl
