"""The one gate table for the Triton attention / fused ops. Importable without Triton.

The launchers in `triton_attention.py`, the attention backend and the test skip markers all read this.
"""
from __future__ import annotations

import functools
import os

import torch

GATES = {
    "dtypes": (torch.bfloat16, torch.float16, torch.float32),
    # any power of two in [16, 512] compiles; these are the ones checked (512: Gemma 4's global layers, by the
    # interpreter and sm_90 compiles without spills, not yet on a GPU)
    "head_dims": (64, 128, 256, 512),
    "block_sizes": (16, 32, 64, 128, 256),
    "platforms": ("cuda",),  # plus the CPU interpreter (TRITON_INTERPRET=1) for tests
    # float8 KV caches the attention kernels read and write (per-tensor scales); on the GPU where the platform
    # converts float8 in Triton (supports_triton_fp8: sm_89+), not the fnuz float8 of gfx94x
    "kv_cache_dtypes": (torch.float8_e4m3fn, torch.float8_e5m2),
}


@functools.cache
def triton_importable() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the environment
        return False, f"triton not importable: {e}"
    return True, ""


def interpreter_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runnable() -> tuple[bool, str]:
    """Whether the Triton ops can run here at all: CUDA + Triton, or the Triton CPU interpreter."""
    ok, why = triton_importable()
    if not ok:
        return ok, why
    if torch.cuda.is_available() or interpreter_mode():
        return True, ""
    return False, "no CUDA device and TRITON_INTERPRET is not 1"


def check_attention(dtype: torch.dtype, head_dim: int, block_size: int) -> tuple[bool, str]:
    if dtype not in GATES["dtypes"]:
        return False, f"dtype {dtype} not in {GATES['dtypes']}"
    if head_dim < 16 or head_dim > 512 or head_dim & (head_dim - 1):
        return False, f"head_dim {head_dim} is not a power of two in [16, 512]"
    if block_size not in GATES["block_sizes"]:
        return False, f"block_size {block_size} not in {GATES['block_sizes']}"
    return True, ""


def check_kv_cache_dtype(cache_dtype: torch.dtype) -> tuple[bool, str]:
    """A KV cache in one of the compute dtypes, or a float8 one."""
    if cache_dtype not in GATES["dtypes"] + GATES["kv_cache_dtypes"]:
        return False, f"KV cache dtype {cache_dtype} not in {GATES['dtypes'] + GATES['kv_cache_dtypes']}"
    return True, ""
