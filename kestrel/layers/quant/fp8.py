"""FP8 (W8A8) quantization configs: what a checkpoint holds, per layer.

Three sources map onto one per-layer description, `Fp8Scheme`:

* HF / DeepSeek block-wise (`quant_method: "fp8"`, `weight_block_size: [128, 128]`): tensors `weight`
  (float8_e4m3fn [out, in]) and `weight_scale_inv` (fp32 [ceil(out/128), ceil(in/128)]); activations are quantized
  dynamically per token and per group of 128 columns. Without `weight_block_size` the same method means one
  per-tensor `weight_scale` (plus `input_scale` when `activation_scheme` is "static").
* compressed-tensors (`quant_method: "compressed-tensors"`, `format: "float-quantized"`): `weight` plus
  `weight_scale` ([1] per tensor, [out, 1] per channel, or a block grid), optional static `input_scale` [1].
* quantize-on-load (`quantization="fp8"` on an unquantized checkpoint): per-channel FP8 weights (amax / 448 per
  output row) computed in `process_weights_after_loading`, dynamic per-token activation scales.

Merged layers (q/k/v, gate/up) load one scale per shard (shard ids 0..n-1, in the order of PACKED_MODULES).
Per-tensor scales are kept per shard while loading. After loading, when the shards' scales differ,
torch_scaled_mm expands each shard's scale over its rows and runs the row-wise GEMM (exact) where the platform has
one, and otherwise requantizes every shard to the largest scale (the usual max rule, lossy by one FP8 rounding);
the dequant fallback uses the per-shard scales directly. Static `input_scale` of merged shards reduces to their
max. Block-wise scale grids of shards are stacked in shard order (exact for any shard size).
"""
from __future__ import annotations

import re
from typing import ClassVar, Iterable, Mapping, Sequence

# Fused module name -> the checkpoint names of its shards, in shard-id order.
PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

from kestrel.kernels.fp8_scheme import ACTIVATION_GRANULARITIES, WEIGHT_GRANULARITIES, Fp8Scheme  # noqa: E402,F401


def _name_matches(prefix: str, pattern: str) -> bool:
    """compressed-tensors style `re:<regex>` (re.match), or a module path matched on whole dotted components."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], prefix) is not None
    return f".{pattern}." in f".{prefix}." or prefix == pattern


def shard_prefixes(prefix: str, packed: Mapping[str, Sequence[str]] = PACKED_MODULES) -> list[str]:
    """'...self_attn.qkv_proj' -> ['...self_attn.q_proj', '...k_proj', '...v_proj']; other names map to themselves."""
    head, _, last = prefix.rpartition(".")
    if last in packed:
        return [f"{head}.{s}" if head else s for s in packed[last]]
    return [prefix]


class QuantConfigBase:
    """A model-wide quantization config. `for_layer(prefix)` returns the layer's scheme, or None (unquantized)."""

    name: ClassVar[str] = ""

    def __init__(self, ignore: Iterable[str] = (), packed_modules: Mapping[str, Sequence[str]] | None = None):
        self.ignore = tuple(ignore)
        self.packed_modules = dict(PACKED_MODULES if packed_modules is None else packed_modules)

    def _scheme_for_module(self, prefix: str) -> Fp8Scheme | None:
        raise NotImplementedError

    def is_ignored(self, prefix: str) -> bool:
        return any(_name_matches(prefix, p) for p in self.ignore)

    def for_layer(self, prefix: str) -> Fp8Scheme | None:
        if prefix.rpartition(".")[2] in ("lm_head", "embed_tokens"):
            return None  # never quantized
        shards = shard_prefixes(prefix, self.packed_modules)
        schemes = [None if self.is_ignored(p) else self._scheme_for_module(p) for p in shards]
        if any(s != schemes[0] for s in schemes):
            detail = ", ".join(f"{p}: {s.name if s else 'unquantized'}" for p, s in zip(shards, schemes))
            raise ValueError(f"merged layer {prefix} mixes quantization schemes across its shards ({detail})")
        return schemes[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ignore={list(self.ignore)})"


