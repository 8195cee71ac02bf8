"""The Triton fused MoE on the GPU against a float64 reference: bf16 experts (relative error norm < 1e-2) and FP8
block-quantized experts (< 2e-2 against the dequantized weights, activations quantized as the kernel does),
across expert counts, top-k and batch sizes including non-multiples of the tiles; CUDA-graph capture; and the
pre-compilation mode (launches become compilations) with garbage inputs raising no device assert."""
import functools

import pytest
import torch

from kestrel.layers.moe import RouterConfig
from tests.kernels.moe_cases import make_experts, quantize_experts, random_routing, reference_moe, rel_err

pytestmark = pytest.mark.gpu
BATCHES = [1, 3, 16, 57, 256, 1000, 4096]


@functools.lru_cache(maxsize=2)
def gpu_experts(e: int, h: int, i: int):
    """bf16 experts made once per shape, on the device (a CPU randn of 128 x 1536 x 2048 takes seconds)."""
    gen = torch.Generator(device="cuda").manual_seed(e + h + i)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * i ** -0.5).bfloat16()
    return w13, w2


@pytest.mark.parametrize("e,k", [(8, 1), (8, 2), (64, 2), (64, 8), (128, 1), (128, 8)])
@pytest.mark.parametrize("t", BATCHES)
def test_triton_moe_bf16_matches_reference(e, k, t):
    pytest.importorskip("triton")
    from kestrel.kernels.triton_ops.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(e * 100 + k * 10 + t)
    h, i = (2048, 768) if e == 128 else (1000, 352)  # Qwen3-30B-A3B's expert shape; a non-multiple shape
    w13, w2 = gpu_experts(e, h, i)
    x = torch.randn(t, h, generator=gen).cuda().bfloat16()
    topk_w, ids = (v.cuda() for v in random_routing(t, e, k, gen, skew=t % 2 == 1))
    out = fused_moe(x, w13, w2, topk_w, ids)
    ref = reference_moe(x.double(), w13, w2, topk_w, ids)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("t", [1, 57, 4096])
def test_triton_moe_gelu_bf16_matches_reference(t):
    """The GELU-tanh epilogue (Gemma 4's experts: 128 experts top-8, 2816 x 704) in bf16."""
    pytest.importorskip("triton")
    from kestrel.kernels.triton_ops.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(t)
    w13, w2 = gpu_experts(128, 2816, 704)
    x = torch.randn(t, 2816, generator=gen).cuda().bfloat16()
    topk_w, ids = (v.cuda() for v in random_routing(t, 128, 8, gen, skew=t % 2 == 1))
    out = fused_moe(x, w13, w2, topk_w, ids, activation="gelu")
    assert rel_err(out, reference_moe(x.double(), w13, w2, topk_w, ids, activation="gelu")) < 1e-2


@pytest.mark.parametrize("e,k", [(8, 2), (64, 8), (128, 8)])
@pytest.mark.parametrize("t", [1, 33, 512, 4096])
def test_triton_moe_fp8_block_matches_dequantized_reference(e, k, t):
    pytest.importorskip("triton")
    from kestrel.kernels.triton_ops.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(e + k + t)
    h, i = 1024, 384
    w13, w2 = make_experts(e, h, i, gen)
    q13, s13, q2, s2, d13, d2 = quantize_experts(w13, w2)
    x = torch.randn(t, h, generator=gen)
    topk_w, ids = random_routing(t, e, k, gen)
    out = fused_moe(x.cuda().bfloat16(), q13.cuda(), q2.cuda(), topk_w.cuda(), ids.cuda(), s13.cuda(), s2.cuda(),
                    (128, 128))
    ref = reference_moe(x.bfloat16().double().cuda(), d13.cuda(), d2.cuda(), topk_w.cuda(), ids.cuda(),
                        act_quant_group=128)
    assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("t", [8, 1100])  # 1100 x 4 slots: the layout's grid path
