"""The FP8 KV cache's pieces on the CPU: quantise / dequantise, the re-typed specs (and MLA's refusal), the
reference attention over a float8 cache against the same attention over the unquantised K/V, the checkpoint scale
names, --calculate-kv-scales' scale and the backend selection."""
from __future__ import annotations

import pytest
import torch

from kestrel.attention import kv_quant
from kestrel.attention.ops import reference as ref
from kestrel.attention.selector import select_attention_backend
from kestrel.core.kv_spec import FullAttentionSpec, MLASpec, SlidingWindowSpec
from kestrel.errors import ConfigError
from kestrel.platform import fake_platform
from tests.attention.paged_cases import paged_case

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# the largest relative rounding error of a normal float8 value: half a step of its 3 (e4m3) or 2 (e5m2) mantissa bits
HALF_STEP = {torch.float8_e4m3fn: 2.0 ** -4, torch.float8_e5m2: 2.0 ** -3}


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_rounds_within_half_a_step_and_saturates(dtype):
    x = torch.linspace(-3.0, 3.0, 1001)
    x = x[x.abs() > 0.1]  # normal values at scale 0.01 (the e4m3 subnormals start below 2**-6)
    scale = torch.tensor(0.01)
    q = kv_quant.quantize(x, scale, dtype)
    assert q.dtype == dtype
    back = kv_quant.dequantize(q, scale)
    assert ((back - x).abs() <= HALF_STEP[dtype] * x.abs() + 1e-7).all()
    big = kv_quant.dequantize(kv_quant.quantize(torch.tensor([1e9, -1e9]), 1.0, dtype), 1.0)
    assert big.tolist() == [kv_quant.fp8_max(dtype), -kv_quant.fp8_max(dtype)]  # saturated, not inf or NaN


def test_specs_take_the_cache_dtype_and_mla_is_refused():
    specs = {"a": FullAttentionSpec(torch.bfloat16, num_kv_heads=2, head_dim=64),
             "b": SlidingWindowSpec(torch.bfloat16, num_kv_heads=2, head_dim=64, sliding_window=128)}
    assert kv_quant.specs_with_cache_dtype(specs, "auto") is specs
    fp8 = kv_quant.specs_with_cache_dtype(specs, "fp8")
    assert fp8["a"].dtype == fp8["b"].dtype == torch.float8_e4m3fn
    assert fp8["b"].sliding_window == 128
    assert fp8["a"].page_bytes * 2 == specs["a"].page_bytes  # half the bytes a token: twice the tokens
    assert kv_quant.specs_with_cache_dtype(specs, "fp8_e5m2")["a"].dtype == torch.float8_e5m2
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype fp8: an FP8 cache of MLASpec pages \(layer m\)"):
        kv_quant.specs_with_cache_dtype({**specs, "m": MLASpec(torch.bfloat16)}, "fp8")
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8_inc: expected auto, fp8, fp8_e4m3, fp8_e5m2"):
        kv_quant.specs_with_cache_dtype(specs, "fp8_inc")


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("window", [0, 8])
def test_reference_attention_over_a_float8_cache(dtype, window):
    """The reference writes K / scale, V / scale into a float8 cache and reads them back scaled: equal to
    attention over the dequantised K/V exactly, and close to attention over the unquantised K/V (the rounding
    error of float8, relative to the output's norm: e4m3 about 3%, e5m2 about 6%)."""
    gen = torch.Generator().manual_seed(0)
    q_lens, seq_lens = [5, 1, 9], [21, 14, 9]
    q, kc, vc, bt, qsl, sl = paged_case(q_lens, seq_lens, 16, 4, 2, 32, torch.float32, gen)
    k_scale, v_scale = torch.tensor(0.02), torch.tensor(0.015)
    kq, vq = torch.zeros_like(kc, dtype=dtype), torch.zeros_like(vc, dtype=dtype)
    slots = torch.arange(kc.shape[0] * 16)
    ref.reshape_and_cache_ref(kc.flatten(0, 1), vc.flatten(0, 1), kq, vq, slots, k_scale, v_scale)
    assert torch.equal(kq, kv_quant.quantize(kc, k_scale, dtype))
    out = ref.paged_attention_ref(q, kq, vq, bt, qsl, sl, 0.2, sliding_window=window, k_scale=k_scale,
                                  v_scale=v_scale)
    dequant = ref.paged_attention_ref(q, kq.float() * k_scale, vq.float() * v_scale, bt, qsl, sl, 0.2,
                                      sliding_window=window)
    exact = ref.paged_attention_ref(q, kc, vc, bt, qsl, sl, 0.2, sliding_window=window)
    assert torch.allclose(out, dequant, atol=1e-6, rtol=1e-5)
    err = ((out - exact).norm() / exact.norm()).item()
    assert 0 < err < {torch.float8_e4m3fn: 0.05, torch.float8_e5m2: 0.1}[dtype], err


