"""Every Triton kernel compiles for sm_90 (ahead of time, no GPU needed: Triton ships ptxas).

Catches what the CPU cannot run (the Triton interpreter of triton 3.6 fails on these kernels' loops): type
errors, shadowed names across branches, bad constexpr use. Needs `pip install triton` (not in CI: 1 GB)."""
from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kestrel.attention.ops import triton_attention
from kestrel.attention.ops import triton_mla  # noqa: E402
from kestrel.kernels.triton_ops import fused_ops  # noqa: E402
from kestrel.kernels.triton_ops import skinny_gemm  # noqa: E402
from kestrel.worker import triton_sampling  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_ok(fn, sig, constexprs, num_warps=4):
    if "PDL" in fn.arg_names:  # programmatic dependent launch: griddepcontrol needs sm_90, the target here
        constexprs = {**constexprs, "PDL": True}
    if "CHUNKED" in fn.arg_names:  # chunked local attention: off unless asked
        constexprs = {"CHUNKED": False, **constexprs}
    if "SINKS" in fn.arg_names:  # attention sinks: off unless asked
        constexprs = {"SINKS": False, **constexprs}
    for name, value in constexprs.items():
        sig[name] = "constexpr"
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    kernel = triton.compile(src, target=TARGET, options={"num_warps": num_warps})
    assert kernel.asm.get("ptx")


@pytest.mark.parametrize("has_norm", [True, False])
@pytest.mark.parametrize("d,hq,hkv", [(64, 4, 2), (128, 16, 8), (256, 8, 1)])
def test_qk_norm_rope_cache_compiles(has_norm, d, hq, hkv):
    fn = fused_ops._qk_norm_rope_cache_kernel
    ptrs = {n: "*bf16" for n in ("QKV", "QW", "KW", "QO", "KC", "VC")} | {"CS": "*fp32", "POS": "*i64", "SLOT": "*i64"}
    sig = {n: ptrs.get(n, "fp32" if n == "eps" else "i32") for n in fn.arg_names}
    compile_ok(fn, sig, dict(HEAD_DIM=d, HALF=d // 2, HQ_PAD=triton.next_power_of_2(hq),
                             HKV_PAD=triton.next_power_of_2(hkv), HAS_NORM=has_norm, PAGE=16, FP8_MAX=0.0))


FLOAT_ARGS = ("qk_scale", "cap_log2")
# an FP8 KV cache's per-tensor scales (unused at FP8_MAX=0.0) and the per-head sink logits (unused unless SINKS)
SCALES = {"KS": "*fp32", "VS": "*fp32", "SINK": "*fp32"}
# (WINDOWED, SOFTCAP): full attention, Gemma 3's sliding layers, Gemma 2 (both)
OPTIONS = [(False, False), (True, False), (True, True)]


@pytest.mark.parametrize("windowed,softcap", OPTIONS)
@pytest.mark.parametrize("split,fused_reduce", [(True, True), (True, False), (False, False)])
def test_decode_kernels_compile(split, fused_reduce, windowed, softcap):
    fn = triton_attention._decode_kernel
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "BT": "*i32", "SL": "*i32", "O": "*bf16", "PO": "*fp32",
            "PLSE": "*fp32", "CNT": "*i32", **SCALES}
    sig = {n: ptrs.get(n, "fp32" if n in FLOAT_ARGS else "i32") for n in fn.arg_names}
    compile_ok(fn, sig, dict(HEAD_DIM=128, G_PAD=16, PAGE=16, BLOCK_N=64, SPLIT=split, USE_DOT=True, UPCAST=False,
                             FUSED_REDUCE=fused_reduce, MAX_SPLITS=triton_attention.MAX_SPLITS,
                             WINDOWED=windowed, SOFTCAP=softcap, FP8_MAX=0.0))
    fn = triton_attention._decode_reduce_kernel
    sig = {n: {"PO": "*fp32", "PLSE": "*fp32", "O": "*bf16", "SL": "*i32"}.get(n, "i32") for n in fn.arg_names}
    compile_ok(fn, sig, dict(MAX_SPLITS=triton_attention.MAX_SPLITS, HEAD_DIM=128, BLOCK_N=64, WINDOWED=windowed))


