"""GPTQ and AWQ 4-bit checkpoints, and compressed-tensors W8A8 INT8 (`int-quantized`): quant configs mapping a
checkpoint's `quantization_config` onto per-layer schemes (kestrel/kernels/w4a16_scheme.py, kestrel/kernels/int8.py).

GPTQ: {"quant_method": "gptq", "bits": 4 (or 8), "group_size": 128 (or -1), "desc_act": bool, "sym": bool,
       "checkpoint_format": "gptq" | "gptq_v2", "lm_head": false, "modules_to_not_convert": [...]}
AWQ:  {"quant_method": "awq", "bits" (or "w_bit"): 4, "group_size" (or "q_group_size"): 128, "zero_point": true,
       "version": "gemm", "modules_to_not_convert": [...]}
compressed-tensors int-quantized: weights {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": true},
       input_activations {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": true, "symmetric": true}
       (or null: weight-only)."""
from __future__ import annotations

from typing import Iterable, Mapping

from kestrel.kernels.int8 import Int8Scheme
from kestrel.kernels.w4a16_scheme import W4A16Scheme
from kestrel.layers.quant.fp8 import CompressedTensorsFp8Config, QuantConfigBase


class _WholeModelConfig(QuantConfigBase):
    """One scheme for every linear layer but the ignored ones; routed experts are refused by name."""

    def __init__(self, scheme, ignore: Iterable[str] = (), packed_modules=None):
        super().__init__(ignore, packed_modules)
        self.scheme = scheme

    def _scheme_for_module(self, prefix: str):
        return self.scheme

    def for_layer(self, prefix: str):
        scheme = super().for_layer(prefix)
        if scheme is not None and prefix.rpartition(".")[2] == "experts":
            raise NotImplementedError(f"{prefix}: {self.name} MoE experts are not supported (dense linear layers only)")
        return scheme

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.scheme.name}, ignore={list(self.ignore)})"


def _bits(qc: Mapping, method: str, allowed: tuple[int, ...] = (4,)) -> int:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits not in allowed:
        raise NotImplementedError(f"{method} checkpoint: {bits}-bit weights are not supported "
                                  f"({' or '.join(map(str, allowed))}-bit only)")
    return bits


def _group(qc: Mapping, method: str, *keys: str) -> int:
    for key in keys:
        if qc.get(key) is not None:
            g = int(qc[key])
            if g != -1 and (g <= 0 or g % 8):
                raise NotImplementedError(f"{method} checkpoint: group size {g} is not supported (-1 or a multiple "
                                          "of 8)")
            return g
    return 128


class GPTQConfig(_WholeModelConfig):
    name = "gptq"

    @classmethod
    def from_hf(cls, qc: Mapping) -> "GPTQConfig":
        bits = _bits(qc, "gptq", (4, 8))
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise NotImplementedError(f"gptq checkpoint: checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        if qc.get("lm_head"):
            raise NotImplementedError("gptq checkpoint: a quantized lm_head (lm_head: true) is not supported")
        if qc.get("dynamic"):
            raise NotImplementedError("gptq checkpoint: per-module overrides (dynamic) are not supported")
        scheme = W4A16Scheme(fmt, _group(qc, "gptq", "group_size"), bool(qc.get("desc_act", False)),
                             bool(qc.get("sym", True)), bits)
        return cls(scheme, list(qc.get("modules_to_not_convert") or []))


class AWQConfig(_WholeModelConfig):
    name = "awq"

    @classmethod
    def from_hf(cls, qc: Mapping) -> "AWQConfig":
        _bits(qc, "awq")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise NotImplementedError(f"awq checkpoint: version {version!r} is not supported (the GEMM layout only)")
        if not qc.get("zero_point", True):
            raise NotImplementedError("awq checkpoint: zero_point false is not supported")
        scheme = W4A16Scheme("awq", _group(qc, "awq", "group_size", "q_group_size"), False, False)
        return cls(scheme, list(qc.get("modules_to_not_convert") or []))


def _int8_scheme(gname: str, group: Mapping) -> Int8Scheme:
    w = group.get("weights") or {}
    where = f"compressed-tensors int-quantized group {gname!r}"
    if w.get("type") != "int" or int(w.get("num_bits", 0)) != 8:
        raise NotImplementedError(f"{where}: only 8-bit int weights are supported (got {w.get('type')}/"
                                  f"{w.get('num_bits')} bits)")
    if not w.get("symmetric", True):
        raise NotImplementedError(f"{where}: asymmetric INT8 weights (a zero point) are not supported")
    if w.get("strategy") != "channel":
        raise NotImplementedError(f"{where}: INT8 weight strategy {w.get('strategy')!r} is not supported (channel)")
    if w.get("dynamic"):
        raise NotImplementedError(f"{where}: dynamic weight quantization is not supported")
    a = group.get("input_activations")
    if a is None:
        return Int8Scheme(None)
    if a.get("type", "int") != "int" or int(a.get("num_bits", 8)) != 8:
        raise NotImplementedError(f"{where}: only 8-bit int activations are supported")
    if a.get("strategy") != "token" or not a.get("dynamic"):
        raise NotImplementedError(f"{where}: INT8 activations must be dynamic per token (got strategy "
                                  f"{a.get('strategy')!r}, dynamic={a.get('dynamic')})")
    if not a.get("symmetric", True):
        raise NotImplementedError(f"{where}: asymmetric INT8 activations are not supported")
    return Int8Scheme("token")


class CompressedTensorsInt8Config(CompressedTensorsFp8Config):
    """compressed-tensors `int-quantized` W8A8 INT8 checkpoints (config groups by `targets`, plus `ignore`)."""

    @classmethod
    def from_hf(cls, qc: Mapping) -> "CompressedTensorsInt8Config":
        return cls.from_groups(qc, _int8_scheme)

    def for_layer(self, prefix: str):
        scheme = super().for_layer(prefix)
        if scheme is not None and prefix.rpartition(".")[2] == "experts":
            raise NotImplementedError(f"{prefix}: INT8 MoE experts are not supported (dense linear layers only)")
        return scheme
