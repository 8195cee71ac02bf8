"""MXFP4 expert weights: dequantisation bit-equal to transformers' own (its gpt-oss loader's
convert_moe_packed_tensors) on random blocks and scales, the quantiser the test checkpoints use, the kernel's
selection, and the checkpoint's quantization_config."""
from __future__ import annotations

import pytest
import torch

from kestrel.kernels import KernelSelectionError, select
from kestrel.kernels.moe import MoESpec
from kestrel.kernels.moe import TritonFusedMoE
from kestrel.kernels.mxfp4 import (Mxfp4DequantMoE, Mxfp4Scheme, TritonMxfp4DequantMoE, dequantize_mxfp4,
                                   quantize_mxfp4)
from kestrel.platform import fake_platform
from kestrel.layers.quant import Mxfp4Config, get_quant_config
from tests.tiny import GPT_OSS_MXFP4


def _random_blocks(gen, experts=3, rows=40, groups=4):
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 255, (experts, rows, groups), generator=gen, dtype=torch.uint8)  # 255 is NaN
    return blocks, scales


@pytest.mark.parametrize("seed", [0, 1])
def test_dequantisation_is_bit_equal_to_transformers(seed):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_blocks(torch.Generator().manual_seed(seed))
    theirs = convert_moe_packed_tensors(blocks, scales)  # bf16 [E, in, out]: their layer's layout
    ours = dequantize_mxfp4(blocks, scales, torch.bfloat16)  # [E, out, in]
    assert theirs.dtype == torch.bfloat16 and ours.shape == (3, 40, 128)
    assert torch.equal(ours.view(torch.int16), theirs.transpose(1, 2).contiguous().view(torch.int16))
    ours32 = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(ours32.view(torch.int32), theirs.float().transpose(1, 2).contiguous().view(torch.int32))
    assert torch.isinf(ours32).any() and (ours32 == 0).any()  # the range's ends are among the values


def test_dequantisation_reads_the_low_nibble_first():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x2F  # low nibble 0xF (-6), high nibble 0x2 (1.0)
    out = dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8), torch.float32)  # scale 2
    assert out[:2].tolist() == [-12.0, 2.0] and not out[2:].any()


def test_dequantisation_refuses_mismatched_tensors():
    blocks, scales = _random_blocks(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :-1], torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.int(), scales, torch.float32)


def test_quantiser_round_trip():
    w = torch.randn(5, 64, 96, generator=torch.Generator().manual_seed(2)) * 0.1
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (5, 64, 3, 16) and scales.shape == (5, 64, 3)
    back = dequantize_mxfp4(blocks, scales, torch.float32)
    assert (back - w).abs().max() <= w.abs().amax() / 6  # half an e2m1 step at the top of each block, or less
    assert ((back - w).norm() / w.norm()).item() < 0.15
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(back), torch.float32), back)  # representable: exact


def _spec(**kw):
    base = dict(layer_name="model.layers.0.mlp.experts", num_experts=4, top_k=2, hidden_size=64,
                intermediate_size=32, params_dtype=torch.float32, activation="swigluoai", quant=Mxfp4Scheme(),
                bias=True)
    return MoESpec(**{**base, **kw})


def test_selection():
    assert type(select("moe", _spec(), platform=fake_platform("cpu"))) is Mxfp4DequantMoE
    sm90 = fake_platform("sm_90")
    assert type(select("moe", _spec(params_dtype=torch.bfloat16), platform=sm90)) is TritonMxfp4DequantMoE
    assert type(select("moe", _spec(), platform=sm90)) is Mxfp4DequantMoE  # float32: not the Triton MoE's
    # gpt-oss's dense experts (biases, swigluoai) take the Triton fused MoE
    assert type(select("moe", _spec(params_dtype=torch.bfloat16, quant=None), platform=sm90)) is TritonFusedMoE
    with pytest.raises(KernelSelectionError, match="not a multiple of the MXFP4 block 32"):
        select("moe", _spec(intermediate_size=48))
    ok, why = Mxfp4DequantMoE.can_implement(_spec(quant=None))
    assert not ok and "not MXFP4" in why


def test_kernel_dequantises_after_loading_and_drops_the_packed_tensors():
    from torch import nn

    kernel = select("moe", _spec())
    layer = nn.Module()
    kernel.create_weights(layer)
    assert layer.w13_blocks.shape == (4, 64, 2, 16) and layer.w2_scales.shape == (4, 64, 1)
    gen = torch.Generator().manual_seed(3)
    layer.w13_blocks.data.copy_(torch.randint(0, 256, layer.w13_blocks.shape, generator=gen, dtype=torch.uint8))
    layer.w13_scales.data.fill_(120)
    blocks, scales = layer.w13_blocks.clone(), layer.w13_scales.clone()
    kernel.process_weights_after_loading(layer)
    assert not hasattr(layer, "w13_blocks") and not hasattr(layer, "w2_scales")
    assert layer.w13.dtype == torch.float32 and layer.w13.shape == (4, 64, 64)
    assert torch.equal(layer.w13, dequantize_mxfp4(blocks, scales, torch.float32))


def test_quantization_config_covers_the_experts_only():
    qc = get_quant_config({"quantization_config": GPT_OSS_MXFP4}, None, torch.bfloat16)
    assert isinstance(qc, Mxfp4Config)
    assert isinstance(qc.for_layer("model.layers.3.mlp.experts"), Mxfp4Scheme)
    for prefix in ("model.layers.3.self_attn.qkv_proj", "model.layers.3.mlp.router", "lm_head",
                   "model.embed_tokens", "model.layers.3.self_attn.o_proj"):
        assert qc.for_layer(prefix) is None
    ignoring = Mxfp4Config.from_hf({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.1.mlp"]})
    assert ignoring.for_layer("model.layers.1.mlp.experts") is None
    assert ignoring.for_layer("model.layers.11.mlp.experts") is not None
    with pytest.raises(ValueError, match="does not match the checkpoint's quant_method 'mxfp4'"):
        get_quant_config({"quantization_config": GPT_OSS_MXFP4}, "fp8", torch.bfloat16)
    with pytest.raises(ValueError, match="no quantization_config"):
        get_quant_config({}, "mxfp4", torch.bfloat16)
