"""INT4 experts in compressed-tensors' pack-quantized format (Kimi K2-Thinking / K2.5 / K2.6): our unpacking and
dequantisation bit-equal to compressed-tensors' own on random blocks, the checkpoint's quantization_config read
as Kimi writes it (only the routed experts quantized), what we do not support refused by name, and the kernel
each platform selects."""
from __future__ import annotations

import copy

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from kestrel import kernels
from kestrel.kernels.int4_scheme import Int4Scheme, dequantize_int4, unpack_int4
from kestrel.kernels.moe import MoESpec
from kestrel.kernels.moe_int4 import Int4DequantMoE, TritonInt4DequantMoE
from kestrel.kernels.w4a16_scheme import W4A16Scheme
from kestrel.layers.quant import CompressedTensorsInt4Config, get_quant_config
from kestrel.platform import fake_platform
from tests.int4_tiny import KIMI_QUANTIZATION_CONFIG, compress, decompress, quantize_int4



@pytest.mark.parametrize("rows, cols", [(1, 8), (5, 64), (64, 256), (33, 7168 // 32 * 8)])
def test_unpack_bit_equal_to_compressed_tensors(rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    q = torch.randint(-8, 8, (rows, cols), dtype=torch.int8, generator=g)
    packed = pack_to_int32(q, 4)
    assert packed.dtype == torch.int32 and packed.shape == (rows, cols // 8)
    mine = unpack_int4(packed, cols)
    assert torch.equal(mine, unpack_from_int32(packed, 4, torch.Size((rows, cols))))
    assert torch.equal(mine, q)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seed", range(4))
def test_dequantize_bit_equal_to_compressed_tensors(scale_dtype, seed):
    """Random 4-bit blocks and random scales (wide range): our weights are compressed-tensors' decompression,
    bit for bit, in the scales' dtype; in float32 they are those values exactly."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = 48, 256
    q = torch.randint(-8, 8, (rows, cols), dtype=torch.int8, generator=g)
    scale = (torch.rand(rows, cols // 32, generator=g) * 2.0 ** torch.randint(-12, 4, (rows, cols // 32),
                                                                              generator=g)).to(scale_dtype)
    tensors = {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale, "weight_shape": torch.tensor([rows, cols])}
    theirs = decompress(tensors)
    mine = dequantize_int4(tensors["weight_packed"], scale, cols, 32, scale_dtype)
    assert mine.dtype == theirs.dtype == scale_dtype and torch.equal(_bits(mine), _bits(theirs))
    assert torch.equal(dequantize_int4(tensors["weight_packed"], scale, cols, 32, torch.float32), theirs.float())


def test_quantize_round_trip_is_compressed_tensors_format():
    """tests/int4_tiny.py's writer: its tensors decompress (compressed-tensors) to q * scale."""
    w = torch.randn(32, 64) * 0.08
    q, scale = quantize_int4(w)
    t = compress(w)
    assert t["weight_shape"].tolist() == [32, 64] and t["weight_scale"].dtype == torch.bfloat16
    assert torch.equal(decompress(t), (q.to(torch.bfloat16) * scale.repeat_interleave(32, -1)))
    assert (decompress(t).float() - w).abs().max() <= scale.float().max() / 2 + 1e-6


def test_kimi_quantization_config():
    cfg = get_quant_config({"quantization_config": KIMI_QUANTIZATION_CONFIG}, params_dtype=torch.float32)
    assert isinstance(cfg, CompressedTensorsInt4Config)
    assert cfg.for_layer("model.layers.3.mlp.experts") == Int4Scheme(32)
    assert cfg.for_layer("language_model.model.layers.3.mlp.experts").name == "int4_w4a16_g32"
    for unquantized in ("model.layers.3.self_attn.q_a_proj", "model.layers.3.mlp.shared_experts.gate_up_proj",
                        "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj", "lm_head"):
        assert cfg.for_layer(unquantized) is None, unquantized
    # a quantized linear layer elsewhere: the W4A16 linear kernels (kestrel/kernels/w4a16.py)
    assert cfg.for_layer("model.layers.3.mlp.router_proj") == W4A16Scheme("compressed-tensors", 32)


@pytest.mark.parametrize("change, message", [
    (dict(actorder="bogus"), "activation ordering 'bogus'"),
    (dict(num_bits=8), "4-bit int"),
    (dict(strategy="tensor", group_size=None), "group-wise or channel-wise"),
    (dict(dynamic=True), "dynamic"),
])
def test_unsupported_int4_variants_refused(change, message):
    qc = copy.deepcopy(KIMI_QUANTIZATION_CONFIG)
    qc["config_groups"]["group_0"]["weights"].update(change)
    with pytest.raises(NotImplementedError, match=message):
        get_quant_config({"quantization_config": qc})


def test_asymmetric_int4_experts_refused():
    """Asymmetric pack-quantized weights read for linear layers (a zero point), not for routed experts."""
    qc = copy.deepcopy(KIMI_QUANTIZATION_CONFIG)
    qc["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with pytest.raises(NotImplementedError, match="asymmetric INT4 experts"):
        get_quant_config({"quantization_config": qc}).for_layer("model.layers.3.mlp.experts")
    qc = copy.deepcopy(KIMI_QUANTIZATION_CONFIG)
    qc["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    with pytest.raises(NotImplementedError, match="INT4 experts with activation ordering"):
        get_quant_config({"quantization_config": qc}).for_layer("model.layers.3.mlp.experts")


def test_unknown_compressed_tensors_format_and_mismatched_method_refused():
    with pytest.raises(NotImplementedError, match="'marlin-24'"):
        get_quant_config({"quantization_config": {**KIMI_QUANTIZATION_CONFIG, "format": "marlin-24"}})
    with pytest.raises(ValueError, match="does not match"):
        get_quant_config({"quantization_config": KIMI_QUANTIZATION_CONFIG}, quantization="fp8")


def _spec(hidden=64, inter=64, dtype=torch.float32):
    return MoESpec("model.layers.1.mlp.experts", 8, 2, hidden, inter, dtype, "silu", Int4Scheme(32))


def test_selection():
    cpu = fake_platform("cpu")
    kernel = kernels.select("moe", _spec(), "auto", cpu)
    assert type(kernel) is Int4DequantMoE
    assert any(s.startswith("triton_int4_dequant_moe: ") for s in kernel.skipped)
    assert TritonInt4DequantMoE.check(_spec(dtype=torch.bfloat16), fake_platform("sm_90")) == (True, "")
    ok, why = Int4DequantMoE.can_implement(_spec(inter=48))
    assert not ok and "multiple of the INT4 group 32" in why
    with pytest.raises(kernels.KernelSelectionError, match="model.layers.1.mlp.experts"):
        kernels.select("moe", _spec(), "torch_moe", cpu)  # a dense kernel forced onto INT4 experts


def test_checkpoint_shape_checked():
    """A weight_shape that disagrees with the layer is an error naming the layer, not a silent reshape."""
    from kestrel.layers.moe.layer import FusedExperts

    layer = FusedExperts(_spec(), "auto", fake_platform("cpu"))
    t = compress(torch.randn(64, 64))
    layer.kernel.load_expert(layer, "w13_packed", 0, 0, t["weight_packed"])
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.w13_shape\[expert 0, shard 0\]"):
        layer.kernel.load_expert(layer, "w13_shape", 0, 0, torch.tensor([64, 128]))


def test_tensor_parallel_refused_by_name():
    """A rank's slice of packed columns and group scales is not loaded yet: a clear error, not a shape mismatch."""
    from kestrel.distributed import ParallelInfo
    from kestrel.layers.moe import SparseMoeBlock
    from kestrel.layers.moe.router import RouterConfig

    cfg = get_quant_config({"quantization_config": KIMI_QUANTIZATION_CONFIG}, params_dtype=torch.float32)
    kw = dict(prefix="model.layers.1.mlp", hidden_size=64, moe_intermediate_size=64,
              router=RouterConfig(num_experts=8, top_k=2), dtype=torch.float32, quant_config=cfg,
              platform=fake_platform("cpu"))
    assert type(SparseMoeBlock(**kw).experts.kernel) is Int4DequantMoE
    with pytest.raises(NotImplementedError, match="model.layers.1.mlp: int4_dequant_moe experts cannot be split "
                                                  "across 2 tensor-parallel ranks"):
        SparseMoeBlock(**kw, tp=ParallelInfo(rank=0, size=2))
