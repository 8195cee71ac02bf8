"""The DSA Triton kernels compile for sm_90 ahead of time (no GPU needed), at DeepSeek-V3.2's shapes: 64 indexer
heads x 128, latent 512 + 64, bf16 (the interpreter tests in test_triton_sparse_mla.py run them on tiny shapes)."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from kestrel.attention.ops import triton_sparse_mla as ops  # noqa: E402
from tests.attention.test_triton_compile import compile_ok  # noqa: E402


def _sig(fn, ptrs: dict, floats=()):
    return {n: ptrs.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names}


def test_write_index_keys_compiles():
    fn = ops._write_rows_kernel
    compile_ok(fn, _sig(fn, {"X": "*bf16", "C": "*bf16", "SLOT": "*i64"}), dict(D=128, D_PAD=128, PAGE=16))


@pytest.mark.parametrize("visible_only", [False, True])  # True: the CUDA-graph path
@pytest.mark.parametrize("heads", [32, 64])
def test_indexer_scores_compiles(heads, visible_only):
    fn = ops._indexer_scores_kernel
    ptrs = {"Q": "*bf16", "W": "*fp32", "K": "*bf16", "KS": "*bf16", "BT": "*i32", "REQ": "*i32", "QPOS": "*i32",
            "S": "*fp32"}
    compile_ok(fn, _sig(fn, ptrs), dict(D=128, H_PAD=heads, PAGE=16, BLOCK_N=64, UPCAST=False, KEY_FP8=False,
                                        FP8_DOT=False, VISIBLE_ONLY=visible_only, FIRST_HIST=False))


def _spill_bytes(fn, sig: dict, constexprs: dict, num_warps: int, num_stages: int) -> int:
    """ptxas -v's spill stores (bytes a thread) of fn compiled for sm_90 as a launch specializes it: pointers and
    strides divisible by 16."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from tests.attention.test_triton_compile import TARGET

    sig = {**sig, **{name: "constexpr" for name in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name].startswith("*") or name.startswith("stride_")}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=TARGET,
                            options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        info = subprocess.run([get_ptxas(90).path, "-v", "-arch=sm_90a", f"{tmp}/k.ptx", "-o", f"{tmp}/k.o"],
                              capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", info))


SPARSE_PTRS = {"QL": "*bf16", "QP": "*bf16", "C": "*bf16", "BT": "*i32", "REQ": "*i32", "IDX": "*i32", "O": "*bf16",
               "PO": "*fp32", "PLSE": "*fp32"}


@pytest.mark.parametrize("tokens", [1, 16, 64, 256])
def test_sparse_mla_default_tiles_do_not_spill(tokens):
    """default_sparse_config's tile at DeepSeek's 512 + 64 keeps the [16 x 512] accumulator and a latent tile in
    registers (64-token tiles on 4 warps, the first guess above 16 tokens, spilled 248 bytes a thread)."""
    cfg = ops.default_sparse_config(tokens)
    fn = ops._sparse_mla_kernel
    constexprs = dict(L=512, R=64, PAGE=16, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], SPLIT=tokens < 132,
                      UPCAST=False)
    assert _spill_bytes(fn, _sig(fn, SPARSE_PTRS, ("qk_scale",)), constexprs, cfg["num_warps"],
                        cfg["num_stages"]) == 0


@pytest.mark.parametrize("split", [True, False])
def test_sparse_mla_compiles(split):
    fn = ops._sparse_mla_kernel
    ptrs = {"QL": "*bf16", "QP": "*bf16", "C": "*bf16", "BT": "*i32", "REQ": "*i32", "IDX": "*i32", "O": "*bf16",
            "PO": "*fp32", "PLSE": "*fp32"}
    compile_ok(fn, _sig(fn, ptrs, ("qk_scale",)), dict(L=512, R=64, PAGE=16, BLOCK_H=16, BLOCK_N=64, SPLIT=split,
                                                      UPCAST=False), num_warps=8)


def test_fp8_index_key_write_compiles():
    fn = ops._write_rows_kernel
    compile_ok(fn, _sig(fn, {"X": "*fp8e4nv", "C": "*fp8e4nv", "SLOT": "*i64"}), dict(D=128, D_PAD=128, PAGE=16))
    compile_ok(fn, _sig(fn, {"X": "*fp32", "C": "*fp32", "SLOT": "*i64"}), dict(D=1, D_PAD=1, PAGE=16))  # scales


