"""Kernel selection over fake devices: gates, priority, forcing, logging (issue 6, acceptance 1-3)."""
from __future__ import annotations

import logging

import pytest
import torch

from kestrel.kernels import CANDIDATES, KernelSelectionError, backend_names, select
from kestrel.kernels.base import LinearSpec
from kestrel.kernels.dense import TorchDenseLinear, TritonSkinnyDenseLinear
from kestrel.kernels.fp8 import Fp8DequantFallbackLinear, TorchScaledMMLinear, TritonFp8BlockLinear
from kestrel.kernels.moe import MoESpec, TorchMoE
from kestrel.layers.linear import Linear
from kestrel.layers.quant import get_quant_config
from kestrel.platform import fake_platform, supports_fp8_scaled_mm
from kestrel.platform.gates import GATES, kernel_gate
from kestrel.platform.testing import use_platform

from tests.kernels.conftest import ct_config, quant_config_for

TSM, TRI, FB, SKD = "torch_scaled_mm", "triton_fp8_block", "fp8_dequant_fallback", "triton_skinny_dense"
CLASSES = {TSM: TorchScaledMMLinear, TRI: TritonFp8BlockLinear, FB: Fp8DequantFallbackLinear, SKD: TritonSkinnyDenseLinear,
           "torch_dense": TorchDenseLinear}
SCHEMES = ("block", "per_tensor_static", "per_channel_token", "on_load")

# arch: (FP8 scaled-MM gate, {scheme: selected kernel}); every fake GPU has Triton installed.
EXPECTED = {
    "sm_75": (False, dict(block=FB, per_tensor_static=FB, per_channel_token=FB, on_load=FB)),
    "sm_80": (False, dict(block=FB, per_tensor_static=FB, per_channel_token=FB, on_load=FB)),
    "sm_89": (True, dict(block=TRI, per_tensor_static=TSM, per_channel_token=TSM, on_load=TSM)),
    "sm_90": (True, dict(block=TRI, per_tensor_static=TSM, per_channel_token=TSM, on_load=TSM)),
    "sm_100": (True, dict(block=TRI, per_tensor_static=TSM, per_channel_token=TSM, on_load=TSM)),
    "gfx90a": (False, dict(block=FB, per_tensor_static=FB, per_channel_token=FB, on_load=FB)),
    "gfx942": (True, dict(block=TRI, per_tensor_static=TSM, per_channel_token=TSM, on_load=TSM)),
    "gfx950": (True, dict(block=TRI, per_tensor_static=TSM, per_channel_token=TSM, on_load=TSM)),
    "gfx1100": (False, dict(block=FB, per_tensor_static=FB, per_channel_token=FB, on_load=FB)),
    # RDNA4: per-tensor _scaled_mm yes, row-wise no -> per-channel schemes fall back
    "gfx1201": (True, dict(block=TRI, per_tensor_static=TSM, per_channel_token=FB, on_load=FB)),
    "cpu": (False, dict(block=FB, per_tensor_static=FB, per_channel_token=FB, on_load=FB)),
}

# kernel -> archs where is_supported(platform) is True (fake GPUs with Triton installed)
SUPPORTED_ON = {
    TSM: {"sm_89", "sm_90", "sm_100", "gfx942", "gfx950", "gfx1201"},
    TRI: {"sm_89", "sm_90", "sm_100", "gfx942", "gfx950", "gfx1201"},
    FB: set(EXPECTED),
    SKD: {"sm_80", "sm_89", "sm_90", "sm_100"},  # CUDA Ampere+ with Triton; ROCm not validated
    "torch_dense": set(EXPECTED),
}


@pytest.mark.parametrize("arch", list(EXPECTED))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dense_selection_table(arch, dtype):
    """Unquantized layers: the skinny GEMM where its gate holds and the dtype is 16-bit, torch matmul elsewhere."""
    with use_platform(arch):
        layer = Linear(256, [128, 64], params_dtype=dtype, prefix="model.layers.0.self_attn.qkv_proj")
    want = SKD if arch in SUPPORTED_ON[SKD] and dtype != torch.float32 else "torch_dense"
    assert type(layer.kernel) is CLASSES[want], (arch, dtype, layer.kernel.skipped)


