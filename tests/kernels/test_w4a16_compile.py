"""The Triton W4A16 GEMM compiles for sm_90 ahead of time (no GPU needed) at every tile `tiles_for` picks and every
K step `block_k_for` picks (group sizes 32 / 64 / 128, channel-wise), bf16 and fp16 activations with bf16 / fp16
scales (decode rows with split K), and keeps its accumulator in registers: no spill stores."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from kestrel.kernels.triton_ops import w4a16_gemm as ops  # noqa: E402
from tests.attention.test_triton_sparse_mla_compile import _spill_bytes  # noqa: E402


def _sig(act: str, scale: str) -> dict:
    ptrs = {"X": f"*{act}", "QW": "*i32", "S": f"*{scale}", "Z": "*u8", "B": f"*{act}", "Y": f"*{act}", "WS": "*fp32"}
    return {n: ptrs.get(n, "i32") for n in ops._w4a16_gemm_kernel.arg_names}


@pytest.mark.parametrize("m", [1, 32, 512])
@pytest.mark.parametrize("group", [32, 64, 128, 4096])  # 4096: channel-wise at K = 4096
@pytest.mark.parametrize("act,scale", [("bf16", "bf16"), ("bf16", "fp16"), ("fp16", "fp16")])
def test_w4a16_gemm_compiles_without_spills(m, group, act, scale):
    bm, bn, warps = ops.tiles_for(m)
    bk = ops.block_k_for(group, 4096) if group != 4096 else 128
    constexprs = dict(GROUP=group, HAS_BIAS=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=m == 1)
    assert _spill_bytes(ops._w4a16_gemm_kernel, _sig(act, scale), constexprs, warps, 3) == 0


def test_block_k_for():
    assert [ops.block_k_for(g, 4096) for g in (32, 64, 128, 256, 48)] == [32, 64, 128, 128, 16]
    with pytest.raises(ValueError, match="group size 40 is not a multiple of 16"):
        ops.block_k_for(40, 4096)
