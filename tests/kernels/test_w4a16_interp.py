"""The Triton W4A16 GEMM (kestrel/kernels/triton_ops/w4a16_gemm.py) through the triton_w4a16 kernel candidate, on
CUDA or under the Triton interpreter on the CPU (make kernels-check); skipped otherwise. Each format's checkpoint
tensors (GPTQ with and without act-order, AWQ, compressed-tensors group and channel) are loaded into a Linear and
repacked; its output is compared with the dequantised weights' product. fp16 activations: the interpreter
multiplies bf16 as raw bits, and its float32 -> bf16 cast does not round to nearest (checked below), so bf16 scales
(the weights rounded to bf16 in the kernel) get a bf16-sized bound there and the exact bound on CUDA."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402

_ok, _why = gates.triton_runnable()
pytestmark = pytest.mark.skipif(not _ok, reason=_why)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

from kestrel.kernels.w4a16 import TritonW4A16Linear  # noqa: E402
from kestrel.layers.linear import Linear  # noqa: E402
from kestrel.layers.quant import get_quant_config  # noqa: E402
from kestrel.platform import fake_platform  # noqa: E402
from kestrel.platform.testing import use_platform  # noqa: E402
from tests.w4a16_tiny import (awq_pack, ct_act_order, ct_compress, dequantize_4bit, gptq_groups, gptq_pack,  # noqa: E402
                              quantization_config, quantize_4bit)

SIZES = (64, 32, 32)


def _shards(fmt, group, act_order, k, scale_dtype=torch.float16):
    torch.manual_seed(k + (group or 0))
    g_idx = gptq_groups(k, group, act_order, seed=1) if act_order else None
    out = []
    for n in SIZES:
        w = torch.randn(n, k) * 0.08
        if fmt == "ct_w4a16" and act_order:  # one g_idx for q, k, v (they share their input)
            out.append(ct_act_order(w, group, g_idx))
            continue
        if fmt.startswith("ct_"):
            out.append(ct_compress(w, fmt[3:], group, scale_dtype))
            continue
        gi = g_idx if g_idx is not None else gptq_groups(k, group, False)
        u, z, s = quantize_4bit(w, gi, symmetric=fmt == "gptq")
        out.append((gptq_pack(u, z, s, gi) if fmt == "gptq" else awq_pack(u, z, s), dequantize_4bit(u, z, s, gi)))
    return out


@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("fmt,group,act_order,k,bias", [
    ("gptq", 32, False, 128, False), ("gptq", 64, True, 256, True), ("gptq", 128, True, 256, False),
    ("gptq", -1, False, 96, False), ("awq", 32, False, 64, True), ("awq", 128, False, 256, False),
    ("ct_w4a16", 32, False, 128, False), ("ct_w4a16", None, False, 80, True),
    ("ct_w4a16_asym", 64, False, 128, True), ("ct_w4a16", 32, True, 128, False),
])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_triton_w4a16_matches_dequantised(fmt, group, act_order, k, bias, m, scale_dtype):
    if scale_dtype == torch.bfloat16 and not fmt.startswith("ct_"):
        pytest.skip("GPTQ and AWQ scales are fp16")
    qc = get_quant_config({"quantization_config": quantization_config(fmt, group, act_order)}, None, torch.float16)
    with use_platform(fake_platform("sm_90")), torch.device(DEVICE):
        layer = Linear(k, list(SIZES), bias, torch.float16, "model.layers.0.self_attn.qkv_proj", qc)
    assert type(layer.kernel) is TritonW4A16Linear
    shards = _shards(fmt, group, act_order, k, scale_dtype)
    for sid, (tensors, _) in enumerate(shards):
        for name, t in tensors.items():
            layer.load_weight(name, t.to(DEVICE), sid)
    b = torch.randn(sum(SIZES)) * 0.1
    if bias:
        layer.bias.data.copy_(b)
    layer.process_weights_after_loading()
    assert not layer.kernel.dense and (layer.w4_perm is not None) == act_order
    ref_w = torch.cat([d for _, d in shards]).to(torch.float16).double()
    x = torch.randn(m, k).to(torch.float16)
    out = layer(x.to(DEVICE)).cpu()
    ref = x.double() @ ref_w.T + (b.to(torch.float16).double() if bias else 0)
    assert out.dtype == torch.float16 and out.shape == (m, sum(SIZES))
    exact = scale_dtype == torch.float16 or DEVICE == "cuda"  # the interpreter's bf16 cast truncates
    assert ((out.double() - ref).norm() / ref.norm()).item() < (2e-3 if exact else 1e-2)
    assert (out.double() - ref).abs().max().item() < (2e-2 if exact else 5e-2)


def test_interpreter_bf16_cast_is_what_the_bound_allows_for():
    """Why bf16 scales get a looser bound under the interpreter: its float32 -> bf16 cast is not torch's."""
    if DEVICE == "cuda":
        pytest.skip("CUDA casts round to nearest")
    import triton
    import triton.language as tl

    @triton.jit
    def cast(X, Y, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(Y + o, tl.load(X + o).to(tl.bfloat16).to(tl.float32))

    x = torch.randn(64)
    y = torch.empty(64)
    cast[(1,)](x, y, N=64)
    assert not torch.equal(y, x.to(torch.bfloat16).float())
    assert ((y - x).abs() <= x.abs() * 2 ** -7).all()  # within one bf16 ulp


@pytest.mark.parametrize("split_k", [2, 3, 5])
@pytest.mark.parametrize("group", [32, -1])
def test_split_k_matches_one_split(split_k, group):
    """Decode rows with K split over programs (fp32 partials, then a fixed-order sum): the same result as one
    split up to fp32 summation order; bias added once."""
    from kestrel.kernels.triton_ops.w4a16_gemm import w4a16_gemm
    from kestrel.kernels.w4a16_scheme import pack_rows

    k, n, m = 320, 48, 3
    gen = torch.Generator().manual_seed(split_k)
    u = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    groups = 1 if group == -1 else k // group
    z = torch.randint(0, 16, (groups, n), generator=gen, dtype=torch.uint8)
    s = (torch.rand(groups, n, generator=gen) * 0.02).to(torch.float16)
    b = torch.randn(n, generator=gen).to(torch.float16)
    x = torch.randn(m, k, generator=gen).to(torch.float16)
    qw = pack_rows(u).t().contiguous()
    args = [t.to(DEVICE) for t in (x, qw, s, z)]
    one = w4a16_gemm(*args, group, b.to(DEVICE), split_k=1).cpu().double()
    split = w4a16_gemm(*args, group, b.to(DEVICE), split_k=split_k).cpu().double()
    gi = torch.arange(k) // (k if group == -1 else group)
    w = ((u.long().t() - z.long()[gi]).float() * s.float()[gi]).to(torch.float16).double()
    ref = x.double() @ w + b.double()
    for out in (one, split):
        assert ((out - ref).norm() / ref.norm()).item() < 2e-3
    assert (one - split).abs().max().item() < 1e-2


def test_split_k_choice():
    from kestrel.kernels.triton_ops.w4a16_gemm import split_k_for

    assert split_k_for(1, 4096, 14336, 16, 64, 128, 132) == 5  # 64 tiles: ~2 programs an SM (264 / 64)
    assert split_k_for(1, 28672, 4096, 16, 64, 128, 132) == 1  # 448 tiles fill the GPU
    assert split_k_for(64, 4096, 14336, 64, 64, 128, 132) == 1  # prefill rows: no split
    assert split_k_for(1, 64, 256, 16, 64, 128, 132) == 1  # K too short for 4 steps a split
