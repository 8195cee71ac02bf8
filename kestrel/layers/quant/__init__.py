"""Quantization configs. The model loader calls `get_quant_config` once per model and passes the result to every
`Linear` (as `quant_config`); each Linear asks `quant_config.for_layer(prefix)` for its own scheme (None means the
layer stays unquantized: ignored modules, lm_head, embeddings)."""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch

from kestrel.layers.quant.fp8 import (
    PACKED_MODULES,
    CompressedTensorsFp8Config,
    Fp8Config,
    Fp8Scheme,
    QuantConfigBase,
    shard_prefixes,
)
from kestrel.layers.quant.gptq_awq import AWQConfig, CompressedTensorsInt8Config, GPTQConfig
from kestrel.layers.quant.int4 import CompressedTensorsInt4Config, Int4Scheme
from kestrel.layers.quant.mxfp4 import Mxfp4Config

QuantConfig = QuantConfigBase
logger = logging.getLogger(__name__)

# `--quantization` names, as vLLM's; the checkpoint's quant_method -> its config class
SUPPORTED_QUANTIZATION = ("fp8", "compressed-tensors", "gptq", "awq", "gptq_marlin", "awq_marlin", "mxfp4")
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}  # the same formats; here served by our own kernels
# MXFP4: gpt-oss's experts alone are quantized
CHECKPOINT_METHODS = {"gptq": GPTQConfig, "awq": AWQConfig, "mxfp4": Mxfp4Config}
# compressed-tensors `format` -> its config (float-quantized: FP8; pack-quantized: 4-bit; int-quantized: W8A8 INT8)
COMPRESSED_TENSORS_FORMATS = {
    "float-quantized": CompressedTensorsFp8Config,
    "naive-quantized": CompressedTensorsFp8Config,
    "pack-quantized": CompressedTensorsInt4Config,
    "int-quantized": CompressedTensorsInt8Config,
}


def _as_dict(hf_config: Any) -> dict:
    if hf_config is None:
        return {}
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):  # a transformers PretrainedConfig
        return hf_config.to_dict()
    raise TypeError(f"hf_config must be a dict (config.json) or a PretrainedConfig, got {type(hf_config).__name__}")


def checkpoint_quant_config(hf_config: Any) -> dict | None:
    """The checkpoint's `quantization_config` (also found under `compression_config` or a nested text_config)."""
    cfg = _as_dict(hf_config)
    for key in ("quantization_config", "compression_config"):
        if cfg.get(key):
            return dict(cfg[key])
    text = cfg.get("text_config")
    if isinstance(text, Mapping) and text.get("quantization_config"):
        return dict(text["quantization_config"])
    return None


def get_quant_config(
    hf_config: Any,
    quantization: str | None = None,
    params_dtype: torch.dtype = torch.bfloat16,
    packed_modules: Mapping[str, tuple[str, ...]] | None = None,
) -> QuantConfig | None:
    """Resolve the model-wide quantization config.

    `quantization=None` follows the checkpoint (None for an unquantized one). `"fp8"` accepts an FP8 checkpoint
    (HF fp8 or compressed-tensors FP8) and, on an unquantized checkpoint, quantizes weights on load (per-channel
    weights, dynamic per-token activations). `"compressed-tensors"` requires such a checkpoint.
    `params_dtype` is the activation dtype the model runs in (validated here; kernels read it from LinearSpec).
    """
    if params_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quantized models run in bf16, fp16 or fp32 activations, not {params_dtype}")
    if quantization in ("", "auto", "none"):
        quantization = None
    if quantization is not None and quantization not in SUPPORTED_QUANTIZATION:
        raise ValueError(f"unsupported quantization {quantization!r}; choose one of {', '.join(SUPPORTED_QUANTIZATION)}")
    if quantization in ALIASES:
        logger.info("quantization %r: the %s format, served by Kestrel's own kernels", quantization,
                    ALIASES[quantization])
        quantization = ALIASES[quantization]
    qc = checkpoint_quant_config(hf_config)
    method = (qc or {}).get("quant_method")
    if qc is not None and method is None:
        raise ValueError("the checkpoint's quantization_config has no quant_method")

    if method is None:
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization={quantization!r} but the checkpoint has no quantization_config")
        if quantization is None:
            return None
        config = Fp8Config.online()  # quantization == "fp8" on an unquantized checkpoint
    elif method == "fp8":
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization={quantization!r} does not match the checkpoint's quant_method 'fp8'")
        config = Fp8Config.from_hf(qc)
    elif method == "compressed-tensors":
        fmt = qc.get("format", "float-quantized")
        if fmt not in COMPRESSED_TENSORS_FORMATS:
            raise NotImplementedError(f"compressed-tensors format {fmt!r} is not supported (supported: "
                                      f"{', '.join(COMPRESSED_TENSORS_FORMATS)})")
        config_cls = COMPRESSED_TENSORS_FORMATS[fmt]
        weight_types = {(g.get("weights") or {}).get("type") for g in (qc.get("config_groups") or {}).values()}
        if fmt == "naive-quantized" and weight_types == {"int"}:  # unpacked int8 weights: as int-quantized
            config_cls = CompressedTensorsInt8Config
        if quantization not in (None, "compressed-tensors") and not (
                quantization == "fp8" and config_cls is CompressedTensorsFp8Config):
            raise ValueError(f"quantization={quantization!r} does not match the checkpoint's compressed-tensors "
                             f"format {fmt!r}")
        config = config_cls.from_hf(qc)
    elif method in CHECKPOINT_METHODS:
        if quantization not in (None, method):
            raise ValueError(f"quantization={quantization!r} does not match the checkpoint's quant_method {method!r}")
        config = CHECKPOINT_METHODS[method].from_hf(qc)
    else:
        raise NotImplementedError(
            f"checkpoint quant_method {method!r} is not supported (supported: fp8, compressed-tensors, gptq, awq, mxfp4)"
        )
    if packed_modules is not None:
        config.packed_modules = dict(packed_modules)
    return config


__all__ = [
    "PACKED_MODULES",
    "CompressedTensorsFp8Config",
    "AWQConfig",
    "CompressedTensorsInt4Config",
    "CompressedTensorsInt8Config",
    "GPTQConfig",
    "Fp8Config",
    "Fp8Scheme",
    "Int4Scheme",
    "Mxfp4Config",
    "QuantConfig",
    "checkpoint_quant_config",
    "get_quant_config",
    "shard_prefixes",
]
