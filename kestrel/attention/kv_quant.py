"""The FP8 KV cache (`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2`, vLLM's spellings): full-attention and sliding-
window layers keep K and V as float8 with one scale per tensor (per layer, K and V apart), half the bytes of a bf16
cache, so the same memory holds twice the tokens.

A cache value is `clamp(x / scale, -max, max)` rounded to the float8 dtype; attention reads `value * scale`. Scales
come from the checkpoint (`self_attn.k_scale` / `v_scale`, as FP8 checkpoints for vLLM carry them), or from the
first real batch's keys and values with `--calculate-kv-scales`, else 1.0. Each attention layer keeps its two
scales as float32 scalar tensors that the kernels read through a pointer, so a scale set after CUDA-graph capture
is what the graphs read.

The KV spec's dtype is the cache dtype: the runner re-types the layers' specs here before grouping them, so the
pool sizing, the allocation and the managers follow from the spec alone. MLA latents are not quantised (refused at
start-up)."""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from kestrel.core.kv_spec import FullAttentionSpec, KVCacheSpec
from kestrel.errors import ConfigError

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# --calculate-kv-scales maps CALIBRATION_HEADROOM x the first batch's largest |value| to the float8 maximum: later
# tokens may exceed the first prompt's range (beyond it values saturate at the maximum).
CALIBRATION_HEADROOM = 2.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    """x / scale, saturated to the dtype's range, rounded to `dtype` (the cache write's contract)."""
    m = fp8_max(dtype)
    return (x.float() / scale).clamp(-m, m).to(dtype)


def dequantize(x: torch.Tensor, scale) -> torch.Tensor:
    """A float8 cache's values as float32 (a cache of another dtype: as float32, unscaled)."""
    return x.float() * scale if is_fp8(x.dtype) else x.float()


def resolve_cache_dtype(name: str) -> torch.dtype | None:
    """--kv-cache-dtype -> the cache's float8 dtype; None for auto (the model's dtype)."""
    if name == "auto":
        return None
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype {name}: expected auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def specs_with_cache_dtype(specs: dict[str, KVCacheSpec], name: str) -> dict[str, KVCacheSpec]:
    """The layers' specs with full-attention / sliding-window pages in the --kv-cache-dtype. Kinds whose pages
    are not K/V (MLA latents, ...) are refused with a ConfigError naming the layer; kinds without pages (per-request
    state slots) keep their dtype."""
    dtype = resolve_cache_dtype(name)
    if dtype is None:
        return specs
    out = {}
    for layer, spec in specs.items():
        if isinstance(spec, FullAttentionSpec):
            out[layer] = replace(spec, dtype=dtype)
        elif spec.page_parts():
            raise ConfigError(f"--kv-cache-dtype {name}: an FP8 cache of {type(spec).__name__} pages (layer "
                              f"{layer}) is not implemented; only full-attention and sliding-window K/V are "
                              "quantised. Use --kv-cache-dtype auto")
        else:
            out[layer] = spec
    return out


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The per-tensor scale for values up to `amax` (float32 scalar tensor); 1.0 where amax is 0."""
    scale = amax.float() * CALIBRATION_HEADROOM / fp8_max(dtype)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def calibrate(layer, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, num_tokens: int,
              dtype: torch.dtype) -> bool:
    """--calculate-kv-scales for one layer: its k/v scales from the tokens of this batch that are written to the
    cache (slot >= 0; warm-up batches write none). False (nothing set) for a batch without such tokens."""
    real = slot_mapping[:num_tokens] >= 0
    if not bool(real.any()):
        return False
    layer.k_scale.copy_(scale_from_amax(k[:num_tokens][real].abs().amax(), dtype))
    layer.v_scale.copy_(scale_from_amax(v[:num_tokens][real].abs().amax(), dtype))
    return True


# Checkpoint names of per-tensor KV scales, as FP8 checkpoints for vLLM write them (llm-compressor: the attention
# module's k_scale / v_scale; older AutoFP8: k_proj / v_proj .output_scale, or one kv_scale for both).
_SCALE_SUFFIXES = {".k_scale": ("k_scale",), ".v_scale": ("v_scale",), ".kv_scale": ("k_scale", "v_scale"),
                   ".k_proj.output_scale": ("k_scale",), ".v_proj.output_scale": ("v_scale",)}


def checkpoint_kv_scale(name: str) -> tuple[str, tuple[str, ...]] | None:
    """`model.layers.3.self_attn.k_scale` -> ("model.layers.3.self_attn", ("k_scale",)): the module holding the
    attention layer and which of its scales the tensor sets; None for other tensors."""
    for suffix, which in _SCALE_SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], which
    return None


def load_checkpoint_kv_scale(attn_parent: torch.nn.Module, name: str, which: tuple[str, ...],
                             tensor: torch.Tensor) -> None:
    """Set the scales of the attention layer under `attn_parent` (its `attn` child) from a checkpoint tensor."""
    attn = getattr(attn_parent, "attn", None)
    if attn is None or not hasattr(attn, "k_scale"):
        logger.warning("%s: no attention layer with KV scales there; ignored", name)
        return
    value = tensor.float().reshape(-1)
    if value.numel() != 1:
        raise ValueError(f"{name}: a per-tensor KV scale has one value, got shape {tuple(tensor.shape)}")
    for attr in which:
        getattr(attn, attr).fill_(float(value[0]))
