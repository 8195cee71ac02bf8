"""INT4 weight-only (W4A16) checkpoints in compressed-tensors' `pack-quantized` format, as Kimi K2-Thinking, K2.5
and K2.6 ship their routed experts:

  quantization_config: {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0":
    {"targets": ["Linear"], "weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32,
    "symmetric": true, "dynamic": false, "actorder": null}, "input_activations": null}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}

Per projection: `weight_packed` int32 [out, in / 8] (eight 4-bit values a word, the first in the low bits, each
stored + 8), `weight_scale` [out, in / group] (the checkpoint's float dtype) and `weight_shape` int [2] = (out, in);
a weight is q * scale (symmetric: no zero point; asymmetric linears add `weight_zero_point` int32
[out / 8, in / group], zero points + 8 packed along the output rows, and a weight is (q - zero) * scale). Routed experts run the INT4 MoE kernels (kestrel/kernels/
moe_int4.py); every other linear layer the W4A16 linear kernels (kestrel/kernels/w4a16.py), group- or
channel-wise (strategy "channel": `weight_scale` [out, 1])."""
from __future__ import annotations

from typing import Mapping

from kestrel.kernels.int4_scheme import Int4Scheme
from kestrel.kernels.w4a16_scheme import W4A16Scheme
from kestrel.layers.quant.fp8 import CompressedTensorsFp8Config

def _int4_scheme(gname: str, group: Mapping) -> W4A16Scheme:
    w = group.get("weights") or {}
    where = f"compressed-tensors pack-quantized group {gname!r}"
    if w.get("type") != "int" or int(w.get("num_bits", 0)) != 4:
        raise NotImplementedError(f"{where}: only 4-bit int weights are supported (got {w.get('type')}/"
                                  f"{w.get('num_bits')} bits)")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel") or (strategy == "group" and not w.get("group_size")):
        raise NotImplementedError(f"{where}: only group-wise or channel-wise INT4 scales are supported (got "
                                  f"strategy {strategy!r})")
    # "weight" / "static" ordering only orders the quantization (no g_idx is saved, groups stay contiguous);
    # "group" / "dynamic" saves each column's group as weight_g_idx
    actorder = w.get("actorder")
    if actorder not in (None, "weight", "static", "group", "dynamic"):
        raise NotImplementedError(f"{where}: activation ordering {actorder!r} is not supported")
    if w.get("dynamic"):
        raise NotImplementedError(f"{where}: dynamic weight quantization is not supported")
    if group.get("input_activations") is not None:
        raise NotImplementedError(f"{where}: quantized activations are not supported (W4A16 only)")
    return W4A16Scheme("compressed-tensors", int(w["group_size"]) if strategy == "group" else -1,
                       act_order=actorder in ("group", "dynamic"), symmetric=bool(w.get("symmetric", True)))


class CompressedTensorsInt4Config(CompressedTensorsFp8Config):
    """compressed-tensors `pack-quantized` checkpoints: config groups matched by `targets`, plus `ignore`. Routed
    experts get an `Int4Scheme` (the INT4 MoE kernels, group-wise only), every other linear a `W4A16Scheme`."""

    @classmethod
    def from_hf(cls, qc: Mapping) -> "CompressedTensorsInt4Config":
        return cls.from_groups(qc, _int4_scheme)

    def for_layer(self, prefix: str):
        scheme = super().for_layer(prefix)
        if scheme is not None and prefix.rpartition(".")[2] == "experts":
            if scheme.group_size == -1:
                raise NotImplementedError(f"{prefix}: channel-wise INT4 experts are not supported (group-wise only)")
            if not scheme.symmetric:
                raise NotImplementedError(f"{prefix}: asymmetric INT4 experts (a zero point) are not supported")
            if scheme.act_order:
                raise NotImplementedError(f"{prefix}: INT4 experts with activation ordering (a g_idx) are not "
                                          "supported")
            return Int4Scheme(scheme.group_size)
        return scheme
