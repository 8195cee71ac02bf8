from __future__ import annotations

import pytest
import torch

from kestrel import kernels
from kestrel.layers.quant import get_quant_config
from kestrel.platform import set_platform_for_testing


@pytest.fixture(autouse=True)
def _clean_state():
    kernels.reset_selection_log()
    yield
    set_platform_for_testing(None)


# The four FP8 schemes of issue 6, as the model loader would resolve them from config.json.
HF_BLOCK = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}


def ct_config(weights: str, acts: str | None) -> dict:
    w = {"num_bits": 8, "type": "float", "strategy": weights, "symmetric": True, "dynamic": False}
    a = None
    if acts == "tensor_static":
        a = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    elif acts == "token":
        a = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    group = {"targets": ["Linear"], "weights": w, "input_activations": a}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                    "config_groups": {"group_0": group}, "ignore": ["lm_head"]}}


SCHEME_CONFIGS = {
    "block": (HF_BLOCK, None),
    "per_tensor_static": (ct_config("tensor", "tensor_static"), None),
    "per_channel_token": (ct_config("channel", "token"), None),
    "on_load": ({}, "fp8"),
}


def quant_config_for(scheme: str, dtype=torch.bfloat16):
    cfg, quantization = SCHEME_CONFIGS[scheme]
    return get_quant_config(cfg, quantization, dtype)