def test_triton_moe_cuda_graph_replay(t):
    pytest.importorskip("triton")
    from kestrel.kernels.triton_ops.fused_moe import ALIGN_GRID_ABOVE, fused_moe

    assert (t * 4 > ALIGN_GRID_ABOVE) == (t > 8)
    gen = torch.Generator().manual_seed(0)
    w13, w2 = (w.cuda().bfloat16() for w in make_experts(64, 512, 256, gen))
    x = torch.randn(t, 512, device="cuda", dtype=torch.bfloat16)
    topk_w, ids = (v.cuda() for v in random_routing(t, 64, 4, gen))
    fused_moe(x, w13, w2, topk_w, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, topk_w, ids)
    new_w, new_ids = (v.cuda() for v in random_routing(t, 64, 4, gen))
    topk_w.copy_(new_w), ids.copy_(new_ids), x.normal_()
    graph.replay()
    torch.testing.assert_close(out, fused_moe(x, w13, w2, topk_w, ids), rtol=0, atol=0)


ROUTERS = {  # DeepSeek-V3's grouped sigmoid router beside fused shared experts; Gemma 4's softmax router (the
    # fused Triton router, its ids then index per_expert_scale in torch)
    "grouped_sigmoid": (RouterConfig(64, 8, "sigmoid", True, 8, 2, routed_scaling_factor=2.5, correction_bias=True),
                        256),
    "softmax_per_expert_scale": (RouterConfig(64, 8, "softmax", True, per_expert_scale=True), 0),
}


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("t", [40, 500])  # 500 x 10 slots: the layout's grid path
def test_layer_compile_only_mode_is_safe_with_garbage_inputs(t, router):
    """Start-up pre-compilation runs forwards with every Triton launch turned into a compilation, so Triton
    outputs (the router's input, the fused router's ids) are garbage: whatever a torch op indexes with must stay
    in range."""
    pytest.importorskip("triton")
    from kestrel.kernels.triton_ops.precompile import compile_only
    from kestrel.layers.moe import SparseMoeBlock

    cfg, shared = ROUTERS[router]
    block = SparseMoeBlock(prefix="model.layers.0.mlp", hidden_size=256, moe_intermediate_size=128, router=cfg,
                           dtype=torch.bfloat16, shared_intermediate_size=shared).cuda()
    assert block.experts.kernel_name == "triton_fused_moe" and block.fse.fused == bool(shared)
    for p in block.parameters():
        p.data.normal_()
    x = torch.full((t, 256), float("nan"), device="cuda", dtype=torch.bfloat16)
    with compile_only():
        block(x)
    torch.cuda.synchronize()  # a device assert from an out-of-range index would surface here
    y = block(torch.randn(t, 256, device="cuda", dtype=torch.bfloat16))
    assert torch.isfinite(y).all()


def test_triton_block_matches_reference_block():
    pytest.importorskip("triton")
    from kestrel.layers.moe import RouterConfig, SparseMoeBlock

    torch.manual_seed(0)
    kw = dict(prefix="model.layers.0.mlp", hidden_size=512, moe_intermediate_size=256,
              router=RouterConfig(16, 4, "softmax", True), dtype=torch.bfloat16, shared_intermediate_size=512,
              shared_gated=True, shared_name="shared_expert")
    fast = SparseMoeBlock(**kw).cuda()
    ref = SparseMoeBlock(**kw, moe_backend="torch_moe", fuse_shared_experts="off").cuda()
    assert fast.fse.fused and not ref.fse.fused
    for p in fast.parameters():
        p.data.normal_(0, 0.05)
    ref.gate.weight.data.copy_(fast.gate.weight)
    ref.shared_expert_gate.weight.data.copy_(fast.shared_expert_gate.weight)
    ref.experts.w13.data.copy_(fast.experts.w13[:16])
    ref.experts.w2.data.copy_(fast.experts.w2[:16])
    sh = fast.experts.w13[16:]  # two 256-wide chunks -> the 512-wide shared MLP
    ref.shared_expert.gate_up_proj.weight.data.copy_(torch.cat([sh[0, :256], sh[1, :256], sh[0, 256:], sh[1, 256:]]))
    ref.shared_expert.down_proj.weight.data.copy_(torch.cat([fast.experts.w2[16], fast.experts.w2[17]], dim=1))
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    assert rel_err(fast(x), ref(x)) < 1e-2