@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("split", [True, False])
def test_sink_kernels_compile(split, windowed):
    """gpt-oss: attention sinks on its sliding (128) and full layers, head dim 64, 8 query heads a KV head."""
    fn = triton_attention._decode_kernel
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "BT": "*i32", "SL": "*i32", "O": "*bf16", "PO": "*fp32",
            "PLSE": "*fp32", "CNT": "*i32", **SCALES}
    sig = {n: ptrs.get(n, "fp32" if n in FLOAT_ARGS else "i32") for n in fn.arg_names}
    compile_ok(fn, sig, dict(HEAD_DIM=64, G_PAD=16, PAGE=16, BLOCK_N=64, SPLIT=split, USE_DOT=True, UPCAST=False,
                             FUSED_REDUCE=split, MAX_SPLITS=triton_attention.MAX_SPLITS, WINDOWED=windowed,
                             SOFTCAP=False, FP8_MAX=0.0, SINKS=True))
    fn = triton_attention._prefill_kernel
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "BT": "*i32", "QSL": "*i32", "SL": "*i32", "O": "*bf16",
            **SCALES}
    sig = {n: ptrs.get(n, "fp32" if n in FLOAT_ARGS else "i32") for n in fn.arg_names}
    compile_ok(fn, sig, dict(HEAD_DIM=64, PAGE=16, BLOCK_M=64 if split else 16, BLOCK_N=64,
                             SEARCH_ITERS=triton_attention._search_iters(256), UPCAST=False, WINDOWED=windowed,
                             SOFTCAP=False, Q_DIM=64, O_DIM=64, FP8_MAX=0.0, SINKS=True))


@pytest.mark.parametrize("split,num_warps", [(True, 4), (False, 8)])
def test_mla_decode_kernel_compiles(split, num_warps):
    """At DeepSeek's latent dims (512 + 64) with the default tile: the [16 x 512] accumulator and the latent tiles
    must fit the registers and shared memory of sm_90."""
    fn = triton_mla._mla_decode_kernel
    ptrs = {"QL": "*bf16", "QP": "*bf16", "C": "*bf16", "BT": "*i32", "SL": "*i32", "O": "*bf16", "PO": "*fp32",
            "PLSE": "*fp32"}
    sig = {n: ptrs.get(n, "fp32" if n == "qk_scale" else "i32") for n in fn.arg_names}
    compile_ok(fn, sig, dict(L=512, R=64, PAGE=16, BLOCK_H=16, BLOCK_N=32, SPLIT=split, UPCAST=False),
               num_warps=num_warps)
    fn = triton_mla._mla_reduce_kernel
    sig = {n: {"PO": "*fp32", "PLSE": "*fp32", "O": "*bf16", "SL": "*i32"}.get(n, "i32") for n in fn.arg_names}
    compile_ok(fn, sig, dict(MAX_SPLITS=64, L=512, BLOCK_N=32))
    fn = triton_mla._write_latent_kernel
    sig = {n: {"KVC": "*bf16", "KPE": "*bf16", "C": "*bf16", "SLOT": "*i64"}.get(n, "i32") for n in fn.arg_names}
    compile_ok(fn, sig, dict(L=512, R=64, L_PAD=512, R_PAD=64, PAGE=16))


@pytest.mark.parametrize("windowed,softcap", OPTIONS)
@pytest.mark.parametrize("block_m,block_n,page", [(16, 64, 16), (64, 64, 16), (64, 32, 64)])
def test_prefill_kernel_compiles(block_m, block_n, page, windowed, softcap):
    fn = triton_attention._prefill_kernel
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "BT": "*i32", "QSL": "*i32", "SL": "*i32", "O": "*bf16",
            **SCALES}
    sig = {n: ptrs.get(n, "fp32" if n in FLOAT_ARGS else "i32") for n in fn.arg_names}
    compile_ok(fn, sig, dict(HEAD_DIM=128, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
                             SEARCH_ITERS=triton_attention._search_iters(256), UPCAST=False,
                             WINDOWED=windowed, SOFTCAP=softcap, Q_DIM=128, O_DIM=128, FP8_MAX=0.0))


