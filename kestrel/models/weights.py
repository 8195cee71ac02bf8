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


class RowRange:
    """Rows [start, start + rows) of a checkpoint tensor (a tensor or a lazy slice), read only when asked, as a
    lazy slice is: `narrow` along the rows reads just those (a tensor-parallel rank's part), `read` all of them."""

    def __init__(self, tensor, start: int, rows: int):
        self._tensor, self._start = tensor, start
        self.shape = (rows, *tuple(tensor.shape)[1:])

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self._tensor.narrow(0, self._start + start, length)
        return self.read().narrow(dim, start, length)

    def read(self) -> torch.Tensor:
        return self._tensor.narrow(0, self._start, self.shape[0])


def split_fused(weights: Iterable[tuple[str, torch.Tensor]], fused: str,
                parts: Sequence[str]) -> Iterable[tuple[str, torch.Tensor]]:
    """A checkpoint's fused projection as the tensors of its parts, equal blocks of rows in order (GLM-4's
    `mlp.gate_up_proj`: the gate's rows, then the up projection's -> `mlp.gate_proj`, `mlp.up_proj`), so that a
    merged layer loads them shard by shard (and a tensor-parallel rank its rows of each). A tensor of one row or
    none (a per-tensor scale) goes to every part."""
    key = f".{fused}."
    for name, tensor in weights:
        if key not in name:
            yield name, tensor
            continue
        rows = tensor.shape[0] if len(tensor.shape) else 1
        if rows > 1 and rows % len(parts):
            raise ValueError(f"{name}: {rows} rows do not split into {len(parts)} equal parts ({', '.join(parts)})")
        for i, part in enumerate(parts):
            ours = name.replace(key, f".{part}.")
            yield ours, tensor if rows == 1 else RowRange(tensor, i * rows // len(parts), rows // len(parts))
