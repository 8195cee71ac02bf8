"""The Triton LoRA shrink/expand kernels compile for sm_90 ahead of time (no GPU needed; needs triton)."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.attention.test_triton_compile import compile_ok  # noqa: E402


@pytest.mark.parametrize("block_r,block_k", [(16, 64), (64, 64)])
def test_lora_shrink_compiles(block_r, block_k):
    from kestrel.kernels.triton_ops import lora

    fn = lora._lora_shrink_kernel
    ptrs = {"X": "*bf16", "A": "*bf16", "Y": "*fp32", "SORTED": "*i32", "SEG": "*i32", "BLK_SLOT": "*i32",
            "BLK_ROW0": "*i32"}
    compile_ok(fn, {n: ptrs.get(n, "i32") for n in fn.arg_names},
               dict(BLOCK_M=lora.BLOCK_M, BLOCK_R=block_r, BLOCK_K=block_k))


@pytest.mark.parametrize("block_r", [16, 64])
def test_lora_expand_compiles(block_r):
    from kestrel.kernels.triton_ops import lora

    fn = lora._lora_expand_kernel
    ptrs = {"Y": "*fp32", "B": "*bf16", "OUT": "*bf16", "SORTED": "*i32", "SEG": "*i32", "BLK_SLOT": "*i32",
            "BLK_ROW0": "*i32"}
    compile_ok(fn, {n: ptrs.get(n, "i32") for n in fn.arg_names},
               dict(BLOCK_M=lora.BLOCK_M, BLOCK_N=64, BLOCK_R=block_r))