def test_mla_dense_prefill_kernels_compile():
    """DeepSeek's dense prefill: expand_kv at 128 + 64 / 128 into 256-dim rows, and the prefill with a 192-dim
    query and 128-dim output over them."""
    fn = triton_mla._expand_kv_kernel
    sig = {n: {"KN": "*bf16", "KPE": "*bf16", "VS": "*bf16", "ROWS": "*i64", "K": "*bf16", "V": "*bf16"}.get(n, "i32")
           for n in fn.arg_names}
    compile_ok(fn, sig, dict(NOPE=128, R=64, VD=128, D=256, BLOCK_H=16))
    fn = triton_attention._prefill_kernel
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "BT": "*i32", "QSL": "*i32", "SL": "*i32", "O": "*bf16",
            **SCALES}
    sig = {n: ptrs.get(n, "fp32" if n in FLOAT_ARGS else "i32") for n in fn.arg_names}
    compile_ok(fn, sig, dict(HEAD_DIM=256, PAGE=16, BLOCK_M=64, BLOCK_N=32, SEARCH_ITERS=8, UPCAST=False,
                             WINDOWED=False, SOFTCAP=False, Q_DIM=192, O_DIM=128, FP8_MAX=0.0))


# the float8 cache dtypes as Triton names them, with their largest values
FP8_CACHES = [("fp8e4nv", 448.0), ("fp8e5", 57344.0)]


@pytest.mark.parametrize("cache,fp8_max", FP8_CACHES)
@pytest.mark.parametrize("windowed", [False, True])
def test_fp8_kv_cache_kernels_compile(cache, fp8_max, windowed):
    """--kv-cache-dtype fp8 / fp8_e5m2: the cache writes quantise into, decode and prefill read, float8 caches."""
    c = "*" + cache
    fn = triton_attention._reshape_and_cache_kernel
    ptrs = {"KEY": "*bf16", "VALUE": "*bf16", "KC": c, "VC": c, "SLOT": "*i64", **SCALES}
    compile_ok(fn, {n: ptrs.get(n, "i32") for n in fn.arg_names},
               dict(HEAD_DIM=128, H_PAD=8, PAGE=16, FP8_MAX=fp8_max))
    fn = fused_ops._qk_norm_rope_cache_kernel
    ptrs = {n: "*bf16" for n in ("QKV", "QW", "KW", "QO")} | {"KC": c, "VC": c, "CS": "*fp32", "POS": "*i64",
                                                              "SLOT": "*i64", **SCALES}
    compile_ok(fn, {n: ptrs.get(n, "fp32" if n == "eps" else "i32") for n in fn.arg_names},
               dict(HEAD_DIM=128, HALF=64, HQ_PAD=16, HKV_PAD=8, HAS_NORM=True, PAGE=16, FP8_MAX=fp8_max))
    fn = triton_attention._decode_kernel
    ptrs = {"Q": "*bf16", "K": c, "V": c, "BT": "*i32", "SL": "*i32", "O": "*bf16", "PO": "*fp32",
            "PLSE": "*fp32", "CNT": "*i32", **SCALES}
    compile_ok(fn, {n: ptrs.get(n, "fp32" if n in FLOAT_ARGS else "i32") for n in fn.arg_names},
               dict(HEAD_DIM=128, G_PAD=16, PAGE=16, BLOCK_N=64, SPLIT=True, USE_DOT=True, UPCAST=False,
                    FUSED_REDUCE=True, MAX_SPLITS=triton_attention.MAX_SPLITS, WINDOWED=windowed, SOFTCAP=False,
                    FP8_MAX=fp8_max))
    fn = triton_attention._prefill_kernel
    ptrs = {"Q": "*bf16", "K": c, "V": c, "BT": "*i32", "QSL": "*i32", "SL": "*i32", "O": "*bf16", **SCALES}
    compile_ok(fn, {n: ptrs.get(n, "fp32" if n in FLOAT_ARGS else "i32") for n in fn.arg_names},
               dict(HEAD_DIM=128, PAGE=16, BLOCK_M=64, BLOCK_N=64, SEARCH_ITERS=8, UPCAST=False, WINDOWED=windowed,
                    SOFTCAP=False, Q_DIM=128, O_DIM=128, FP8_MAX=fp8_max))


def _ptx(fn, ptrs, consts):
    consts = {"CHUNKED": False, **consts} if "CHUNKED" in fn.arg_names else consts
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in FLOAT_ARGS else "i32") for n in fn.arg_names}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=TARGET,
                          options={"num_warps": 4}).asm["ptx"]


