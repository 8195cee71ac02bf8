"""The fused MoE's grouped GEMM compiles for sm_90 ahead of time (no GPU needed: Triton ships ptxas), for every
default tile config, bf16 and FP8, gate_up (SiLU-and-mul epilogue; GELU-tanh too in bf16) and down (routing-weight
epilogue). Catches
what the interpreter cannot (MMA shapes, FP8 dot, register pressure errors). Needs triton (not in CI)."""
from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kestrel.kernels.triton_ops import fused_moe  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def _configs(fp8: bool):
    seen = []
    for b in fused_moe.BUCKETS:
        cfg = fused_moe.default_config(b, 128, 8, fp8)
        for part in ("up", "down"):
            if (part, cfg[part]) not in seen:
                seen.append((part, cfg[part]))
    return seen


@pytest.mark.parametrize("fp8,activation", [(False, "silu"), (True, "silu"), (False, "gelu")])
def test_grouped_gemm_compiles_for_every_default_tile(fp8, activation):
    fn = fused_moe._moe_grouped_gemm_kernel
    dt = "*fp8e4nv" if fp8 else "*bf16"
    ptrs = {"A": dt, "B": dt, "C": "*bf16", "A_SCALE": "*fp32", "B_SCALE": "*fp32", "TOPK_W": "*fp32",
            "SORTED_IDS": "*i32", "BLOCK_EXPERT": "*i32", "NUM_PADDED": "*i32", "BIAS": "*bf16"}
    for part, tile in _configs(fp8):
        if activation != "silu" and part == "down":  # the activation is the gate_up epilogue's
            continue
        tile = dict(tile)
        warps, stages = tile.pop("num_warps"), tile.pop("num_stages")
        constexprs = dict(A_ROW_DIV=8 if part == "up" else 1, GATED=part == "up", MUL_WEIGHT=part == "down",
                          FP8=fp8, GROUP_N=128, ACT=fused_moe.EPILOGUES[activation], HAS_BIAS=False, **tile)
        sig = {n: ptrs.get(n, "i32") for n in fn.arg_names}
        sig.update({n: "constexpr" for n in constexprs})
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=TARGET,
                                options={"num_warps": warps, "num_stages": stages})
        assert kernel.asm.get("ptx"), (part, tile)


def test_grouped_gemm_compiles_with_biases_and_swigluoai():
    """gpt-oss's epilogues (expert biases, the clamped SwiGLU) at the default tiles of a 32-expert top-4 layer."""
    fn = fused_moe._moe_grouped_gemm_kernel
    ptrs = {"A": "*bf16", "B": "*bf16", "C": "*bf16", "A_SCALE": "*fp32", "B_SCALE": "*fp32", "TOPK_W": "*fp32",
            "SORTED_IDS": "*i32", "BLOCK_EXPERT": "*i32", "NUM_PADDED": "*i32", "BIAS": "*bf16"}
    for b in (1, 256, 8192):
        for part, tile in fused_moe.default_config(b, 32, 4, False).items():
            tile = dict(tile)
            warps, stages = tile.pop("num_warps"), tile.pop("num_stages")
            constexprs = dict(A_ROW_DIV=4 if part == "up" else 1, GATED=part == "up", MUL_WEIGHT=part == "down",
                              FP8=False, GROUP_N=1, ACT=1, HAS_BIAS=True, **tile)
            sig = {n: ptrs.get(n, "i32") for n in fn.arg_names} | {n: "constexpr" for n in constexprs}
            kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=TARGET,
                                    options={"num_warps": warps, "num_stages": stages})
            assert kernel.asm.get("ptx"), (part, tile)


def test_align_kernel_compiles():
    fn = fused_moe._align_kernel
    ptrs = {"IDS": "*i64", "SORTED": "*i32", "BLOCK_EXPERT": "*i32", "NUM_PADDED": "*i32", "CURSOR": "*i32"}
    for e_pad, bm in ((256, 16), (16, 128)):
        constexprs = dict(E_PAD=e_pad, BLOCK_M=bm, CHUNK=256, BCHUNK=max(16, 4096 // e_pad))
        sig = {n: ptrs.get(n, "i32") for n in fn.arg_names} | {n: "constexpr" for n in constexprs}
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=TARGET,
                                options={"num_warps": 4})
        assert kernel.asm.get("ptx")


def test_grid_align_kernels_compile():
    ptrs = {"IDS": "*i64", "SORTED": "*i32", "BLOCK_EXPERT": "*i32", "NUM_PADDED": "*i32", "COUNTS": "*i32",
            "BASE": "*i32"}
    for e_pad, bm in ((256, 16), (16, 128), (512, 128)):
        bchunk = min(4096 // e_pad, 4096 // bm)
        for fn, constexprs in ((fused_moe._align_count_kernel, dict(E_PAD=e_pad, CHUNK=fused_moe.GRID_CHUNK)),
                               (fused_moe._align_place_kernel, dict(E_PAD=e_pad, BLOCK_M=bm, BCHUNK=bchunk,
                                                                    CHUNK=fused_moe.GRID_CHUNK))):
            sig = {n: ptrs.get(n, "i32") for n in fn.arg_names} | {n: "constexpr" for n in constexprs}
            kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=TARGET,
                                    options={"num_warps": 4})
            assert kernel.asm.get("ptx"), (fn, e_pad, bm)
