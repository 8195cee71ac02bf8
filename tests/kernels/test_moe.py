"""The reference MoE kernel against a per-token loop."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kestrel.kernels import select
from kestrel.kernels.moe import MoESpec, TorchMoE
from kestrel.platform import fake_platform


def naive_moe(x, w13, w2, topk_w, topk_ids, act):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            a = F.silu(gate) * up if act == "silu" else F.gelu(gate, approximate="tanh") * up
            out[t] += topk_w[t, j].double() * (w2[e].double() @ a)
    return out


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_torch_moe_matches_naive(act, dtype, tol):
    e, k, h, i, t = 6, 2, 16, 24, 9
    spec = MoESpec("model.layers.0.mlp.experts", e, k, h, i, dtype, act)
    kernel = select("moe", spec, "torch_moe", fake_platform("cpu"))
    assert type(kernel) is TorchMoE
    layer = nn.Module()
    kernel.create_weights(layer)
    gen = torch.Generator().manual_seed(0)
    layer.w13.data.copy_(torch.randn(e, 2 * i, h, generator=gen) * 0.2)
    layer.w2.data.copy_(torch.randn(e, h, i, generator=gen) * 0.2)
    kernel.process_weights_after_loading(layer)
    x = torch.randn(t, h, generator=gen).to(dtype)
    logits = torch.randn(t, e, generator=gen)
    topk_w, topk_ids = torch.topk(logits.softmax(-1), k, dim=-1)
    y = kernel.apply(layer, x, topk_w, topk_ids)
    ref = naive_moe(x.float(), layer.w13.float(), layer.w2.float(), topk_w, topk_ids, act)
    assert y.shape == (t, h) and y.dtype == dtype
    assert float((y.double() - ref).norm() / ref.norm()) < tol


def test_torch_moe_dense_path_matches_the_sparse_loop():
    """The CUDA path (every expert on every token, no host sync: capturable) equals the CPU loop."""
    spec = MoESpec("experts", 6, 2, 16, 24, torch.float32)
    kernel = select("moe", spec, "torch_moe", fake_platform("cpu"))
    layer = nn.Module()
    kernel.create_weights(layer)
    gen = torch.Generator().manual_seed(1)
    layer.w13.data.copy_(torch.randn(6, 48, 16, generator=gen))
    layer.w2.data.copy_(torch.randn(6, 16, 24, generator=gen))
    x = torch.randn(7, 16, generator=gen)
    topk_w, topk_ids = torch.topk(torch.randn(7, 6, generator=gen).softmax(-1), 2, dim=-1)
    torch.testing.assert_close(kernel.apply_dense(layer, x, topk_w, topk_ids), kernel.apply(layer, x, topk_w, topk_ids),
                               rtol=1e-5, atol=1e-5)


def test_torch_moe_empty_batch():
    spec = MoESpec("experts", 4, 2, 8, 8, torch.float32)
    kernel = select("moe", spec)
    layer = nn.Module()
    kernel.create_weights(layer)
    y = kernel.apply(layer, torch.empty(0, 8), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long))
    assert y.shape == (0, 8)


# ---- selection and the FP8 expert layout (construction and loading run on the CPU for a fake H200)
def _fp8_block_scheme():
    from kestrel.kernels.fp8_scheme import Fp8Scheme

    return Fp8Scheme("block", "group", True, (128, 128), 128, True, "weight_scale_inv", "fp8")


def test_moe_selection_per_platform_dtype_and_quant():
    from kestrel.kernels import KernelSelectionError
    from kestrel.kernels.moe import Fp8DequantMoE, TritonFp8BlockMoE, TritonFusedMoE

    h200 = fake_platform("sm_90", triton_available=True)
    bf16 = MoESpec("model.layers.0.mlp.experts", 128, 8, 2048, 768, torch.bfloat16)
    fp32 = MoESpec("model.layers.0.mlp.experts", 128, 8, 2048, 768, torch.float32)
    fp8 = MoESpec("model.layers.0.mlp.experts", 64, 6, 2048, 1408, torch.bfloat16, quant=_fp8_block_scheme())
    assert type(select("moe", bf16, "auto", h200)) is TritonFusedMoE
    k = select("moe", fp32, "auto", h200)
    assert type(k) is TorchMoE and any(s.startswith("triton_fused_moe:") for s in k.skipped)
    assert type(select("moe", fp8, "auto", h200)) is TritonFp8BlockMoE
    assert type(select("moe", bf16, "auto", fake_platform("cpu"))) is TorchMoE
    assert type(select("moe", fp8, "auto", fake_platform("cpu"))) is Fp8DequantMoE
    with pytest.raises(KernelSelectionError, match="model.layers.0.mlp.experts"):
        select("moe", bf16, "triton_fused_moe", fake_platform("cpu"))
    with pytest.raises(KernelSelectionError, match="model.layers.0.mlp.experts"):  # I = 100: not a multiple of 128
        select("moe", MoESpec("model.layers.0.mlp.experts", 8, 2, 2048, 100, torch.bfloat16,
                              quant=_fp8_block_scheme()), "auto", h200)


def test_fp8_experts_and_fused_shared_expert_load_in_block_layout():
    """Per-expert FP8 checkpoint tensors (weight + weight_scale_inv) land in w13/w2 and their block-scale grids;
    a fused shared expert of 2 x I is split into two slots, scales included."""
    from kestrel.kernels.fp8_quant import quantize_weight_block
    from kestrel.layers.moe import RouterConfig, SparseMoeBlock
    from kestrel.layers.quant import Fp8Config
    from kestrel.platform.testing import use_platform

    h, i, e = 256, 128, 4
    h200 = fake_platform("sm_90", triton_available=True)
    with use_platform(h200):
        block = SparseMoeBlock(prefix="model.layers.1.mlp", hidden_size=h, moe_intermediate_size=i,
                               router=RouterConfig(e, 2, "sigmoid", True, correction_bias=True), dtype=torch.bfloat16,
                               shared_intermediate_size=2 * i, quant_config=Fp8Config(_fp8_block_scheme()),
                               platform=h200)
    assert block.experts.kernel_name == "triton_fp8_block_moe" and block.fse.fused and block.fse.slots == 2
    gen = torch.Generator().manual_seed(0)
    ckpt = {}
    for j in range(e):
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            q, s = quantize_weight_block(torch.randn(*shape, generator=gen))
            ckpt[f"experts.{j}.{proj}.weight"], ckpt[f"experts.{j}.{proj}.weight_scale_inv"] = q, s
    for proj, shape in (("gate_proj", (2 * i, h)), ("up_proj", (2 * i, h)), ("down_proj", (h, 2 * i))):
        q, s = quantize_weight_block(torch.randn(*shape, generator=gen))
        ckpt[f"shared_experts.{proj}.weight"], ckpt[f"shared_experts.{proj}.weight_scale_inv"] = q, s
    for name, t in ckpt.items():
        block.load_weight(name, t, block.fse)
    ex = block.experts
    same = lambda a, b: torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,  # noqa: E731
                                    b.view(torch.uint8) if b.dtype.itemsize == 1 else b)
    assert same(ex.w13[2, :i], ckpt["experts.2.gate_proj.weight"]) and same(ex.w13[2, i:], ckpt["experts.2.up_proj.weight"])
    assert same(ex.w13_scale[3, 1:], ckpt["experts.3.up_proj.weight_scale_inv"])
    assert same(ex.w2_scale[0], ckpt["experts.0.down_proj.weight_scale_inv"])
    for c in range(2):  # shared chunk c: gate/up rows c*i.., their scale rows; down columns and scale columns
        assert same(ex.w13[e + c, :i], ckpt["shared_experts.gate_proj.weight"][c * i:(c + 1) * i])
        assert same(ex.w13_scale[e + c, 1], ckpt["shared_experts.up_proj.weight_scale_inv"][c])
        assert same(ex.w2[e + c], ckpt["shared_experts.down_proj.weight"][:, c * i:(c + 1) * i])
        assert same(ex.w2_scale[e + c], ckpt["shared_experts.down_proj.weight_scale_inv"][:, c:c + 1])
