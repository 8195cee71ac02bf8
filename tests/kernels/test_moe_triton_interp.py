"""The Triton fused MoE's logic (sorting/padding by expert, fused SiLU- or GELU-tanh-and-mul, routing weights in the epilogue,
FP8 block scales, fused shared-expert slots) under the Triton interpreter on the CPU (make kernels-check), or on
CUDA; skipped without triton. fp32/fp16 operands: the interpreter multiplies bf16 as raw bits."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402
from tests.kernels.moe_cases import make_experts, quantize_experts, random_routing, reference_moe, rel_err  # noqa: E402

_ok, _why = gates.triton_runnable()
pytestmark = pytest.mark.skipif(not _ok, reason=_why)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_align_by_expert_layout():
    from kestrel.kernels.triton_ops.fused_moe import align_by_expert, padded_size

    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3]], dtype=torch.int32)
    sorted_ids, block_expert, num_padded = align_by_expert(ids, 8, 4)
    n = ids.numel()
    assert sorted_ids.numel() == padded_size(n, 8, 4) and int(num_padded) == 4 * 4  # experts 0,1,3,5: one block each
    flat = ids.reshape(-1)
    for b in range(int(num_padded) // 4):
        run = sorted_ids[b * 4:(b + 1) * 4]
        real = run[run < n]
        assert (flat[real.long()] == block_expert[b]).all() and (run[len(real):] == n).all()
    assert sorted(sorted_ids[sorted_ids < n].tolist()) == list(range(n))


def _assert_same_layout(got, ref, num_slots, bm):
    """Equal to the torch reference run by run: the order inside an expert's run is free (atomic cursors)."""
    (got_sorted, got_blocks, got_np), (ref_sorted, ref_blocks, ref_np) = [[v.cpu() for v in x] for x in (got, ref)]
    assert int(got_np) == int(ref_np) and got_sorted.shape == ref_sorted.shape
    assert torch.equal(got_blocks, ref_blocks)  # blocks past the padded end included (clamped to the last expert)
    used = int(ref_np) // bm
    for ex in ref_blocks[:used].unique().tolist():
        rows = (ref_blocks[:used] == ex).repeat_interleave(bm)
        rows = torch.cat([rows, torch.zeros(ref_sorted.numel() - rows.numel(), dtype=torch.bool)])
        assert sorted(got_sorted[rows].tolist()) == sorted(ref_sorted[rows].tolist()), ex
    assert (got_sorted[int(ref_np):] == num_slots).all()


@pytest.mark.parametrize("t,e,k,bm", [(1, 128, 8, 16), (37, 16, 3, 16), (300, 8, 2, 64), (40, 64, 8, 32)])
def test_triton_layout_matches_torch_reference(t, e, k, bm):
    from kestrel.kernels.triton_ops.fused_moe import align_by_expert, align_by_expert_triton

    gen = torch.Generator().manual_seed(t + e)
    _, ids = random_routing(t, e, k, gen, skew=True)
    _assert_same_layout(align_by_expert_triton(ids.to(DEVICE), e, bm), align_by_expert(ids, e, bm), t * k, bm)


