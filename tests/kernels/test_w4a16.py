"""Quantized dense linears (issue 54): the test packers against hand-computed words of the published layouts;
quant configs (GPTQ, AWQ, compressed-tensors W4A16 / W8A8 INT8) and their refusals; each format's tensors loaded
into a Linear (merged q/k/v shards included) dequantise bit for bit to the reference; kernel selection; the Triton
layout and the int8 GEMM path emulated on the CPU."""
from __future__ import annotations

import logging

import pytest
import torch

from kestrel.kernels import select
from kestrel.kernels.base import LinearSpec
from kestrel.kernels.int8 import Int8DequantFallbackLinear, Int8Scheme, TorchInt8MMLinear, quantize_per_token_int8
from kestrel.kernels.w4a16 import TritonW4A16Linear, W4A16DequantLinear, triton_layout
from kestrel.kernels.w4a16_scheme import W4A16Scheme, awq_unpack, pack_rows, unpack_rows
from kestrel.layers.linear import Linear
from kestrel.layers.quant import (AWQConfig, CompressedTensorsInt4Config, CompressedTensorsInt8Config, GPTQConfig,
                                  get_quant_config)
from kestrel.platform import fake_platform
from tests.w4a16_tiny import (awq_pack, ct_act_order, ct_compress, dequantize_4bit, gptq_groups, gptq_pack, quantization_config,
                              quantize_4bit)

QKV = "model.layers.0.self_attn.qkv_proj"


# ------------------------------------------------------------------------------------------------ packers
def test_gptq_packer_hand_computed():
    """u[n, k] = (n + k) % 16 on an 8 x 8 weight, zeros n % 16, one group: GPTQ packs K-major along each column's
    words (low nibble = first row), zeros minus one along N."""
    u = torch.tensor([[(n + k) % 16 for k in range(8)] for n in range(8)], dtype=torch.uint8)
    zeros = torch.arange(8).reshape(8, 1) + 1  # stored as zero - 1 = n
    t = gptq_pack(u, zeros, torch.ones(8, 1, dtype=torch.float16), torch.zeros(8, dtype=torch.int32))
    assert t["qweight"].shape == (1, 8) and t["qzeros"].shape == (1, 1)
    assert t["qweight"][0, 0].item() == 0x76543210
    assert t["qweight"][0, 1].item() == 0x87654321 - (1 << 32)  # column 1: 1..8 (negative as int32)
    assert t["qzeros"][0, 0].item() == 0x76543210


def test_awq_packer_hand_computed():
    """AWQ packs along N in the order (0, 2, 4, 6, 1, 3, 5, 7): word (k, 0) of u[c, k] = c + k."""
    u = torch.tensor([[(c + k) % 16 for k in range(2)] for c in range(8)], dtype=torch.uint8)
    zeros = torch.arange(8).reshape(8, 1)
    t = awq_pack(u, zeros, torch.ones(8, 1, dtype=torch.float16))
    assert t["qweight"].shape == (2, 1)
    assert t["qweight"][0, 0].item() == 0x75316420
    assert t["qweight"][1, 0].item() == 0x86427531 - (1 << 32)
    assert t["qzeros"][0, 0].item() == 0x75316420
    assert awq_unpack(t["qweight"]).tolist() == u.t().tolist()  # Kestrel's unpacking undoes it


@pytest.mark.parametrize("rows", [5, 2500])  # 2500: converted in chunks of rows
def test_pack_rows_round_trip(rows):
    u = torch.randint(0, 16, (rows, 64), dtype=torch.uint8)
    packed = pack_rows(u)
    assert packed.shape == (rows, 8) and torch.equal(unpack_rows(packed), u)
    assert packed[0, 0].item() == sum(int(v) << (4 * i) for i, v in enumerate(u[0, :8])) - (
        (1 << 32) if u[0, 7] >= 8 else 0)


