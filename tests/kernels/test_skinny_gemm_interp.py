"""The skinny GEMM's logic (split-K partials, the last-split reduction, counter reset) on CUDA or under the
Triton interpreter on the CPU (make kernels-check); skipped otherwise. fp16 operands: the interpreter multiplies
bf16 as raw bits."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402

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