def _routing(kind: str, t: int, e: int, k: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "skew":
        return random_routing(t, e, k, gen, skew=True)[1]
    if kind == "one_expert":  # every slot to the last expert (the clamp of blocks past the end is that expert)
        return torch.full((t, k), e - 1, dtype=torch.int32)
    used = torch.tensor([x for x in range(e) if x % 3 == 1])  # two experts in three empty, the last one too
    return used[torch.randint(0, used.numel(), (t, k), generator=gen)].to(torch.int32)


@pytest.mark.parametrize("kind", ["skew", "one_expert", "some_empty"])
@pytest.mark.parametrize("bm", [16, 64, 128])
@pytest.mark.parametrize("e", [8, 64, 128, 66])
def test_grid_layout_above_threshold_matches_torch_reference(e, bm, kind):
    """Above ALIGN_GRID_ABOVE slots the layout runs as a grid (several slot chunks, one partial, and blocks)."""
    from kestrel.kernels.triton_ops import fused_moe as fm

    t, k = fm.ALIGN_GRID_ABOVE // 8 + 37, 8
    ids = _routing(kind, t, e, k, torch.Generator().manual_seed(e * bm))
    _assert_same_layout(fm.align_by_expert_triton(ids.to(DEVICE), e, bm), fm.align_by_expert(ids, e, bm), t * k, bm)


@pytest.mark.skipif(DEVICE == "cpu", reason="a prefill-sized layout: too slow for the interpreter")
def test_grid_layout_prefill_size_on_gpu():
    from kestrel.kernels.triton_ops.fused_moe import align_by_expert, align_by_expert_triton

    _, ids = random_routing(16384, 128, 8, torch.Generator().manual_seed(0), skew=True)
    _assert_same_layout(align_by_expert_triton(ids.to(DEVICE), 128, 64), align_by_expert(ids, 128, 64), ids.numel(), 64)


def test_layout_path_is_chosen_by_slot_count(monkeypatch):
    from kestrel.kernels.triton_ops import fused_moe as fm

    launched = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launched.append((self.kernel.fn.__name__, grid))
            return self.kernel[grid]

    for name in ("_align_kernel", "_align_count_kernel", "_align_place_kernel"):
        monkeypatch.setattr(fm, name, Spy(getattr(fm, name)))
    monkeypatch.setattr(fm, "ALIGN_GRID_ABOVE", 64)
    ids = torch.randint(0, 8, (16, 4), dtype=torch.int32, device=DEVICE)
    fm.align_by_expert_triton(ids, 8, 16)  # 64 slots: one program
    assert launched == [("_align_kernel", (1,))]
    launched.clear()
    ids = torch.randint(0, 8, (300, 4), dtype=torch.int32, device=DEVICE)
    _assert_same_layout(fm.align_by_expert_triton(ids, 8, 16), fm.align_by_expert(ids.cpu(), 8, 16), 1200, 16)
    blocks = fm.padded_size(1200, 8, 16) // 16
    assert launched == [("_align_count_kernel", (2,)), ("_align_place_kernel", (2 + triton.cdiv(blocks, 256),))]


FP32_TOL = 3e-3 if DEVICE == "cuda" else 1e-5  # tl.dot takes float32 operands as TF32 on the GPU


@pytest.mark.parametrize("t,e,k", [(1, 8, 1), (5, 8, 2), (37, 16, 3), (70, 8, 8)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.float16, 5e-3)])
def test_fused_moe_matches_reference(t, e, k, dtype, tol):
    from kestrel.kernels.triton_ops.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(t * 31 + e + k)
    h, i = 96, 48  # neither a multiple of the 64-wide tiles
    w13, w2 = make_experts(e, h, i, gen)
    x = torch.randn(t, h, generator=gen)
    topk_w, ids = random_routing(t, e, k, gen, skew=t > 30)
    out = fused_moe(*(v.to(DEVICE, dtype) for v in (x, w13, w2)), topk_w.to(DEVICE), ids.to(DEVICE))
    assert out.dtype == dtype and out.shape == (t, h)
    assert rel_err(out.cpu(), reference_moe(x, w13, w2, topk_w, ids)) < tol


@pytest.mark.parametrize("t,e,k", [(5, 8, 2), (37, 16, 3)])
def test_fused_moe_gelu_epilogue_matches_reference(t, e, k):
    """The GELU-tanh epilogue (Gemma 4's experts) against the float64 reference with F.gelu(approximate="tanh");
    the SiLU epilogue on the same problem misses it (the activation is the one asked for)."""
    from kestrel.kernels.moe import TRITON_MOE_ACTIVATIONS
    from kestrel.kernels.triton_ops.fused_moe import EPILOGUES, fused_moe

    assert tuple(EPILOGUES) == TRITON_MOE_ACTIVATIONS
    gen = torch.Generator().manual_seed(t + e + k)
    h, i = 96, 48
    w13, w2 = make_experts(e, h, i, gen)
    x = torch.randn(t, h, generator=gen) * 2  # gelu and silu part ways away from 0
    topk_w, ids = random_routing(t, e, k, gen)
    args = [v.to(DEVICE) for v in (x, w13, w2, topk_w, ids)]
    ref = reference_moe(x, w13, w2, topk_w, ids, activation="gelu")
    assert rel_err(fused_moe(*args, activation="gelu").cpu(), ref) < FP32_TOL
    assert rel_err(fused_moe(*args).cpu(), ref) > 1e-2


def test_fused_moe_above_grid_threshold_matches_reference(monkeypatch):
    """The GEMMs on the grid path's layout (threshold lowered so a small problem takes it)."""
    from kestrel.kernels.triton_ops import fused_moe as fm

    monkeypatch.setattr(fm, "ALIGN_GRID_ABOVE", 256)
    gen = torch.Generator().manual_seed(3)
    t, e, k, h, i = 300, 8, 4, 32, 16
    w13, w2 = make_experts(e, h, i, gen)
    x = torch.randn(t, h, generator=gen)
    topk_w, ids = random_routing(t, e, k, gen, skew=True)
    out = fm.fused_moe(*(v.to(DEVICE) for v in (x, w13, w2, topk_w, ids)))
    assert rel_err(out.cpu(), reference_moe(x, w13, w2, topk_w, ids)) < FP32_TOL