# ------------------------------------------------------------------------------------------------ configs
def test_gptq_awq_ct_configs():
    g = get_quant_config({"quantization_config": quantization_config("gptq", 64, True)}, None, torch.bfloat16)
    assert isinstance(g, GPTQConfig)
    assert g.for_layer(QKV) == W4A16Scheme("gptq", 64, True, True) and g.for_layer("lm_head") is None
    a = get_quant_config({"quantization_config": quantization_config("awq", 128)}, "awq_marlin", torch.float16)
    assert isinstance(a, AWQConfig) and a.for_layer("model.layers.1.mlp.down_proj") == W4A16Scheme("awq", 128, False, False)
    c = get_quant_config({"quantization_config": quantization_config("ct_w4a16", None)}, None, torch.bfloat16)
    assert isinstance(c, CompressedTensorsInt4Config) and c.for_layer(QKV) == W4A16Scheme("compressed-tensors", -1)
    with pytest.raises(NotImplementedError, match="channel-wise INT4 experts"):
        c.for_layer("model.layers.0.mlp.experts")
    c = get_quant_config({"quantization_config": quantization_config("ct_w4a16_asym", 32)}, None, torch.bfloat16)
    assert c.for_layer(QKV) == W4A16Scheme("compressed-tensors", 32, symmetric=False)
    with pytest.raises(NotImplementedError, match="asymmetric INT4 experts"):
        c.for_layer("model.layers.0.mlp.experts")
    i = get_quant_config({"quantization_config": quantization_config("ct_int8", None)}, None, torch.bfloat16)
    assert isinstance(i, CompressedTensorsInt8Config) and i.for_layer(QKV) == Int8Scheme("token")
    assert i.for_layer("lm_head") is None


@pytest.mark.parametrize("actorder", ["weight", "static"])
def test_ct_static_actorder_is_the_plain_layout(actorder):
    qc = quantization_config("ct_w4a16", 32)
    qc["config_groups"]["group_0"]["weights"]["actorder"] = actorder
    assert get_quant_config({"quantization_config": qc}).for_layer(QKV) == W4A16Scheme("compressed-tensors", 32)
    qc["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    assert get_quant_config({"quantization_config": qc}).for_layer(QKV) == W4A16Scheme("compressed-tensors", 32, True)
    qc["config_groups"]["group_0"]["weights"]["actorder"] = "bogus"
    with pytest.raises(NotImplementedError, match="activation ordering 'bogus'"):
        get_quant_config({"quantization_config": qc})


def test_naive_quantized_int8_reads_as_int_quantized():
    qc = {**quantization_config("ct_int8", None), "format": "naive-quantized"}
    assert isinstance(get_quant_config({"quantization_config": qc}), CompressedTensorsInt8Config)


def test_marlin_names_log_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="kestrel.layers.quant"):
        get_quant_config({"quantization_config": quantization_config("gptq", 32)}, "gptq_marlin", torch.bfloat16)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kestrel.layers.quant"]
    assert "gptq_marlin" in line and "gptq format" in line


@pytest.mark.parametrize("fmt, change, error, message", [
    ("gptq", dict(bits=3), NotImplementedError, "3-bit weights are not supported \\(4 or 8-bit only\\)"),
    ("gptq", dict(checkpoint_format="marlin"), NotImplementedError, "checkpoint_format 'marlin'"),
    ("gptq", dict(lm_head=True), NotImplementedError, "quantized lm_head"),
    ("gptq", dict(dynamic={"-:.*": {}}), NotImplementedError, "dynamic"),
    ("gptq", dict(group_size=12), NotImplementedError, "group size 12"),
    ("awq", dict(version="gemv"), NotImplementedError, "version 'gemv'"),
    ("awq", dict(zero_point=False), NotImplementedError, "zero_point false"),
    ("awq", dict(bits=3), NotImplementedError, "3-bit"),
])
def test_unsupported_gptq_awq_refused(fmt, change, error, message):
    qc = {**quantization_config(fmt, 32), **change}
    with pytest.raises(error, match=message):
        get_quant_config({"quantization_config": qc}, None, torch.bfloat16)


def test_unknown_method_and_mismatch_refused():
    with pytest.raises(NotImplementedError, match="quant_method 'bitsandbytes' is not supported"):
        get_quant_config({"quantization_config": {"quant_method": "bitsandbytes"}}, None, torch.bfloat16)
    with pytest.raises(ValueError, match="unsupported quantization 'hqq'"):
        get_quant_config({}, "hqq", torch.bfloat16)
    with pytest.raises(ValueError, match="does not match the checkpoint's quant_method 'gptq'"):
        get_quant_config({"quantization_config": quantization_config("gptq", 32)}, "awq", torch.bfloat16)
    with pytest.raises(ValueError, match="quantization='gptq' but the checkpoint has no quantization_config"):
        get_quant_config({}, "gptq", torch.bfloat16)
    with pytest.raises(NotImplementedError, match="gptq MoE experts are not supported"):
        get_quant_config({"quantization_config": quantization_config("gptq", 32)}, None,
                         torch.bfloat16).for_layer("model.layers.0.mlp.experts")


