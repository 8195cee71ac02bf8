"""The fused KDA decode kernel compiles for sm_90 ahead of time (no GPU needed): what the interpreter cannot catch
(types, constexpr use, the barrier), at Kimi-Linear-48B's head size and the small ones."""
from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from kestrel.kernels.triton_ops import kda_decode  # noqa: E402
from tests.attention.test_triton_compile import compile_ok  # noqa: E402

PTRS = {"QKV": "*bf16", "F": "*bf16", "BETA": "*bf16", "GATE": "*bf16", "W_CONV": "*bf16", "A_LOG": "*fp32",
        "DT_BIAS": "*fp32", "W_NORM": "*bf16", "REC": "*fp32", "CONV": "*bf16", "SLOTS": "*i32", "SEQ_LENS": "*i32",
        "OUT": "*bf16"}


@pytest.mark.parametrize("d,k", [(128, 4), (64, 4), (16, 3)])
def test_kda_decode_compiles(d, k):
    fn = kda_decode._kda_decode_kernel
    sig = {n: PTRS.get(n, "fp32" if n == "eps" else "i32") for n in fn.arg_names}
    compile_ok(fn, sig, dict(H=32, D=d, K=k, KP=triton.next_power_of_2(k), HK=32, DV=d, PER_HEAD_G=False,
                             SILU_GATE=False), num_warps=kda_decode.num_warps(d))


@pytest.mark.parametrize("hk,h,dk,dv", [(16, 32, 128, 128), (2, 4, 16, 32)])
def test_gdn_decode_compiles(hk, h, dk, dv):
    """Gated DeltaNet's form (Qwen3.5 / 3.6: 16 key heads repeated to 32 value heads of 128)."""
    fn = kda_decode._kda_decode_kernel
    sig = {n: PTRS.get(n, "fp32" if n == "eps" else "i32") for n in fn.arg_names}
    compile_ok(fn, sig, dict(H=h, D=dk, K=4, KP=4, HK=hk, DV=dv, PER_HEAD_G=True, SILU_GATE=True),
               num_warps=kda_decode.num_warps(max(dk, dv)))