@pytest.mark.parametrize("fp8_dot", [False, True])  # True: the float8 tiles straight into the FP8 MMA (QGMMA)
@pytest.mark.parametrize("heads", [32, 64])
def test_indexer_scores_fp8_keys_compiles(heads, fp8_dot):
    fn = ops._indexer_scores_kernel
    ptrs = {"Q": "*fp8e4nv", "W": "*fp32", "K": "*fp8e4nv", "KS": "*fp32", "BT": "*i32", "REQ": "*i32",
            "QPOS": "*i32", "S": "*fp32"}
    for visible_only in (False, True):
        compile_ok(fn, _sig(fn, ptrs), dict(D=128, H_PAD=heads, PAGE=16, BLOCK_N=64, UPCAST=False, KEY_FP8=True,
                                            FP8_DOT=fp8_dot, VISIBLE_ONLY=visible_only, FIRST_HIST=False))


@pytest.mark.parametrize("key_fp8", [False, True])
@pytest.mark.parametrize("visible_only", [False, True])
def test_indexer_scores_with_first_radix_pass_compiles_without_spills(visible_only, key_fp8):
    """The scores kernel that also makes the radix select's first histogram pass (select_topk's
    first_pass_in_scores): 64 heads, as indexer_scores launches it (4 warps, 3 stages), nothing spilled."""
    fn = ops._indexer_scores_kernel
    dt = "*fp8e4nv" if key_fp8 else "*bf16"
    ptrs = {"Q": dt, "W": "*fp32", "K": dt, "KS": "*fp32" if key_fp8 else dt, "BT": "*i32", "REQ": "*i32",
            "QPOS": "*i32", "S": "*fp32", "HIST": "*i32"}
    constexprs = dict(D=128, H_PAD=64, PAGE=16, BLOCK_N=64, UPCAST=False, KEY_FP8=key_fp8, FP8_DOT=False,
                      VISIBLE_ONLY=visible_only, FIRST_HIST=True)
    assert _spill_bytes(fn, _sig(fn, ptrs), constexprs, 4, 3) == 0


@pytest.mark.parametrize("first_done", [False, True])  # True: the first pass's histogram made by the scores kernel
@pytest.mark.parametrize("has_last", [False, True])  # True: per-row lengths on the device (CUDA graphs)
def test_radix_topk_compiles(has_last, first_done):
    from kestrel.attention.ops import triton_topk

    fn = triton_topk._radix_topk_kernel
    compile_ok(fn, _sig(fn, {"S": "*fp32", "OUT": "*i32", "LAST": "*i32", "HIST": "*i32"}),
               dict(BLOCK=1024, HAS_LAST=has_last, FIRST_DONE=first_done))


@pytest.mark.parametrize("has_last", [False, True])
@pytest.mark.parametrize("block", [256, 1024])
def test_split_radix_topk_compiles(has_last, block):
    """The split select's four histogram passes (atomics into the row's histogram) and its compaction."""
    from kestrel.attention.ops import triton_topk

    fn = triton_topk._radix_pass_kernel
    ptrs = {"S": "*fp32", "LAST": "*i32", "HIST": "*i32", "SUF": "*i32", "ABOVE": "*i32"}
    for p in range(4):
        compile_ok(fn, _sig(fn, ptrs), dict(PASS=p, BLOCK=block, HAS_LAST=has_last))
    fn = triton_topk._radix_compact_kernel
    compile_ok(fn, _sig(fn, {**ptrs, "OUT": "*i32"}), dict(BLOCK=block, P_PAD=256, HAS_LAST=has_last))


@pytest.mark.parametrize("key_fp8", [False, True])
@pytest.mark.parametrize("rows", [2, 4])
def test_indexer_scores_rows_kernel_compiles_without_spills(rows, key_fp8):
    """Several rows of one request a program (eager prefills, TritonSparseMLAImpl.eager_score_rows): 64 heads x
    128, launched as indexer_scores launches it (8 warps at 128+ query rows, 3 stages), nothing spilled."""
    fn = ops._indexer_scores_rows_kernel
    dt = "*fp8e4nv" if key_fp8 else "*bf16"
    ptrs = {"Q": dt, "W": "*fp32", "K": dt, "KS": "*fp32" if key_fp8 else dt, "BT": "*i32", "REQ": "*i32",
            "QPOS": "*i32", "S": "*fp32", "TILE0": "*i32", "TILE_END": "*i32"}
    constexprs = dict(D=128, H_PAD=64, ROWS=rows, PAGE=16, BLOCK_N=64, UPCAST=False, KEY_FP8=key_fp8, FP8_DOT=False)
    assert _spill_bytes(fn, _sig(fn, ptrs), constexprs, 8, 3) == 0
