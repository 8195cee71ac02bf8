"""The batch-1 GEMV (kestrel/kernels/triton_ops/gemv.py) and its fused RMSNorm prologue / SiLU-and-mul epilogue
against float64 references, on CUDA or under the Triton interpreter (make kernels-check); skipped otherwise."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402

_ok, _why = gates.triton_runnable()
pytestmark = pytest.mark.skipif(not _ok, reason=_why)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter multiplies bf16 as raw bits


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def rms_norm_ref(x, weight, eps, residual=None):
    """fused_ops.rms_norm's rounding: x + residual in the dtype, normalized, rounded, times the weight."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.double()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).double() * weight.double(), x


@pytest.mark.parametrize("n,k", [(96, 1024), (70, 1100), (33, 5000)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(n, k, bias):
    from kestrel.kernels.triton_ops.gemv import gemv

    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen).to(DEVICE, DTYPE)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, DTYPE)
    b = torch.randn(n, generator=gen).to(DEVICE, DTYPE) if bias else None
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert rel(gemv(x, w, b, _config={"TILE": 1024}), ref) < 5e-3


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("silu_out", [False, True])
@pytest.mark.parametrize("n,k", [(64, 1024), (50, 600)])
def test_gemv_rms_norm_and_silu_fusions(with_residual, silu_out, n, k):
    from kestrel.kernels.triton_ops.gemv import gemv

    gen = torch.Generator().manual_seed(7 + with_residual + 2 * silu_out)
    x = torch.randn(1, k, generator=gen).to(DEVICE, DTYPE)
    res = torch.randn(1, k, generator=gen).to(DEVICE, DTYPE) if with_residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE, DTYPE)
    rows = 2 * n if silu_out else n
    w = (torch.randn(rows, k, generator=gen) * k ** -0.5).to(DEVICE, DTYPE)
    h, new_res = rms_norm_ref(x, nw, 1e-6, res)
    ref = h @ w.double().T
    if silu_out:
        g, u = ref[:, :n], ref[:, n:]
        ref = g * torch.sigmoid(g) * u
    y, r = gemv(x, w, norm_weight=nw, eps=1e-6, residual=res, silu_out=silu_out, _config={"TILE": 2048})
    assert y.shape == (1, n)
    assert rel(y, ref) < 1e-2
    assert torch.equal(r, new_res)