def test_int8_variants_refused():
    qc = quantization_config("ct_int8", None)
    qc["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(NotImplementedError, match="dynamic per token"):
        get_quant_config({"quantization_config": qc}, None, torch.bfloat16)
    qc = quantization_config("ct_int8", None)
    qc["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    with pytest.raises(NotImplementedError, match="INT8 weight strategy 'tensor'"):
        get_quant_config({"quantization_config": qc}, None, torch.bfloat16)


# ------------------------------------------------------------------------------------------------ loading + dequant
SIZES = (64, 32, 32)  # q, k, v rows
K = 128


def _shards(fmt: str, group: int | None, act_order: bool, seed: int = 0):
    """Per shard: (checkpoint tensors, the reference dequantised weight)."""
    torch.manual_seed(seed)
    out = []
    for i, n in enumerate(SIZES):
        w = torch.randn(n, K) * 0.08
        if fmt == "ct_w4a16" and act_order:
            out.append(ct_act_order(w, group, gptq_groups(K, group, True, seed=i)))
            continue
        if fmt.startswith("ct_"):
            out.append(ct_compress(w, fmt[3:], group))
            continue
        g_idx = gptq_groups(K, group, act_order, seed=i)
        u, z, s = quantize_4bit(w, g_idx, symmetric=fmt == "gptq")
        t = gptq_pack(u, z, s, g_idx) if fmt == "gptq" else awq_pack(u, z, s)
        out.append((t, dequantize_4bit(u, z, s, g_idx)))
    return out


def _layer(fmt, group, act_order, dtype, backend="auto", platform=None):
    qc = get_quant_config({"quantization_config": quantization_config(fmt, group, act_order)}, None, dtype)
    if platform is None:
        return Linear(K, list(SIZES), False, dtype, QKV, qc, backend)
    from kestrel.platform.testing import use_platform

    with use_platform(platform):
        return Linear(K, list(SIZES), False, dtype, QKV, qc, backend)


def _load(layer, shards):
    for sid, (tensors, _) in enumerate(shards):
        for name, t in tensors.items():
            layer.load_weight(name, t, sid)


CASES = [("ct_w4a16", 32, False), ("ct_w4a16", None, False), ("ct_w4a16", 32, True), ("ct_w4a16_asym", 32, False),
         ("ct_w4a16_asym", None, False), ("gptq", 32, False), ("gptq", 64, True),
         ("gptq", 128, False), ("gptq", -1, False), ("awq", 32, False), ("awq", 128, False), ("ct_int8", None, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,group,act_order", CASES)
def test_dequantised_weights_bit_equal(fmt, group, act_order, dtype):
    shards = _shards(fmt, group, act_order)
    layer = _layer(fmt, group, act_order, dtype)
    assert type(layer.kernel) is (Int8DequantFallbackLinear if fmt == "ct_int8" else W4A16DequantLinear)
    _load(layer, shards)
    layer.process_weights_after_loading()
    ref = torch.cat([d for _, d in shards]).to(dtype)
    assert layer.weight.dtype == dtype and torch.equal(layer.weight.data, ref)
    x = torch.randn(3, K, dtype=dtype)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, ref))


def test_dequantisation_can_fail():
    """A wrong zero (GPTQ v2 read as v1) or a shard loaded in the wrong place changes the weights."""
    shards = _shards("gptq", 32, False)
    qc = {**quantization_config("gptq", 32), "checkpoint_format": "gptq_v2"}
    layer = Linear(K, list(SIZES), False, torch.float32, QKV, get_quant_config({"quantization_config": qc}))
    _load(layer, shards)
    layer.process_weights_after_loading()
    assert not torch.equal(layer.weight.data, torch.cat([d for _, d in shards]).float())
    layer = _layer("awq", 32, False, torch.float32)
    shards = _shards("awq", 32, False)
    _load(layer, [shards[0], shards[2], shards[1]][:1])
    with pytest.raises(ValueError, match=r"qweight\[shard 1\]: checkpoint shape \(128, 8\) != expected \(128, 4\)"):
        layer.load_weight("qweight", shards[0][0]["qweight"], 1)


def test_shape_and_dtype_checks():
    layer = _layer("ct_w4a16", 32, False, torch.float32)
    with pytest.raises(ValueError, match=r"weight_shape\[shard 1\]: \[64, 128\] != \[32, 128\]"):
        layer.load_weight("weight_shape", torch.tensor([64, 128]), 1)
    layer = _layer("ct_int8", None, False, torch.float32)
    with pytest.raises(ValueError, match="expected an int8 checkpoint tensor"):
        layer.load_weight("weight", torch.zeros(64, K), 0)


# ------------------------------------------------------------------------------------------------ selection
@pytest.mark.parametrize("arch, fmt, expected", [
    ("cpu", "gptq", W4A16DequantLinear), ("sm_90", "gptq", TritonW4A16Linear), ("sm_80", "awq", TritonW4A16Linear),
    ("sm_75", "ct_w4a16", W4A16DequantLinear), ("gfx942", "awq", W4A16DequantLinear),
    ("cpu", "ct_int8", Int8DequantFallbackLinear), ("sm_90", "ct_int8", TorchInt8MMLinear),
])
def test_selection(arch, fmt, expected):
    layer = _layer(fmt, 32 if fmt != "ct_int8" else None, False, torch.bfloat16, platform=fake_platform(arch))
    assert type(layer.kernel) is expected, layer.kernel.skipped


def test_selection_gates_and_forcing():
    spec = LinearSpec(QKV, K, SIZES, False, torch.float32, W4A16Scheme("gptq", 32))
    ok, why = TritonW4A16Linear.check(spec, fake_platform("sm_90"))
    assert not ok and "float32" in why  # fp32 models take the dequantised path
    spec = LinearSpec(QKV, 96, SIZES, False, torch.bfloat16, W4A16Scheme("gptq", 64))
    assert W4A16DequantLinear.can_implement(spec) == (False, "input size 96 is not a multiple of the group size 64")
    from kestrel.kernels import KernelSelectionError

    with pytest.raises(KernelSelectionError, match="no linear kernel can serve layer .*qkv_proj"):
        select("linear", LinearSpec(QKV, K, SIZES, False, torch.bfloat16, W4A16Scheme("gptq", 32)), "torch_dense")


# ------------------------------------------------------------------------------------------------ Triton layout
def _emulate_triton(layer, x):
    """What the kernel computes, in PyTorch: columns gathered by perm, nibbles of qw [K/8, N] along K, one scale
    and zero row per group of G consecutive (permuted) columns."""
    qw, s, z = layer.w4_qweight.data, layer.w4_scales.data, layer.w4_zeros.data
    u = unpack_rows(qw.t().contiguous()).t()  # [K, N]
    g = torch.arange(u.shape[0]) // layer.kernel.group_size
    w = ((u.long() - z.long()[g]).float() * s.float()[g]).to(s.dtype).to(x.dtype)
    xp = x if layer.w4_perm is None else x[:, layer.w4_perm.long()]
    return xp.float() @ w.float()


@pytest.mark.parametrize("fmt,group,act_order", [c for c in CASES if c[0] != "ct_int8" and c[1] not in (None, -1)])
def test_triton_layout_matches_dequantised(fmt, group, act_order):
    """The repacked layout (made on the CPU) computes the dequantised layer's product."""
    shards = _shards(fmt, group, act_order)
    if act_order:  # one g_idx for all shards (q, k, v share their input, so GPTQ's order): the kernel's case
        shards = _shards(fmt, group, act_order)
        key = "g_idx" if fmt == "gptq" else "weight_g_idx"
        g_idx = shards[0][0][key]
        shards = [(dict(t, **{key: g_idx}), None) for t, _ in shards]
        ref_layer = _layer(fmt, group, act_order, torch.float32)
        _load(ref_layer, shards)
        ref_layer.process_weights_after_loading()
        ref = ref_layer.weight.data
    else:
        ref = torch.cat([d for _, d in shards]).float()
    layer = _layer(fmt, group, act_order, torch.bfloat16, platform=fake_platform("sm_90"))
    assert type(layer.kernel) is TritonW4A16Linear
    _load(layer, shards)
    layer.process_weights_after_loading()
    assert not layer.kernel.dense and (layer.w4_perm is not None) == act_order
    x = torch.randn(5, K, dtype=torch.bfloat16)
    torch.testing.assert_close(_emulate_triton(layer, x), x.float() @ ref.to(torch.bfloat16).float().t(),
                               rtol=1e-5, atol=1e-5)


def test_triton_layout_falls_back_where_shards_differ(caplog):
    shards = _shards("gptq", 32, True)  # q, k, v with different act orders
    layer = _layer("gptq", 32, True, torch.bfloat16, platform=fake_platform("sm_90"))
    _load(layer, shards)
    with caplog.at_level(logging.INFO, logger="kestrel.kernels.w4a16"):
        layer.process_weights_after_loading()
    assert layer.kernel.dense and "different act-order g_idx" in caplog.text
    assert torch.equal(layer.weight.data, torch.cat([d for _, d in shards]).to(torch.bfloat16))


def test_triton_layout_rejects_uneven_groups():
    from kestrel.kernels.w4a16_scheme import Int4Weights

    u = torch.zeros(8, 64, dtype=torch.uint8)
    g_idx = torch.tensor([0] * 40 + [1] * 24)  # 40 and 24 columns: not groups of 32
    w = Int4Weights(u, torch.zeros(8, 2, dtype=torch.uint8), torch.ones(8, 2, dtype=torch.float16), g_idx, 32)
    assert triton_layout(w) is None


# ------------------------------------------------------------------------------------------------ int8 GEMM path
def test_int8_mm_path_on_cpu():
    """torch_int8_mm's apply (torch._int_mm runs on the CPU too): per-token int8 activations times the int8
    weights, both scales applied; equal to the same arithmetic written out, and near the dequantised product."""
    shards = _shards("ct_int8", None, False)
    layer = _layer("ct_int8", None, False, torch.bfloat16, platform=fake_platform("sm_90"))
    assert type(layer.kernel) is TorchInt8MMLinear
    _load(layer, shards)
    ref_w = torch.cat([d for _, d in shards]).float()
    wq = torch.cat([t["weight"] for t, _ in shards])
    ws = torch.cat([t["weight_scale"] for t, _ in shards]).float().reshape(1, -1)
    layer.process_weights_after_loading()
    for m in (1, 16, 40):
        x = torch.randn(m, K, dtype=torch.bfloat16)
        xq, xs = quantize_per_token_int8(x)
        want = ((xq.int() @ wq.int().t()).float() * xs * ws).to(torch.bfloat16)
        got = layer(x)
        assert torch.equal(got, want)
        torch.testing.assert_close(got.float(), x.float() @ ref_w.t(), rtol=0.05, atol=0.05)


def test_int8_weight_only_takes_the_fallback():
    """W8A16 INT8 (no input_activations): torch_int8_mm says why not, the dequantised fallback serves it."""
    qc = quantization_config("ct_int8", None)
    qc["config_groups"]["group_0"]["input_activations"] = None
    cfg = get_quant_config({"quantization_config": qc}, None, torch.bfloat16)
    assert cfg.for_layer(QKV) == Int8Scheme(None)
    spec = LinearSpec(QKV, K, SIZES, False, torch.bfloat16, Int8Scheme(None))
    assert TorchInt8MMLinear.check(spec, fake_platform("sm_90")) == (
        False, "weight-only INT8 (the checkpoint does not quantize activations)")
    from kestrel.platform.testing import use_platform

    with use_platform(fake_platform("sm_90")):
        layer = Linear(K, list(SIZES), False, torch.bfloat16, QKV, cfg)
    assert type(layer.kernel) is Int8DequantFallbackLinear
    assert "weight-only INT8" in layer.kernel.skipped[-1]


def test_gptq_8bit_packer_hand_computed():
    """8-bit GPTQ: four values a word, the lowest first; zeros minus one."""
    u = torch.tensor([[10 * n + k for k in range(4)] for n in range(4)], dtype=torch.uint8)
    zeros = torch.tensor([[128], [1], [2], [3]])
    t = gptq_pack(u, zeros, torch.ones(4, 1, dtype=torch.float16), torch.zeros(4, dtype=torch.int32), bits=8)
    assert t["qweight"].shape == (1, 4) and t["qzeros"].shape == (1, 1)
    assert t["qweight"][0, 1].item() == 0x0D0C0B0A
    assert t["qzeros"][0, 0].item() == 0x0201007F


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_8bit_dequantised_and_served_dequantised(act_order):
    torch.manual_seed(0)
    shards = []
    for i, n in enumerate(SIZES):
        w = torch.randn(n, K) * 0.08
        g_idx = gptq_groups(K, 32, act_order, seed=i)
        u, z, s = quantize_4bit(w, g_idx, symmetric=True, bits=8)
        shards.append((gptq_pack(u, z, s, g_idx, bits=8), dequantize_4bit(u, z, s, g_idx)))
    qc = get_quant_config({"quantization_config": quantization_config("gptq", 32, act_order, bits=8)})
    assert qc.for_layer(QKV) == W4A16Scheme("gptq", 32, act_order, True, 8) and qc.for_layer(QKV).name.startswith("w8a16")
    from kestrel.platform.testing import use_platform

    with use_platform(fake_platform("sm_90")):
        layer = Linear(K, list(SIZES), False, torch.bfloat16, QKV, qc)
    assert type(layer.kernel) is W4A16DequantLinear
    assert "triton_w4a16: 8-bit weights (the kernel unpacks 4-bit words)" in layer.kernel.skipped
    _load(layer, shards)
    layer.process_weights_after_loading()
    assert torch.equal(layer.weight.data, torch.cat([d for _, d in shards]).to(torch.bfloat16))
