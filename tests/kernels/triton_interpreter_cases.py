"""Interpreter cases for the Triton FP8 kernels. They need TRITON_INTERPRET=1 set before triton is first imported
(the interpreter cannot call triton.language's own jitted helpers otherwise), so test_triton_fp8_block.py runs this
file in a fresh process with that environment; collected any other way, it skips."""
from __future__ import annotations

import os

import pytest
import torch

from kestrel.kernels.fp8 import TritonFp8BlockLinear
from kestrel.kernels.fp8_quant import dequantize_block, dequantize_per_token_group, quantize_per_token_group, quantize_weight_block
from kestrel.layers.linear import Linear
from kestrel.platform import fp8_dtype
from kestrel.platform.testing import use_platform

from tests.kernels.conftest import quant_config_for
from tests.kernels.fp8_helpers import load_shards, reference_activation, reference_weight, rel_err, shard_checkpoint

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_triton_fp8_block.py")

TOL = 2e-2


@pytest.fixture(scope="module")
def interp_ops():
    from kestrel.kernels.triton_ops import fp8_block

    return fp8_block


def gemm_case(m, n, k, group_n, gen, dtype=torch.float8_e4m3fn):
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    wq, ws = quantize_weight_block(w, (128, 128), dtype)
    if group_n == 1:
        ws = ws.repeat_interleave(128, dim=0)[:n].contiguous()
        w_ref = dequantize_block(wq, ws, (1, 128))
    else:
        w_ref = dequantize_block(wq, ws, (128, 128))
    return x, wq, ws, w_ref


@pytest.mark.parametrize("m,n,k,group_n", [(5, 300, 200, 128), (33, 256, 384, 128), (1, 200, 130, 1), (70, 96, 256, 1)])
def test_block_gemm_interpreter(interp_ops, m, n, k, group_n):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x, wq, ws, w_ref = gemm_case(m, n, k, group_n, gen)
    xq, xs = quantize_per_token_group(x, 128)
    y = interp_ops.fp8_block_gemm(xq, xs, wq, ws, group_n, 128, torch.bfloat16)
    ref = dequantize_per_token_group(xq, xs, 128) @ w_ref.T
    assert y.shape == (m, n) and rel_err(y, ref) < TOL


# The Triton 3.6 interpreter's fp32 -> fp8 cast does not carry a rounded-up mantissa into the exponent (e.g. -31
# becomes -16 instead of -32), so in the interpreter only the scales of the quantization kernel are compared exactly
# and its FP8 values loosely; the Linear test below quantizes with the torch helper. On a GPU the hardware cast is
# used and test_block_gemm_gpu compares the kernel's FP8 values exactly.
def test_group_quant_kernel_matches_torch(interp_ops):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 200, generator=gen) * 2).to(torch.bfloat16)
    x[1] = 0
    q, s = interp_ops.per_token_group_quant_fp8(x, 128)
    q_ref, s_ref = quantize_per_token_group(x, 128)
    assert q.shape == q_ref.shape and q.dtype == q_ref.dtype
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float()[1] == 0).all()
    assert (q.float() == q_ref.float()).float().mean() > 0.9


@pytest.mark.parametrize("sizes", [(256, 128, 128), (100, 60, 60), (300,)])
@pytest.mark.parametrize("arch", ["sm_90", "gfx950"])  # the interpreter has no FNUZ (gfx942) dtype
def test_triton_linear_interpreter(interp_ops, monkeypatch, sizes, arch):
    # see above: the interpreter mis-rounds fp8 casts, so activations are quantized by the torch helper here
    monkeypatch.setattr(interp_ops, "per_token_group_quant_fp8", quantize_per_token_group)
    with use_platform(arch) as p:
        layer = Linear(200, list(sizes), bias=True, params_dtype=torch.bfloat16, prefix="model.layers.0.self_attn.qkv_proj"
                       if len(sizes) == 3 else "model.layers.0.mlp.down_proj", quant_config=quant_config_for("block"))
        assert type(layer.kernel) is TritonFp8BlockLinear
        gen = torch.Generator().manual_seed(7)
        shards = shard_checkpoint(layer.spec.quant, sizes, 200, gen)
        load_shards(layer, shards)
        b = torch.randn(sum(sizes), generator=gen) * 0.1
        layer.load_weight("bias", b.to(torch.bfloat16))
        layer.process_weights_after_loading()
        aligned = all(s % 128 == 0 for s in sizes[:-1])
        assert layer.kernel.group_n == (128 if aligned else 1)
        assert layer.weight.dtype == fp8_dtype(p)
        x = torch.randn(3, 4, 200, generator=gen).to(torch.bfloat16)
        y = layer(x)
        ref = reference_activation(layer.spec.quant, x.float(), shards, fp8_dtype(p)) @ reference_weight(layer.spec.quant, shards).T
        assert y.shape == (3, 4, sum(sizes))
        assert rel_err(y, ref + b.to(torch.bfloat16).float()) < TOL
