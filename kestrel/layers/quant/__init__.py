"""Quantization configs. (FP8 lands with the kernel-selection work; until then only dense weights.)"""
from __future__ import annotations


def get_quant_config(hf_config: dict, quantization: str | None, params_dtype):
    qc = hf_config.get("quantization_config")
    if qc is None and quantization is None:
        return None
    raise NotImplementedError(f"quantization {quantization or qc.get('quant_method')!r} is not supported yet")
