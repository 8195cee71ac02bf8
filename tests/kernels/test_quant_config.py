"""get_quant_config: checkpoint formats, ignore lists and packed (merged) layers."""
from __future__ import annotations

import pytest
import torch

from kestrel.layers.quant import CompressedTensorsFp8Config, Fp8Config, Fp8Scheme, get_quant_config

from tests.kernels.conftest import HF_BLOCK, ct_config


def test_hf_block_config():
    cfg = get_quant_config(HF_BLOCK, None, torch.bfloat16)
    assert isinstance(cfg, Fp8Config)
    s = cfg.for_layer("model.layers.0.self_attn.qkv_proj")
    assert s == Fp8Scheme("block", "group", True, (128, 128), 128, True, "weight_scale_inv", "fp8")
    assert cfg.for_layer("lm_head") is None and cfg.for_layer("model.embed_tokens") is None
    assert get_quant_config(HF_BLOCK, "fp8", torch.bfloat16).for_layer("x.down_proj") == s


def test_hf_ignore_lists():
    qc = dict(HF_BLOCK["quantization_config"], modules_to_not_convert=["model.layers.1.mlp", "lm_head"],
              ignored_layers=["model.layers.0.self_attn.o_proj"])
    cfg = get_quant_config({"quantization_config": qc}, None, torch.bfloat16)
    assert cfg.for_layer("model.layers.1.mlp.down_proj") is None
    assert cfg.for_layer("model.layers.1.mlp.gate_up_proj") is None
    assert cfg.for_layer("model.layers.0.self_attn.o_proj") is None
    assert cfg.for_layer("model.layers.0.mlp.down_proj") is not None
    assert cfg.for_layer("model.layers.11.mlp.down_proj") is not None  # components, not substrings


def test_hf_per_tensor_static():
    cfg = get_quant_config({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, None, torch.float16)
    s = cfg.for_layer("model.layers.0.mlp.down_proj")
    assert (s.weight, s.activation, s.activation_dynamic, s.has_input_scale) == ("tensor", "tensor", False, True)


def test_compressed_tensors_schemes():
    s = get_quant_config(ct_config("tensor", "tensor_static"), None, torch.bfloat16).for_layer("m.layers.0.mlp.up_proj")
    assert (s.weight, s.activation, s.has_input_scale, s.weight_scale_name) == ("tensor", "tensor", True, "weight_scale")
    s = get_quant_config(ct_config("channel", "token"), "fp8", torch.bfloat16).for_layer("m.layers.0.mlp.up_proj")
    assert (s.weight, s.activation, s.activation_dynamic, s.needs_rowwise) == ("channel", "token", True, True)
    s = get_quant_config(ct_config("channel", None), None, torch.bfloat16).for_layer("m.layers.0.mlp.up_proj")
    assert s.activation is None
    blk = ct_config("block", None)
    g = blk["quantization_config"]["config_groups"]["group_0"]
    g["weights"]["block_structure"] = [128, 128]
    g["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True}
    s = get_quant_config(blk, "compressed-tensors", torch.bfloat16).for_layer("m.layers.0.mlp.up_proj")
    assert (s.weight, s.block_size, s.activation, s.group_size, s.weight_scale_name) == ("block", (128, 128), "group", 128, "weight_scale")


def test_compressed_tensors_ignore_and_targets():
    c = ct_config("channel", "token")
    qc = c["quantization_config"]
    qc["ignore"] = ["lm_head", "re:.*layers\\.1\\..*", "model.layers.0.mlp.down_proj"]
    cfg = get_quant_config(c, None, torch.bfloat16)
    assert isinstance(cfg, CompressedTensorsFp8Config)
    assert cfg.for_layer("model.layers.1.self_attn.qkv_proj") is None
    assert cfg.for_layer("model.layers.0.mlp.down_proj") is None
    assert cfg.for_layer("model.layers.0.mlp.gate_up_proj") is not None
    qc["ignore"] = []
    qc["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*"]
    cfg = get_quant_config(c, None, torch.bfloat16)
    assert cfg.for_layer("model.layers.0.self_attn.o_proj") is not None
    assert cfg.for_layer("model.layers.0.mlp.down_proj") is None  # not targeted: stays dense


def test_merged_layer_with_mixed_shards_raises():
    c = ct_config("channel", "token")
    c["quantization_config"]["ignore"] = ["model.layers.0.self_attn.q_proj"]
    cfg = get_quant_config(c, None, torch.bfloat16)
    with pytest.raises(ValueError, match="qkv_proj mixes quantization schemes"):
        cfg.for_layer("model.layers.0.self_attn.qkv_proj")
    c["quantization_config"]["ignore"] = ["re:.*self_attn\\.[qkv]_proj"]
    assert get_quant_config(c, None, torch.bfloat16).for_layer("model.layers.0.self_attn.qkv_proj") is None


def test_requested_vs_checkpoint_quantization():
    assert get_quant_config({"hidden_size": 64}, None, torch.bfloat16) is None
    online = get_quant_config({"hidden_size": 64}, "fp8", torch.bfloat16)
    s = online.for_layer("model.layers.0.mlp.down_proj")
    assert (s.weight, s.activation, s.serialized, s.source) == ("channel", "token", False, "online")
    assert online.for_layer("lm_head") is None
    with pytest.raises(ValueError, match="no quantization_config"):
        get_quant_config({}, "compressed-tensors", torch.bfloat16)
    with pytest.raises(ValueError, match="unsupported quantization 'bitsandbytes'"):
        get_quant_config({}, "bitsandbytes", torch.bfloat16)
    with pytest.raises(NotImplementedError, match="'hqq'"):
        get_quant_config({"quantization_config": {"quant_method": "hqq"}}, None, torch.bfloat16)
    with pytest.raises(ValueError, match="does not match"):
        get_quant_config(HF_BLOCK, "compressed-tensors", torch.bfloat16)
    int8 = ct_config("channel", "token")
    int8["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "int"
    with pytest.raises(NotImplementedError, match="8-bit float"):
        get_quant_config(int8, None, torch.bfloat16)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        get_quant_config(HF_BLOCK, None, torch.int8)


def test_accepts_a_pretrained_config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, quantization_config=HF_BLOCK["quantization_config"])
    assert isinstance(get_quant_config(cfg, None, torch.bfloat16), Fp8Config)
