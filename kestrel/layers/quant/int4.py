"""INT4 weight-only (W4A16) checkpoints in compressed-tensors' `pack-quantized` format, as Kimi K2-Thinking, K2.5
and K2.6 ship their routed experts:

  quantization_config: {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0":
    {"targets": ["Linear"], "weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32,
    "symmetric": true, "dynamic": false, "actorder": null}, "input_activations": null}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}

Per projection: `weight_packed` int32 [out, in / 8] (eight 4-bit values a word, the first in the low bits, each
stored + 8), `weight_scale` [out, in / group] (the checkpoint's float dtype) and `weight_shape` int [2] = (out, in);
a weight is q * scale (symmetric: no zero point). Only routed experts have a kernel (kestrel/kernels/moe_int4.py):
an INT4 linear elsewhere is refused by name."""
from __future__ import annotations

from typing import Mapping

from kestrel.kernels.int4_scheme import Int4Scheme
from kestrel.layers.quant.fp8 import CompressedTensorsFp8Config

def _int4_scheme(gname: str, group: Mapping) -> Int4Scheme:
    w = group.get("weights") or {}
    where = f"compressed-tensors pack-quantized group {gname!r}"
    if w.get("type") != "int" or int(w.get("num_bits", 0)) != 4:
        raise NotImplementedError(f"{where}: only 4-bit int weights are supported (got {w.get('type')}/"
                                  f"{w.get('num_bits')} bits)")
    if not w.get("symmetric", True):
        raise NotImplementedError(f"{where}: asymmetric INT4 weights (a zero point) are not supported")
    if w.get("strategy") != "group" or not w.get("group_size"):
        raise NotImplementedError(f"{where}: only group-wise INT4 scales are supported (got strategy "
                                  f"{w.get('strategy')!r})")
    if w.get("actorder") is not None:
        raise NotImplementedError(f"{where}: activation ordering {w['actorder']!r} (a g_idx) is not supported")
    if w.get("dynamic"):
        raise NotImplementedError(f"{where}: dynamic weight quantization is not supported")
    if group.get("input_activations") is not None:
        raise NotImplementedError(f"{where}: quantized activations are not supported (W4A16 only)")
    return Int4Scheme(int(w["group_size"]))


class CompressedTensorsInt4Config(CompressedTensorsFp8Config):
    """compressed-tensors `pack-quantized` checkpoints: config groups matched by `targets`, plus `ignore`."""

    @classmethod
    def from_hf(cls, qc: Mapping) -> "CompressedTensorsInt4Config":
        groups = [(tuple(g.get("targets") or ["Linear"]), _int4_scheme(name, g))
                  for name, g in (qc.get("config_groups") or {}).items()]
        if not groups:
            raise ValueError("compressed-tensors config has no config_groups")
        return cls(groups, qc.get("ignore") or [])

    def for_layer(self, prefix: str) -> Int4Scheme | None:
        scheme = super().for_layer(prefix)
        if scheme is not None and prefix.rpartition(".")[2] != "experts":
            raise NotImplementedError(f"{prefix}: INT4 ({scheme.name}) weights are supported on routed experts only; "
                                      "this checkpoint quantizes a linear layer that has no INT4 kernel yet")
        return scheme

    def __repr__(self) -> str:
        return f"CompressedTensorsInt4Config({[(t, s.name) for t, s in self.groups]}, ignore={list(self.ignore)})"
