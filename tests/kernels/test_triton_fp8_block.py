"""The Triton block-scaled FP8 GEMM: in the Triton interpreter on the CPU (skips without triton), and on a real
GPU where the gate table says it runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kestrel.kernels.fp8 import TritonFp8BlockLinear
from kestrel.kernels.fp8_quant import dequantize_per_token_group, quantize_per_token_group
from kestrel.layers.linear import Linear
from kestrel.platform import current_platform, fp8_dtype
from kestrel.platform.testing import requires_kernel, requires_triton_interpreter, use_platform

from tests.kernels.conftest import quant_config_for
from tests.kernels.fp8_helpers import load_shards, reference_weight, rel_err, shard_checkpoint
from tests.kernels.triton_interpreter_cases import gemm_case

TOL = 2e-2
ROOT = Path(__file__).resolve().parents[2]


@requires_triton_interpreter
def test_triton_interpreter_cases():
    """tests/kernels/triton_interpreter_cases.py in a fresh process with TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/triton_interpreter_cases.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1]


# ------------------------------------------------------------------------------------------------ real GPU
@pytest.mark.gpu
@requires_kernel("triton_fp8_block")
@pytest.mark.parametrize("m", [1, 16, 257])
def test_block_gemm_gpu(m):
    from kestrel.kernels.triton_ops import fp8_block as ops

    dt = fp8_dtype()
    gen = torch.Generator().manual_seed(m)
    x, wq, ws, w_ref = gemm_case(m, 640, 1000, 128, gen, dt)
    dev = current_platform().torch_device
    xq, xs = ops.per_token_group_quant_fp8(x.to(dev, torch.bfloat16), 128, dt)
    xq_ref, xs_ref = quantize_per_token_group(x.to(torch.bfloat16), 128, dt)
    torch.testing.assert_close(xs.cpu(), xs_ref, rtol=1e-6, atol=0)
    assert (xq.cpu().float() != xq_ref.float()).float().mean() < 1e-3  # a division rounding apart at most
    y = ops.fp8_block_gemm(xq, xs, wq.to(dev), ws.to(dev), 128, 128, torch.bfloat16)
    ref = dequantize_per_token_group(xq.cpu(), xs.cpu(), 128) @ w_ref.T
    assert rel_err(y.cpu(), ref) < TOL



def test_triton_linear_converts_to_fnuz_on_gfx942():
    """Weight processing only (no triton needed): e4m3fn checkpoint bits reinterpreted as FNUZ, scales doubled."""
    with use_platform("gfx942"):
        layer = Linear(200, [100, 60, 60], params_dtype=torch.bfloat16, prefix="model.layers.0.self_attn.qkv_proj",
                       quant_config=quant_config_for("block"))
        assert type(layer.kernel) is TritonFp8BlockLinear
        gen = torch.Generator().manual_seed(5)
        shards = shard_checkpoint(layer.spec.quant, (100, 60, 60), 200, gen)
        load_shards(layer, shards)
        layer.process_weights_after_loading()
        assert layer.weight.dtype == torch.float8_e4m3fnuz and layer.kernel.group_n == 1
        per_row = layer.weight_scale_inv.repeat_interleave(128, dim=1)[:, :200]
        w = layer.weight.float() * per_row
        torch.testing.assert_close(w, reference_weight(layer.spec.quant, shards), rtol=0, atol=0)