def test_checkpoint_scale_names():
    assert kv_quant.checkpoint_kv_scale("model.layers.3.self_attn.k_scale") == ("model.layers.3.self_attn",
                                                                                  ("k_scale",))
    assert kv_quant.checkpoint_kv_scale("model.layers.0.self_attn.v_proj.output_scale") == (
        "model.layers.0.self_attn", ("v_scale",))
    assert kv_quant.checkpoint_kv_scale("model.layers.0.self_attn.kv_scale")[1] == ("k_scale", "v_scale")
    assert kv_quant.checkpoint_kv_scale("model.layers.0.self_attn.k_proj.weight_scale") is None
    assert kv_quant.checkpoint_kv_scale("model.layers.0.self_attn.k_proj.input_scale") is None


def test_calibrated_scale_maps_twice_the_amax_to_the_float8_maximum():
    class Layer:
        k_scale = torch.ones(())
        v_scale = torch.ones(())

    k = torch.zeros(4, 2, 8)
    v = torch.zeros(4, 2, 8)
    k[1, 0, 3], k[3, 1, 1] = -7.0, 100.0  # token 3 is padding (slot -1): not counted
    v[0, 1, 2] = 3.0
    layer = Layer()
    assert not kv_quant.calibrate(layer, k, v, torch.tensor([-1, -1, -1, -1]), 4, torch.float8_e4m3fn)
    assert layer.k_scale.item() == 1.0
    assert kv_quant.calibrate(layer, k, v, torch.tensor([5, 6, 7, -1]), 4, torch.float8_e4m3fn)
    assert layer.k_scale.item() == pytest.approx(2 * 7.0 / 448)
    assert layer.v_scale.item() == pytest.approx(2 * 3.0 / 448)


def test_backend_selection_for_a_float8_cache():
    spec = FullAttentionSpec(torch.float8_e4m3fn, num_kv_heads=2, head_dim=64)
    cpu = fake_platform("cpu", triton_available=False)
    assert select_attention_backend(spec, 16, platform=cpu, dtype=torch.float32).name == "torch_ref"
    with pytest.raises(ConfigError, match="torch_mla: reads no FullAttentionSpec"):
        select_attention_backend(spec, 16, "torch_mla", platform=cpu, dtype=torch.float32)
    pytest.importorskip("triton")
    from kestrel.attention.backends.triton import TritonBackend

    ok, why = TritonBackend.validate_kv_cache_dtype(fake_platform("sm_80"), spec.dtype, torch.bfloat16)
    assert not ok and "needs Triton float8 conversions (sm_89+), not on sm_80" in why
    assert TritonBackend.validate_kv_cache_dtype(fake_platform("sm_90"), spec.dtype, torch.bfloat16) == (True, "")
    assert select_attention_backend(spec, 16, platform=fake_platform("sm_90"), dtype=torch.bfloat16) is TritonBackend


def test_float8_groups_cross_the_process_boundary():
    """The executor's wire form of the KV groups (mp / Ray workers report them to the engine core) keeps the
    cache dtype."""
    from kestrel.core.kv_spec import KVCacheGroup
    from kestrel.executor.messages import decode_groups, encode_groups

    specs = kv_quant.specs_with_cache_dtype(
        {"a": SlidingWindowSpec(torch.bfloat16, num_kv_heads=2, head_dim=64, sliding_window=8)}, "fp8_e5m2")
    groups = [KVCacheGroup(0, specs["a"], ["a"])]
    back = decode_groups(encode_groups(groups))
    assert back[0].spec == specs["a"] and back[0].spec.dtype == torch.float8_e5m2