@pytest.mark.parametrize("t,k", [(1, 2), (37, 4)])
def test_fused_moe_biases_and_swigluoai_match_the_reference_kernel(t, k):
    """gpt-oss's experts: biases before the activation and on each expert's output, the clamped SwiGLU; inputs
    scaled up so that gate and up run past the clamp (+-7). The reference is TorchMoE, which matches transformers."""
    from torch import nn

    from kestrel.kernels.moe import MoESpec, TorchMoE
    from kestrel.kernels.triton_ops.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(t + k)
    e, h, i = 8, 96, 48
    kernel = TorchMoE(MoESpec("experts", e, k, h, i, torch.float32, "swigluoai", bias=True))
    layer = nn.Module()
    kernel.create_weights(layer)
    w13, w2 = make_experts(e, h, i, gen)
    layer.w13.data.copy_(w13 * 4)
    layer.w2.data.copy_(w2)
    layer.w13_bias.data.copy_(torch.randn(e, 2 * i, generator=gen))
    layer.w2_bias.data.copy_(torch.randn(e, h, generator=gen))
    x = torch.randn(t, h, generator=gen)
    topk_w, ids = random_routing(t, e, k, gen)
    assert (x @ layer.w13[0].T).abs().max() > 7
    expect = kernel.apply(layer, x, topk_w, ids.long())
    dev = [v.to(DEVICE) for v in (x, layer.w13, layer.w2, topk_w, ids, layer.w13_bias, layer.w2_bias)]
    out = fused_moe(*dev[:5], w13_bias=dev[5], w2_bias=dev[6], activation="swigluoai")
    assert rel_err(out.cpu(), expect) < FP32_TOL
    plain = fused_moe(*dev[:5], activation="swigluoai")
    assert rel_err(plain.cpu(), expect) > 10 * FP32_TOL
    with pytest.raises(ValueError, match="activation 'relu2' is not one of"):
        fused_moe(*dev[:5], activation="relu2")


@pytest.mark.parametrize("k", [6, 8])
def test_warm_up_compiles_every_variant_a_run_uses(k, monkeypatch):
    """Every (kernel, constexprs, tensor dtypes) a forward of 1..max_tokens tokens launches, with int64 (torch
    router) or int32 (Triton router) ids, is one warm_up launched. Kernels stubbed: only the keys matter."""
    from kestrel.kernels.triton_ops import fused_moe as fm

    launched = set()

    class Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kw):
                dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
                launched.add((self.name, dtypes, tuple(sorted(kw.items()))))
            return launch

    for name in ("_align_kernel", "_align_count_kernel", "_align_place_kernel", "_moe_grouped_gemm_kernel"):
        monkeypatch.setattr(fm, name, Stub(name))
    e, h, i, max_tokens = 64, 32, 16, fm.ALIGN_GRID_ABOVE // k + 700
    w13, w2 = torch.zeros(e, 2 * i, h), torch.zeros(e, h, i)
    fm.warm_up(torch.float32, w13, w2, k, max_tokens)
    warmed = set(launched)
    launched.clear()
    for t in range(1, max_tokens + 1):
        for dt in (torch.int32, torch.int64):
            fm.fused_moe(torch.zeros(t, h), w13, w2, torch.ones(t, k), torch.zeros(t, k, dtype=dt))
    assert {name for name, _, _ in launched} == {"_align_kernel", "_align_count_kernel", "_align_place_kernel",
                                                 "_moe_grouped_gemm_kernel"}
    assert launched <= warmed, sorted(launched - warmed)


def test_fused_moe_shared_expert_slots_equal_a_separate_mlp():
    """Shared experts as extra always-selected slots == routed output + the shared MLP."""
    from kestrel.kernels.triton_ops.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(7)
    t, e, k, h, i, slots = 9, 8, 2, 64, 32, 2
    w13, w2 = make_experts(e + slots, h, i, gen)
    x = torch.randn(t, h, generator=gen)
    topk_w, ids = random_routing(t, e, k, gen)
    ids_all = torch.cat([ids, torch.arange(e, e + slots, dtype=torch.int32).expand(t, slots)], 1)
    w_all = torch.cat([topk_w, torch.ones(t, slots)], 1)
    out = fused_moe(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), w_all.to(DEVICE), ids_all.to(DEVICE)).cpu()
    gate, up = (x.double() @ torch.cat(list(w13[e:].double()), 0).T).split([i, i] * slots, dim=-1)[::2], \
        (x.double() @ torch.cat(list(w13[e:].double()), 0).T).split([i, i] * slots, dim=-1)[1::2]
    shared = sum((torch.nn.functional.silu(g) * u) @ w2[e + c].double().T for c, (g, u) in enumerate(zip(gate, up)))
    ref = reference_moe(x, w13, w2, topk_w, ids) + shared
    assert rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("t,k", [(3, 2), (20, 4)])