def _reads_param(fn, consts, ptx, name):
    """Whether the kernel loads run-time argument `name` (PTX numbers the non-constexpr arguments in order)."""
    consts = {"CHUNKED": False, **consts} if "CHUNKED" in fn.arg_names else consts
    index = [n for n in fn.arg_names if n not in consts].index(name)
    return f"_param_{index}]" in ptx


@pytest.mark.parametrize("kernel", ["prefill", "decode"])
def test_full_attention_never_reads_the_window_or_the_cap(kernel):
    """WINDOWED=False / SOFTCAP=False: the run-time window and cap arguments are dead (the full-attention path
    pays nothing for them); with the flags on, they are read."""
    if kernel == "prefill":
        fn = triton_attention._prefill_kernel
        ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "BT": "*i32", "QSL": "*i32", "SL": "*i32", "O": "*bf16",
                **SCALES}
        consts = dict(HEAD_DIM=128, PAGE=16, BLOCK_M=64, BLOCK_N=64, SEARCH_ITERS=8, UPCAST=False, Q_DIM=128,
                      O_DIM=128, FP8_MAX=0.0)
    else:
        fn = triton_attention._decode_kernel
        ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "BT": "*i32", "SL": "*i32", "O": "*bf16", "PO": "*fp32",
                "PLSE": "*fp32", "CNT": "*i32", **SCALES}
        consts = dict(HEAD_DIM=128, G_PAD=16, PAGE=16, BLOCK_N=64, SPLIT=True, USE_DOT=True, UPCAST=False,
                      FUSED_REDUCE=True, MAX_SPLITS=triton_attention.MAX_SPLITS, PDL=False, FP8_MAX=0.0)
    for on in (False, True):
        c = {**consts, "WINDOWED": on, "SOFTCAP": on}
        ptx = _ptx(fn, ptrs, c)
        assert _reads_param(fn, c, ptx, "window") == on
        assert _reads_param(fn, c, ptx, "cap_log2") == on
        assert _reads_param(fn, c, ptx, "qk_scale")  # the check itself sees parameter reads
        # a cache in the model's dtype (FP8_MAX=0.0) never loads the float8 scales' pointers
        assert not _reads_param(fn, c, ptx, "KS") and not _reads_param(fn, c, ptx, "VS")
    c = {**consts, "WINDOWED": False, "SOFTCAP": False, "FP8_MAX": 448.0}
    ptrs = {**ptrs, "K": "*fp8e4nv", "V": "*fp8e4nv"}
    ptx = _ptx(fn, ptrs, c)
    assert _reads_param(fn, c, ptx, "KS") and _reads_param(fn, c, ptx, "VS")


@pytest.mark.parametrize("split", [1, 4])
def test_skinny_gemm_compiles(split):
    fn = skinny_gemm._skinny_gemm_kernel
    ptrs = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "WS": "*fp32", "CNT": "*i32"}
    sig = {n: ptrs.get(n, "i32") for n in fn.arg_names}
    compile_ok(fn, sig, dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=split))


def test_gumbel_sampler_compiles():
    fn = triton_sampling._gumbel_argmax_kernel
    ptrs = {"LOGITS": "*bf16", "INV_TEMP": "*fp32", "SEEDS": "*i64", "PART_VAL": "*fp32", "PART_IDX": "*i32"}
    sig = {n: ptrs.get(n, "i32") for n in fn.arg_names}
    compile_ok(fn, sig, dict(BLOCK=1024))


@pytest.mark.parametrize("norm,residual,silu", [(False, False, False), (True, False, False), (True, True, False),
                                                (True, True, True)])
def test_gemv_compiles(norm, residual, silu):
    from kestrel.kernels.triton_ops import gemv

    fn = gemv._gemv_kernel
    ptrs = {n: "*bf16" for n in ("X", "W", "Y", "R", "NW", "RO")}
    sig = {n: ptrs.get(n, "fp32" if n == "eps" else "i32") for n in fn.arg_names}
    compile_ok(fn, sig, dict(BLOCK_N=4, BLOCK_K=1024, NORM=norm, HAS_RESIDUAL=residual, SILU_OUT=silu))


