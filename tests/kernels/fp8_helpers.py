"""Shared helpers for FP8 kernel tests: checkpoint tensors per shard, loading, and float32 references."""
from __future__ import annotations

import torch

from kestrel.kernels.fp8_quant import (
    dequantize_block,
    dequantize_per_token_group,
    fp8_max,
    quantize_per_tensor_dynamic,
    quantize_per_tensor_static,
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_block,
    quantize_weight_per_channel,
    quantize_weight_per_tensor,
)
from kestrel.layers.quant.fp8 import Fp8Scheme


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def shard_checkpoint(scheme: Fp8Scheme, sizes, k: int, gen: torch.Generator, x_amax: float = 4.0):
    """Per-shard checkpoint tensors (what the loader would read) for random weights."""
    shards = []
    for i, n in enumerate(sizes):
        w = torch.randn(n, k, generator=gen) * (0.05 * (i + 1))  # shards of different magnitude
        t: dict[str, torch.Tensor] = {}
        if not scheme.serialized:
            t["weight"] = w
        elif scheme.weight == "block":
            t["weight"], t[scheme.weight_scale_name] = quantize_weight_block(w, scheme.block_size)
        elif scheme.weight == "channel":
            t["weight"], t["weight_scale"] = quantize_weight_per_channel(w)
        else:
            q, s = quantize_weight_per_tensor(w)
            t["weight"], t["weight_scale"] = q, s.reshape(1)
        if scheme.has_input_scale:
            t["input_scale"] = torch.tensor([x_amax * (1 + 0.1 * i) / fp8_max()])
        shards.append(t)
    return shards


def load_shards(layer, shards, merged: bool | None = None):
    merged = len(shards) > 1 if merged is None else merged
    for i, tensors in enumerate(shards):
        for name, t in tensors.items():
            layer.load_weight(name, t, shard_id=i if merged else None)


def reference_weight(scheme: Fp8Scheme, shards, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """The dense fp32 weight the checkpoint encodes (computed independently of the kernels). `dtype` is the FP8
    type that quantize-on-load rounds into (the device's)."""
    parts = []
    for t in shards:
        w = t["weight"]
        if not scheme.serialized:
            q, s = quantize_weight_per_channel(w, dtype)
            parts.append(q.float() * s)
        elif scheme.weight == "block":
            parts.append(dequantize_block(w, t[scheme.weight_scale_name], scheme.block_size))
        else:
            parts.append(w.float() * t["weight_scale"].float().reshape(-1, 1))
    return torch.cat(parts)


def reference_activation(scheme: Fp8Scheme, x: torch.Tensor, shards, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """x after the scheme's activation quantization, dequantized to fp32."""
    x2 = x.reshape(-1, x.shape[-1])
    if scheme.activation is None:
        out = x2.float()
    elif scheme.has_input_scale:
        s = torch.stack([t["input_scale"].reshape(()) for t in shards]).max()
        if dtype == torch.float8_e4m3fnuz:
            s = s * 2
        out = quantize_per_tensor_static(x2, s, dtype).float() * s
    elif scheme.activation == "token":
        q, s = quantize_per_token(x2, dtype)
        out = q.float() * s
    elif scheme.activation == "group":
        q, s = quantize_per_token_group(x2, scheme.group_size, dtype)
        out = dequantize_per_token_group(q, s, scheme.group_size)
    else:
        q, s = quantize_per_tensor_dynamic(x2, dtype)
        out = q.float() * s
    return out.reshape(*x.shape[:-1], x.shape[-1])