def test_fused_moe_fp8_block_matches_dequantized_reference(t, k, monkeypatch):
    from kestrel.kernels.fp8_quant import quantize_per_token_group
    from kestrel.kernels.triton_ops import fused_moe as mod

    if DEVICE == "cpu":  # the interpreter's fp32 -> fp8 cast mis-rounds (triton_interpreter_cases.py): torch's here
        monkeypatch.setattr(mod, "per_token_group_quant_fp8", quantize_per_token_group)
    fused_moe = mod.fused_moe

    gen = torch.Generator().manual_seed(t + k)
    e, h, i = 8, 256, 128
    w13, w2 = make_experts(e, h, i, gen)
    q13, s13, q2, s2, d13, d2 = quantize_experts(w13, w2)
    x = torch.randn(t, h, generator=gen)
    topk_w, ids = random_routing(t, e, k, gen)
    dt = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    out = fused_moe(x.to(DEVICE, dt), q13.to(DEVICE), q2.to(DEVICE), topk_w.to(DEVICE), ids.to(DEVICE),
                    s13.to(DEVICE), s2.to(DEVICE), (128, 128))
    ref = reference_moe(x.to(dt).float(), d13, d2, topk_w, ids, act_quant_group=128, act_dtype=dt)
    assert rel_err(out.cpu(), ref) < 2e-2


@pytest.mark.parametrize("t,e,k,renorm,shared,gated", [(1, 128, 8, True, 0, False), (33, 60, 4, False, 0, False),
                                                        (7, 64, 6, False, 2, False), (5, 8, 2, True, 1, True)])
def test_topk_softmax_router_matches_select_experts(t, e, k, renorm, shared, gated):
    """The one-launch softmax router (weights, ids, fused shared-expert slots) equals select_experts + the torch
    shared-slot concatenation that the router runs off CUDA."""
    from kestrel.kernels.triton_ops.fused_ops import moe_topk_softmax
    from kestrel.layers.moe.router import RouterConfig, select_experts

    gen = torch.Generator().manual_seed(t * e)
    logits = torch.randn(t, e, generator=gen).to(DEVICE)
    gate = torch.randn(t, 1, generator=gen).to(DEVICE) if gated else None
    cfg = RouterConfig(num_experts=e, top_k=k, renormalize=renorm, routed_scaling_factor=1.5)
    w_ref, ids_ref = select_experts(logits, cfg)
    w, ids = moe_topk_softmax(logits, k, renorm, 1.5, shared, gate)
    assert w.shape == ids.shape == (t, k + shared)
    assert torch.equal(ids[:, :k].long().sort(dim=1).values, ids_ref.sort(dim=1).values)
    order = ids_ref.argsort(dim=1)  # compare weights expert by expert
    w_k = w[:, :k].gather(1, ids[:, :k].long().argsort(dim=1))
    torch.testing.assert_close(w_k, w_ref.gather(1, order), rtol=1e-5, atol=1e-6)
    if shared:
        assert (ids[:, k:] == torch.arange(e, e + shared, device=DEVICE)).all()
        want = torch.sigmoid(gate).expand(t, shared) if gated else torch.ones(t, shared, device=DEVICE)
        torch.testing.assert_close(w[:, k:], want.float())


def test_topk_softmax_router_ids_stay_valid_on_nan_rows():
    """A row of NaN logits (a CUDA-graph padding row's garbage) or one NaN among finite ones: every id is a valid
    expert index (an id of E made a per-expert lookup assert on the device: Gemma 4's per_expert_scale), and the
    finite row keeps its best finite experts."""
    from kestrel.kernels.triton_ops.fused_ops import moe_topk_softmax

    logits = torch.tensor([[float("nan")] * 4, [0.5, float("nan"), 2.0, 1.0]], device=DEVICE)
    w, ids = moe_topk_softmax(logits, 2, True)
    assert ((ids >= 0) & (ids < 4)).all()
    assert sorted(ids[1].tolist()) == [2, 3]

