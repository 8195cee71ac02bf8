"""Checkpoint tensors into a model's parameters: names resolved to modules, merged projections (q/k/v, gate/up)
filled shard by shard, and each linear layer's post-load step run once at the end."""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from kestrel.attention.kv_quant import checkpoint_kv_scale, load_checkpoint_kv_scale
from kestrel.layers.linear import Linear, materialize


def stacked_names(packed_modules: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, int]]:
    """{"qkv_proj": ("q_proj", "k_proj", "v_proj")} -> {"q_proj": ("qkv_proj", 0), ...}."""
    return {ckpt: (ours, i) for ours, parts in packed_modules.items() for i, ckpt in enumerate(parts)}


def resolve(model: nn.Module, name: str, stacked: dict[str, tuple[str, int]], strip: str = "model."):
    """Checkpoint tensor name -> (module, param name, shard id). Tensors may be lazy safetensors slices (tensor
    parallelism: each layer reads only its rank's part); anything else reads the whole tensor."""
    if name.startswith(strip):
        name = name[len(strip):]
    path, param = name.rsplit(".", 1)
    parts = path.split(".")
    shard = None
    if parts[-1] in stacked:
        parts[-1], shard = stacked[parts[-1]]
    return model.get_submodule(".".join(parts)), param, shard


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       packed_modules: Mapping[str, Sequence[str]], skip_lm_head: bool = False,
                       strip: str = "model.") -> set[str]:
    stacked = stacked_names(packed_modules)
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (skip_lm_head and name == "lm_head.weight"):
            continue
        kv_scale = checkpoint_kv_scale(name)
        if kv_scale is not None:  # an FP8 checkpoint's per-tensor K/V scale: the attention layer's
            parent, which = kv_scale
            module = model.get_submodule(parent[len(strip):] if parent.startswith(strip) else parent)
            load_checkpoint_kv_scale(module, name, which, materialize(tensor))
            continue
        module, param, shard = resolve(model, name, stacked, strip)
        if isinstance(module, Linear):
            module.load_weight(param, tensor, shard)
            loaded.add(f"{id(module)}.{param}.{shard}")
        elif hasattr(module, "load_weight"):  # vocab-parallel embedding / LM head: reads its own rows
            module.load_weight(name, tensor)
            loaded.add(f"{id(module)}.{param}")
        else:
            tensor = materialize(tensor)
            p = getattr(module, param)
            if p.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(p.shape)}")
            p.data.copy_(tensor)
            loaded.add(f"{id(module)}.{param}")
    for m in model.modules():
        if hasattr(m, "process_weights_after_loading") and m is not model:
            m.process_weights_after_loading()
    return loaded