def make_linear(scheme: str, backend: str = "auto", prefix="model.layers.0.mlp.down_proj", sizes=(512,), k=256):
    return Linear(k, list(sizes), params_dtype=torch.bfloat16, prefix=prefix,
                  quant_config=quant_config_for(scheme), backend=backend)


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_selection_table(arch):
    gate, by_scheme = EXPECTED[arch]
    with use_platform(arch) as p:
        assert supports_fp8_scaled_mm(p) is gate
        for scheme in SCHEMES:
            layer = make_linear(scheme)
            assert type(layer.kernel) is CLASSES[by_scheme[scheme]], (arch, scheme, layer.kernel.skipped)
            # merged q/k/v select the same way
            qkv = make_linear(scheme, prefix="model.layers.0.self_attn.qkv_proj", sizes=(256, 128, 128))
            assert type(qkv.kernel) is CLASSES[by_scheme[scheme]]


def test_gfx1100_never_selects_scaled_mm_even_when_it_is_listed_first():
    with use_platform("gfx1100"):
        for scheme in SCHEMES:
            for backend in ("auto",):
                assert not isinstance(make_linear(scheme, backend).kernel, TorchScaledMMLinear)
        with pytest.raises(KernelSelectionError, match="gfx1100"):
            make_linear("per_tensor_static", backend=TSM)


def test_without_triton_block_weights_fall_back():
    with use_platform(fake_platform("sm_90", triton_available=False)):
        layer = make_linear("block")
        assert type(layer.kernel) is Fp8DequantFallbackLinear
        assert any("triton is not installed" in s for s in layer.kernel.skipped)


@pytest.mark.parametrize("name", [TSM, TRI, FB, SKD, "torch_dense"])
def test_is_supported_alone(name):
    cls = CLASSES[name]
    for arch in EXPECTED:
        ok, why = cls.is_supported(fake_platform(arch))
        assert ok is (arch in SUPPORTED_ON[name]), (name, arch, why)
        assert ok or why  # a refusal always says why


@pytest.mark.parametrize("order", ["reversed", "rotated"])
def test_gates_hold_in_any_list_order(monkeypatch, order):
    base = list(CANDIDATES["linear"])
    shuffled = base[::-1] if order == "reversed" else base[1:] + base[:1]
    monkeypatch.setitem(CANDIDATES, "linear", shuffled)
    for arch in EXPECTED:
        p = fake_platform(arch)
        with use_platform(p):
            for scheme in SCHEMES:
                kernel = make_linear(scheme).kernel
                cls = type(kernel)
                assert cls.is_supported(p)[0] and cls.can_implement(kernel.spec)[0]
                assert cls.can_implement_on(kernel.spec, p)[0]
                assert arch in SUPPORTED_ON[cls.name]
                # every kernel ahead of the winner was skipped for its own reason
                ahead = shuffled[: shuffled.index(cls)]
                assert [s.split(":")[0] for s in kernel.skipped] == [c.name for c in ahead]
                assert all(not c.check(kernel.spec, p)[0] for c in ahead)


def test_every_gate_row_belongs_to_a_candidate():
    """Each row gates a linear/MoE kernel candidate (whose is_supported reads it) or an attention backend's kernel
    (declared in the backend's `kernels`; tests/hw_platform/test_kda_gate.py holds that consumer to the row)."""
    from kestrel.attention.selector import backend_candidates

    names = {c.name: c for kind in CANDIDATES.values() for c in kind}
    backend_kernels = {k for b in backend_candidates() for k in getattr(b, "kernels", ())}
    for name in GATES:
        assert name in names or name in backend_kernels, name
        for arch in EXPECTED if name in names else ():
            p = fake_platform(arch)
            assert names[name].is_supported(p) == kernel_gate(name, p)