def test_chunked_attention_kernels_compile():
    """CHUNKED (Llama 4's chunked local attention: the window argument holds the chunk size): decode (split, with
    the separate reduce) and prefill."""
    fn = triton_attention._decode_kernel
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "BT": "*i32", "SL": "*i32", "O": "*bf16", "PO": "*fp32",
            "PLSE": "*fp32", "CNT": "*i32", **SCALES}
    compile_ok(fn, {n: ptrs.get(n, "fp32" if n in FLOAT_ARGS else "i32") for n in fn.arg_names},
               dict(HEAD_DIM=128, G_PAD=16, PAGE=16, BLOCK_N=64, SPLIT=True, USE_DOT=True, UPCAST=False,
                    FUSED_REDUCE=False, MAX_SPLITS=triton_attention.MAX_SPLITS, WINDOWED=True, SOFTCAP=False,
                    FP8_MAX=0.0, CHUNKED=True))
    fn = triton_attention._decode_reduce_kernel
    sig = {n: {"PO": "*fp32", "PLSE": "*fp32", "O": "*bf16", "SL": "*i32"}.get(n, "i32") for n in fn.arg_names}
    compile_ok(fn, sig, dict(MAX_SPLITS=triton_attention.MAX_SPLITS, HEAD_DIM=128, BLOCK_N=64, WINDOWED=True,
                             CHUNKED=True))
    fn = triton_attention._prefill_kernel
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "BT": "*i32", "QSL": "*i32", "SL": "*i32", "O": "*bf16",
            **SCALES}
    compile_ok(fn, {n: ptrs.get(n, "fp32" if n in FLOAT_ARGS else "i32") for n in fn.arg_names},
               dict(HEAD_DIM=128, PAGE=16, BLOCK_M=64, BLOCK_N=64, SEARCH_ITERS=8, UPCAST=False, WINDOWED=True,
                    SOFTCAP=False, Q_DIM=128, O_DIM=128, FP8_MAX=0.0, CHUNKED=True))


def test_head_dim_512_default_tiles_do_not_spill():
    """Heads of 512 (Gemma 4's global layers) at the launchers' default tiles compile for sm_90 without spills:
    prefill 32 x 32 on 8 warps (32 x 32 on 4 warps spilled 180 bytes a thread, 64 x 32 on 8 warps 132), decode
    32-token tiles on 4 warps, the split merge."""
    from tests.attention.test_triton_sparse_mla_compile import _spill_bytes

    def spills(fn, ptrs, constexprs, warps, stages):
        sig = {n: ptrs.get(n, "fp32" if n in FLOAT_ARGS else "i32") for n in fn.arg_names}
        defaults = {"PDL": True} if "PDL" in fn.arg_names else {}
        defaults.update({k: False for k in ("CHUNKED", "SINKS") if k in fn.arg_names})
        return _spill_bytes(fn, sig, {**defaults, **constexprs}, warps, stages)

    pf = triton_attention._default_prefill_config(512, None)
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "BT": "*i32", "QSL": "*i32", "SL": "*i32", "O": "*bf16",
            **SCALES}
    assert spills(triton_attention._prefill_kernel, ptrs,
                  dict(HEAD_DIM=512, PAGE=16, BLOCK_M=pf["BLOCK_M"], BLOCK_N=pf["BLOCK_N"], SEARCH_ITERS=8,
                       UPCAST=False, WINDOWED=False, SOFTCAP=False, Q_DIM=512, O_DIM=512, FP8_MAX=0.0),
                  pf["num_warps"], pf["num_stages"]) == 0
    dc = triton_attention._default_decode_config(512, 8, 16)
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "BT": "*i32", "SL": "*i32", "O": "*bf16", "PO": "*fp32",
            "PLSE": "*fp32", "CNT": "*i32", **SCALES}
    assert spills(triton_attention._decode_kernel, ptrs,
                  dict(HEAD_DIM=512, G_PAD=16, PAGE=16, BLOCK_N=dc["BLOCK_N"], SPLIT=True, USE_DOT=True,
                       UPCAST=False, FUSED_REDUCE=True, MAX_SPLITS=triton_attention.MAX_SPLITS, WINDOWED=False,
                       SOFTCAP=False, FP8_MAX=0.0), dc["num_warps"], dc["num_stages"]) == 0


@pytest.mark.parametrize("word", ["*i32", "*u8"])
def test_kv_row_copy_compiles(word):
    from kestrel.kernels.triton_ops import kv_rows
    fn = kv_rows._copy_rows_kernel
    sig = {"DST": word, "SRC": word, "DST_IDS": "*i64", "SRC_IDS": "*i64", "row_words": "i32"}
    compile_ok(fn, sig, dict(BLOCK=kv_rows.BLOCK))
