"""FP8 kernels against a float32 reference of the dequantized GEMM, on the CPU (issue 6, acceptance 4)."""
from __future__ import annotations

import pytest
import torch

from kestrel.kernels.fp8 import Fp8DequantFallbackLinear, TorchScaledMMLinear
from kestrel.kernels.fp8_quant import (
    dequantize_per_token_group,
    e4m3fn_to_e4m3fnuz,
    quantize_per_tensor_dynamic,
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_block,
    dequantize_block,
)
from kestrel.layers.linear import Linear
from kestrel.layers.quant import get_quant_config
from kestrel.platform.testing import requires_kernel, use_platform

from tests.kernels.conftest import ct_config, quant_config_for
from tests.kernels.fp8_helpers import (
    load_shards,
    reference_activation,
    reference_weight,
    rel_err,
    shard_checkpoint,
)

TOL = 2e-2
HF_PER_TENSOR_DYNAMIC = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}


def _config(scheme: str):
    if scheme == "per_tensor_dynamic":
        return get_quant_config(HF_PER_TENSOR_DYNAMIC, None, torch.bfloat16)
    if scheme == "weight_only_channel":
        return get_quant_config(ct_config("channel", None), None, torch.bfloat16)
    return quant_config_for(scheme)


def build(scheme, k, sizes, dtype, backend, bias=False, seed=0, prefix=None, device="cpu"):
    """A Linear (parameters on `device`) loaded from per-shard checkpoint tensors made on the CPU."""
    prefix = prefix or ("model.layers.0.self_attn.qkv_proj" if len(sizes) == 3 else
                        "model.layers.0.mlp.gate_up_proj" if len(sizes) == 2 else "model.layers.0.mlp.down_proj")
    with torch.device(device):
        layer = Linear(k, list(sizes), bias=bias, params_dtype=dtype, prefix=prefix, quant_config=_config(scheme),
                       backend=backend)
    gen = torch.Generator().manual_seed(seed)
    shards = shard_checkpoint(layer.spec.quant, sizes, k, gen)
    load_shards(layer, shards)
    if bias:
        b = torch.randn(sum(sizes), generator=gen) * 0.1
        layer.load_weight("bias", b.to(dtype))
    else:
        b = None
    layer.process_weights_after_loading()
    return layer, shards, b, gen


FALLBACK_SCHEMES = ["block", "per_tensor_static", "per_channel_token", "on_load", "per_tensor_dynamic", "weight_only_channel"]