# ------------------------------------------------------------------------------------------------ forcing
@pytest.mark.parametrize("arch", ["sm_90", "gfx942", "sm_80", "gfx1100", "cpu"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("backend", [TSM, TRI, FB, SKD, "torch_dense"])
def test_forced_backend_selects_exactly_it_or_raises_naming_the_layer(arch, scheme, backend):
    cls = CLASSES[backend]
    p = fake_platform(arch)
    prefix = "model.layers.3.mlp.down_proj"
    with use_platform(p):
        spec = LinearSpec(prefix, 256, (512,), False, torch.bfloat16, quant_config_for(scheme).for_layer(prefix))
        can, why = cls.check(spec, p)
        if can:
            assert type(make_linear(scheme, backend, prefix=prefix).kernel) is cls
        else:
            with pytest.raises(KernelSelectionError) as err:
                make_linear(scheme, backend, prefix=prefix)
            msg = str(err.value)
            assert prefix in msg and why in msg and backend in msg


def test_forcing_matrix_spot_checks():
    with use_platform("sm_90"):
        assert type(make_linear("block", TRI).kernel) is TritonFp8BlockLinear
        assert type(make_linear("block", FB).kernel) is Fp8DequantFallbackLinear
        with pytest.raises(KernelSelectionError, match="block-wise weight scales"):
            make_linear("block", TSM)
        with pytest.raises(KernelSelectionError, match="needs block-wise weight scales"):
            make_linear("per_channel_token", TRI)
        with pytest.raises(KernelSelectionError, match="weights are quantized"):
            make_linear("block", "torch_dense")
    with use_platform("sm_80"):
        # the fallback that auto reaches on a GPU without FP8 matmul, and forcing it gives the same class
        assert type(make_linear("per_channel_token").kernel) is Fp8DequantFallbackLinear
        assert type(make_linear("per_channel_token", FB).kernel) is Fp8DequantFallbackLinear
        with pytest.raises(KernelSelectionError, match="no FP8 scaled-MM"):
            make_linear("per_channel_token", TSM)


def test_forced_shape_limits_name_the_layer():
    with use_platform("sm_90"):
        with pytest.raises(KernelSelectionError, match=r"model.layers.0.mlp.down_proj.*divisible by 16"):
            Linear(200, 300, params_dtype=torch.bfloat16, prefix="model.layers.0.mlp.down_proj",
                   quant_config=quant_config_for("per_channel_token"), backend=TSM)
        auto = Linear(200, 300, params_dtype=torch.bfloat16, prefix="x.down_proj", quant_config=quant_config_for("per_channel_token"))
        assert type(auto.kernel) is Fp8DequantFallbackLinear


def test_fp8_backend_leaves_unquantized_layers_dense():
    cfg = get_quant_config(ct_config("channel", "token"), None, torch.bfloat16)
    cfg.ignore = ("model.layers.0.mlp.down_proj",)
    with use_platform("sm_90"):
        dense = Linear(256, 512, params_dtype=torch.bfloat16, prefix="model.layers.0.mlp.down_proj", quant_config=cfg, backend=TSM)
        assert type(dense.kernel) is TritonSkinnyDenseLinear  # auto among the dense kernels
        fp8 = Linear(256, 512, params_dtype=torch.bfloat16, prefix="model.layers.1.mlp.down_proj", quant_config=cfg, backend=TSM)
        assert type(fp8.kernel) is TorchScaledMMLinear


def test_unknown_backend_lists_choices():
    with pytest.raises(KernelSelectionError, match="torch_scaled_mm, triton_fp8_block"):
        make_linear("block", "marlin")
    assert backend_names("linear") == ["auto", TSM, TRI, FB, "triton_w4a16", "w4a16_dequant", "torch_int8_mm",
                                       "int8_dequant_fallback", SKD, "torch_dense"]
    assert backend_names("moe") == ["auto", "triton_fp8_block_moe", "triton_fused_moe", "triton_mxfp4_dequant_moe",
                                    "triton_int4_dequant_moe", "fp8_dequant_moe", "int4_dequant_moe",
                                    "mxfp4_dequant_moe", "torch_moe"]


def test_nothing_fits_lists_every_reason():
    spec = LinearSpec("model.layers.0.mlp.up_proj", 64, (64,), False, torch.int8)
    with pytest.raises(KernelSelectionError) as err:
        select("linear", spec, platform=fake_platform("sm_90"))
    msg = str(err.value)
    for name in (TSM, TRI, FB, SKD, "torch_dense"):
        assert f"{name}:" in msg
    assert "model.layers.0.mlp.up_proj" in msg


def test_moe_selection_and_forcing():
    spec = MoESpec("model.layers.0.mlp.experts", 8, 2, 64, 128, torch.bfloat16)
    assert type(select("moe", spec, "auto", fake_platform("gfx1100"))) is TorchMoE
    assert type(select("moe", spec, "torch_moe", fake_platform("sm_90"))) is TorchMoE
    with pytest.raises(KernelSelectionError, match="unknown moe backend"):
        select("moe", spec, "marlin")
    bad = MoESpec("model.layers.0.mlp.experts", 8, 2, 64, 128, torch.bfloat16, activation="relu2")
    with pytest.raises(KernelSelectionError, match="model.layers.0.mlp.experts.*relu2"):
        select("moe", bad, "torch_moe")


def test_selection_logs_info_once_per_kernel(caplog):
    caplog.set_level(logging.DEBUG, logger="kestrel.kernels")
    with use_platform("sm_90"):
        for i in range(3):
            make_linear("block", prefix=f"model.layers.{i}.mlp.down_proj")
        make_linear("per_channel_token", prefix="model.layers.0.self_attn.o_proj")
    selected = [r for r in caplog.records if r.getMessage().startswith("Selected")]
    info = [r.getMessage() for r in selected if r.levelno == logging.INFO]
    debug = [r.getMessage() for r in selected if r.levelno == logging.DEBUG]
    assert len(info) == 2 and len(debug) == 2
    assert info[0] == ("Selected triton_fp8_block for model.layers.0.mlp.down_proj "
                       "(skipped: torch_scaled_mm: block-wise weight scales need a block-scaled GEMM)")
    assert info[1].startswith("Selected torch_scaled_mm for model.layers.0.self_attn.o_proj")


def test_no_environment_variable_forces_a_kernel(monkeypatch):
    for var in ("KESTREL_LINEAR_BACKEND", "KESTREL_FORCE_KERNEL", "KESTREL_FP8_BACKEND"):
        monkeypatch.setenv(var, FB)
    with use_platform("sm_90"):
        assert type(make_linear("block").kernel) is TritonFp8BlockLinear


def test_selection_report_and_kernel_name():
    from torch import nn

    from kestrel.kernels import selection_report

    with use_platform("sm_90"):
        model = nn.ModuleDict({"a": make_linear("block", prefix="model.layers.0.mlp.down_proj"),
                               "b": make_linear("per_channel_token", prefix="model.layers.0.self_attn.o_proj")})
    assert model["a"].kernel_name == TRI
    rows = selection_report(model)
    assert [(r[0], r[1]) for r in rows] == [("model.layers.0.mlp.down_proj", TRI), ("model.layers.0.self_attn.o_proj", TSM)]
    assert rows[0][2] == ("torch_scaled_mm: block-wise weight scales need a block-scaled GEMM",)


def test_loading_an_unknown_tensor_names_the_layer():
    with use_platform("cpu"):
        layer = make_linear("block", prefix="model.layers.2.mlp.down_proj")
        with pytest.raises(KeyError, match=r"model.layers.2.mlp.down_proj .*'input_scale'.*weight_scale_inv"):
            layer.load_weight("input_scale", torch.ones(1))