class Fp8Config(QuantConfigBase):
    """HF `quant_method: "fp8"` checkpoints (block-wise or per-tensor) and quantize-on-load."""

    name = "fp8"

    def __init__(self, scheme: Fp8Scheme, ignore: Iterable[str] = (), packed_modules=None):
        super().__init__(ignore, packed_modules)
        self.scheme = scheme

    def _scheme_for_module(self, prefix: str) -> Fp8Scheme | None:
        return self.scheme

    @classmethod
    def from_hf(cls, qc: Mapping) -> "Fp8Config":
        act = qc.get("activation_scheme", "dynamic")
        if act not in ("dynamic", "static"):
            raise ValueError(f"fp8 checkpoint: unknown activation_scheme {act!r}")
        fmt = qc.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise NotImplementedError(f"fp8 checkpoint: only e4m3 weights are supported (got fmt={fmt!r})")
        block = qc.get("weight_block_size")
        ignore = list(qc.get("modules_to_not_convert") or []) + list(qc.get("ignored_layers") or [])
        if block is not None:
            if act != "dynamic":
                raise NotImplementedError("fp8 checkpoint: block-wise weights need activation_scheme 'dynamic'")
            bn, bk = (int(b) for b in block)
            scheme = Fp8Scheme("block", "group", True, (bn, bk), bk, True, "weight_scale_inv", "fp8")
        else:
            scheme = Fp8Scheme("tensor", "tensor", act == "dynamic", None, None, True, "weight_scale", "fp8")
        return cls(scheme, ignore)

    @classmethod
    def online(cls, ignore: Iterable[str] = ()) -> "Fp8Config":
        return cls(Fp8Scheme("channel", "token", True, None, None, False, "weight_scale", "online"), ignore)

    def __repr__(self) -> str:
        return f"Fp8Config({self.scheme.name}, ignore={list(self.ignore)})"


class CompressedTensorsFp8Config(QuantConfigBase):
    """compressed-tensors `float-quantized` FP8 checkpoints: config groups matched by `targets`, plus `ignore`."""

    name = "compressed-tensors"

    def __init__(self, groups: list[tuple[tuple[str, ...], Fp8Scheme]], ignore: Iterable[str] = (), packed_modules=None):
        super().__init__(ignore, packed_modules)
        self.groups = groups

    def _scheme_for_module(self, prefix: str) -> Fp8Scheme | None:
        for targets, scheme in self.groups:
            # "Linear" (the class name) targets every linear layer; other targets are names or re: patterns.
            if any(t == "Linear" or _name_matches(prefix, t) for t in targets):
                return scheme
        return None

    @classmethod
    def from_hf(cls, qc: Mapping) -> "CompressedTensorsFp8Config":
        fmt = qc.get("format", "float-quantized")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise NotImplementedError(f"compressed-tensors format {fmt!r} is not supported (only FP8 float-quantized)")
        return cls.from_groups(qc, _ct_scheme)

    @classmethod
    def from_groups(cls, qc: Mapping, scheme_of):
        """The config of `qc`'s config groups, each group's scheme from `scheme_of(group name, group)`."""
        groups = [(tuple(g.get("targets") or ["Linear"]), scheme_of(name, g))
                  for name, g in (qc.get("config_groups") or {}).items()]
        if not groups:
            raise ValueError("compressed-tensors config has no config_groups")
        return cls(groups, qc.get("ignore") or [])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({[(t, s.name) for t, s in self.groups]}, ignore={list(self.ignore)})"


def _ct_scheme(gname: str, group: Mapping) -> Fp8Scheme:
    w = group.get("weights") or {}
    where = f"compressed-tensors group {gname!r}"
    if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
        raise NotImplementedError(f"{where}: only 8-bit float weights are supported (got {w.get('type')}/{w.get('num_bits')})")
    if not w.get("symmetric", True):
        raise NotImplementedError(f"{where}: asymmetric FP8 weights are not supported")
    if w.get("dynamic"):
        raise NotImplementedError(f"{where}: dynamic weight quantization is not supported")
    strategy = w.get("strategy", "tensor")
    block = None
    if strategy == "block":
        bs = w.get("block_structure")
        if isinstance(bs, str):  # older releases wrote "128x128"
            bs = [int(v) for v in bs.lower().split("x")]
        if not bs or len(bs) != 2:
            raise ValueError(f"{where}: block strategy needs block_structure [n, k]")
        block = (int(bs[0]), int(bs[1]))
    elif strategy not in ("tensor", "channel"):
        raise NotImplementedError(f"{where}: weight strategy {strategy!r} is not supported")

    a = group.get("input_activations")
    if a is None:
        act, dynamic, gsize = None, True, None
    else:
        if a.get("type", "float") != "float" or int(a.get("num_bits", 8)) != 8:
            raise NotImplementedError(f"{where}: only 8-bit float activations are supported")
        act, dynamic = a.get("strategy", "tensor"), bool(a.get("dynamic", False))
        gsize = int(a["group_size"]) if act == "group" and a.get("group_size") else None
        if act == "group" and gsize is None and block is not None:
            gsize = block[1]
        if act not in ("tensor", "token", "group"):
            raise NotImplementedError(f"{where}: activation strategy {act!r} is not supported")
        if act != "tensor" and not dynamic:
            raise NotImplementedError(f"{where}: static activation scales must be per tensor (got {act!r})")
    return Fp8Scheme(
        "block" if block else strategy, act, dynamic, block, gsize, True, "weight_scale", "compressed-tensors"
    )