@pytest.mark.parametrize("scheme", FALLBACK_SCHEMES)
@pytest.mark.parametrize("sizes", [(300,), (100, 60, 60), (150, 150)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fallback_matches_dequantized_reference(scheme, sizes, dtype):
    with use_platform("cpu"):
        layer, shards, b, gen = build(scheme, 200, sizes, dtype, "auto", bias=sizes == (300,))
        assert type(layer.kernel) is Fp8DequantFallbackLinear
        x = torch.randn(2, 5, 200, generator=gen).to(dtype).float()
        y = layer(x.to(dtype))
        assert y.shape == (2, 5, sum(sizes)) and y.dtype == dtype
        ref = x.float() @ reference_weight(layer.spec.quant, shards).T
        if b is not None:
            ref = ref + b
        assert rel_err(y, ref) < TOL


# torch._scaled_mm runs on the CPU in this torch (per-tensor and row-wise for e4m3fn; row-wise for e4m3fnuz),
# so the kernel's apply is checked here on a fake device; the real GPU run is benchmarks/gpu_fp8.py.
SCALED_MM_SCHEMES = ["per_tensor_static", "per_channel_token", "on_load", "per_tensor_dynamic"]


def skip_without_cpu_rowwise(layer, fp8=torch.float8_e4m3fn) -> None:
    """Row-wise torch._scaled_mm on CPU tensors came after torch 2.11 (the GPU image's torch asserts "only supports
    per-tensor scaling for CPU backend"): where this torch lacks it, a row-wise layer cannot run here."""
    if not layer.kernel.rowwise:
        return
    a = torch.ones(2, 16).to(fp8)
    b = torch.ones(16, 16).to(fp8).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        pytest.skip(f"torch {torch.__version__}: no row-wise _scaled_mm on CPU tensors ({str(e).splitlines()[0][:80]})")


# gfx1201 has per-tensor but no row-wise _scaled_mm: merged per-tensor layers requantize to one scale there
SCALED_MM_CASES = [(s, "sm_90") for s in SCALED_MM_SCHEMES] + [(s, "gfx1201") for s in ("per_tensor_static", "per_tensor_dynamic")]


@pytest.mark.parametrize("scheme,arch", SCALED_MM_CASES)
@pytest.mark.parametrize("sizes", [(304,), (96, 48, 48)])
def test_torch_scaled_mm_matches_dequantized_reference(scheme, sizes, arch):
    with use_platform(arch):
        layer, shards, b, gen = build(scheme, 208, sizes, torch.bfloat16, "torch_scaled_mm", bias=True)
        assert type(layer.kernel) is TorchScaledMMLinear
        skip_without_cpu_rowwise(layer)
        x = torch.randn(7, 208, generator=gen).to(torch.bfloat16).float()
        y = layer(x.to(torch.bfloat16))
        q = layer.spec.quant
        w_ref = reference_weight(q, shards)
        if arch == "gfx1201" and q.weight == "tensor" and len(sizes) > 1:
            # one scale for the merged weight: every shard requantized to the largest scale
            s = torch.cat([t["weight_scale"] for t in shards])
            smax = s.max()
            w_ref = torch.cat([(t["weight"].float() * (t["weight_scale"] / smax)).to(torch.float8_e4m3fn).float() * smax
                               for t in shards])
            assert not layer.kernel.rowwise
        ref = reference_activation(q, x, shards) @ w_ref.T + b
        assert rel_err(y, ref) < TOL
        # and, looser, against the unquantized activations
        assert rel_err(y, x.float() @ reference_weight(q, shards).T + b) < 6e-2


@pytest.mark.parametrize("scheme", ["per_channel_token", "on_load"])
def test_torch_scaled_mm_fnuz_on_gfx942(scheme):
    with use_platform("gfx942"):
        layer, shards, b, gen = build(scheme, 208, (96, 48, 48), torch.bfloat16, "torch_scaled_mm")
        assert layer.weight.dtype == torch.float8_e4m3fnuz
        skip_without_cpu_rowwise(layer, torch.float8_e4m3fnuz)
        x = torch.randn(9, 208, generator=gen).to(torch.bfloat16).float()
        y = layer(x.to(torch.bfloat16))
        fnuz = torch.float8_e4m3fnuz
        ref = reference_activation(layer.spec.quant, x, shards, fnuz) @ reference_weight(layer.spec.quant, shards, fnuz).T
        assert rel_err(y, ref) < TOL


def test_e4m3fn_to_fnuz_keeps_values():
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    keep = ~torch.isnan(bits.float())
    q, s = e4m3fn_to_e4m3fnuz(bits, torch.tensor(1.5))
    assert q.dtype == torch.float8_e4m3fnuz
    torch.testing.assert_close(q.float()[keep] * s, bits.float()[keep] * 1.5, rtol=0, atol=0)


def test_activation_helpers():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 200, generator=gen) * 3
    x[2] = 0  # an all-zero row must not produce NaN
    q, s = quantize_per_token_group(x, 128)
    assert q.shape == (6, 200) and s.shape == (6, 2)
    assert torch.isfinite(s).all() and (q.float()[2] == 0).all()
    assert torch.allclose(s[0, 1], x[0, 128:].abs().max() / 448)
    assert rel_err(dequantize_per_token_group(q, s, 128), x) < 4e-2
    q, s = quantize_per_token(x)
    assert s.shape == (6, 1) and rel_err(q.float() * s, x) < 4e-2
    q, s = quantize_per_tensor_dynamic(x)
    assert s.shape == (1,) and q.float().abs().max() == 448
    w = torch.randn(300, 200, generator=gen)
    q, s = quantize_weight_block(w, (128, 128))
    assert s.shape == (3, 2) and rel_err(dequantize_block(q, s, (128, 128)), w) < 4e-2


def test_loading_errors_name_the_layer():
    with use_platform("cpu"):
        layer = Linear(200, [100, 60, 60], params_dtype=torch.bfloat16, prefix="model.layers.1.self_attn.qkv_proj",
                       quant_config=quant_config_for("block"))
        with pytest.raises(ValueError, match="model.layers.1.self_attn.qkv_proj.weight.*float8_e4m3fn"):
            layer.load_weight("weight", torch.randn(100, 200), shard_id=0)
        with pytest.raises(ValueError, match="qkv_proj.weight_scale_inv"):
            layer.load_weight("weight_scale_inv", torch.ones(2, 2), shard_id=1)  # shard 1 has 1 block row
        pt = Linear(208, [96, 48, 48], params_dtype=torch.bfloat16, prefix="model.layers.1.self_attn.qkv_proj",
                    quant_config=quant_config_for("per_tensor_static"))
        pt.load_weight("weight_scale", torch.ones(1), shard_id=0)
        pt.load_weight("input_scale", torch.ones(1), shard_id=0)
        with pytest.raises(ValueError, match=r"weight_scale: no value was loaded for shard\(s\) \[1, 2\]"):
            pt.process_weights_after_loading()


def test_on_load_quantization_rounds_like_fp8():
    with use_platform("cpu"):
        layer, shards, b, gen = build("on_load", 200, (300,), torch.float32, "auto")
        dense = shards[0]["weight"]
        # the fallback computes with FP8-rounded weights, not the originals
        assert not torch.equal(layer.weight, dense)
        assert rel_err(layer.weight, dense) < 4e-2


@pytest.mark.gpu
@requires_kernel("torch_scaled_mm")
@pytest.mark.parametrize("scheme", ["per_tensor_static", "per_channel_token", "on_load"])
def test_torch_scaled_mm_gpu(scheme):
    """On a real device: the selected torch_scaled_mm path against the dequantized reference."""
    from kestrel.platform import current_platform, supports_fp8_rowwise_scaled_mm

    if scheme != "per_tensor_static" and not supports_fp8_rowwise_scaled_mm():
        pytest.skip("no row-wise _scaled_mm on this device")
    dev = current_platform().torch_device
    layer, shards, b, gen = build(scheme, 1024, (512, 256, 256), torch.bfloat16, "torch_scaled_mm", device=dev)
    assert layer.weight.device.type == dev.type
    x = torch.randn(33, 1024, generator=gen).to(torch.bfloat16).float()
    y = layer(x.to(dev, torch.bfloat16)).cpu()
    q = layer.spec.quant
    from kestrel.platform import fp8_dtype

    ref = reference_activation(q, x, shards, fp8_dtype()) @ reference_weight(q, shards, fp8_dtype()).T
    assert rel_err(y, ref) < TOL
