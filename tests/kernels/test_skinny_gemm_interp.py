"""The skinny GEMM's logic (split-K partials, the last-split reduction, counter reset) on CUDA or under the
Triton interpreter on the CPU (make kernels-check); skipped otherwise. fp16 operands: the interpreter multiplies
bf16 as raw bits."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.attention.ops import gates  # noqa: E402

_ok, _why = gates.triton_runnable()
pytestmark = pytest.mark.skipif(not _ok, reason=_why)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m,n,k", [(1, 96, 1024), (5, 70, 1100), (8, 64, 300)])
@pytest.mark.parametrize("split", [1, 4])
def test_skinny_gemm_matches_reference(m, n, k, split):
    from kestrel.kernels.triton_ops.counters import tile_counters
    from kestrel.kernels.triton_ops.skinny_gemm import skinny_gemm

    gen = torch.Generator().manual_seed(m * 7 + split)
    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.float16)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, torch.float16)
    b = torch.randn(n, generator=gen).to(DEVICE, torch.float16)
    out = skinny_gemm(x, w, b, _config={"SPLIT_K": split, "BLOCK_N": 32, "BLOCK_K": 128})
    ref = x.double() @ w.double().T + b.double()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-3
    assert int(tile_counters(x.device).abs().sum()) == 0


@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("with_residual", [False, True])
def test_skinny_rms_norm_prologue(split, with_residual):
    from kestrel.kernels.triton_ops.skinny_gemm import skinny_rms_norm_gemm

    gen = torch.Generator().manual_seed(11 + split)
    m, n, k = 3, 64, 600
    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.float16)
    res = torch.randn(m, k, generator=gen).to(DEVICE, torch.float16) if with_residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE, torch.float16)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, torch.float16)
    xs = (x.float() + res.float()).half() if with_residual else x
    xf = xs.double()
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).half().double() * nw.double()
    ref = h @ w.double().T
    y, r = skinny_rms_norm_gemm(x, nw, 1e-6, w, residual=res, _config={"SPLIT_K": split, "BLOCK_N": 32, "BLOCK_K": 128})
    assert ((y.double() - ref).norm() / ref.norm()).item() < 5e-3
    assert torch.equal(r, xs)


@pytest.mark.parametrize("split", [1, 4])
def test_skinny_silu_mul_prologue(split):
    from kestrel.kernels.triton_ops.skinny_gemm import skinny_silu_mul_gemm

    gen = torch.Generator().manual_seed(5 + split)
    m, n, k = 2, 96, 520
    gu = torch.randn(m, 2 * k, generator=gen).to(DEVICE, torch.float16)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, torch.float16)
    g, u = gu.double().chunk(2, dim=-1)
    ref = (g * torch.sigmoid(g) * u) @ w.double().T
    y = skinny_silu_mul_gemm(gu, w, _config={"SPLIT_K": split, "BLOCK_N": 32, "BLOCK_K": 128})
    assert ((y.double() - ref).norm() / ref.norm()).item() < 5e-3
