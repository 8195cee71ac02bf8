"""The Triton skinny GEMM (decode at batch <= 16) against a float64 reference (skipped without CUDA)."""
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1000, 1400), (151936, 1024), (1024, 3072)])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_skinny_gemm_matches_reference(dtype, n, k, m):
    pytest.importorskip("triton")
    from kestrel.kernels.triton_ops.skinny_gemm import skinny_gemm

    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype)
    ref = x.double() @ w.double().T + b.double()
    for split in (None, 1, 4):  # default, unsplit, split-K with the counter reduction
        out = skinny_gemm(x, w, b, _config=None if split is None else {"SPLIT_K": split})
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (split, err)


def test_split_k_counters_reset_across_graph_replays():
    pytest.importorskip("triton")
    from kestrel.kernels.triton_ops.skinny_gemm import skinny_gemm

    x = torch.randn(2, 3072, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16) * 0.02
    cfg = {"SPLIT_K": 8}
    skinny_gemm(x, w, _config=cfg)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = skinny_gemm(x, w, _config=cfg)
    ref = (x.double() @ w.double().T)
    for _ in range(5):
        x.normal_()
        ref = x.double() @ w.double().T
        g.replay()
        torch.cuda.synchronize()
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_engine_selects_the_skinny_kernel_for_bf16_on_cuda(tmp_path, tiny_tokenizer):
    from kestrel import LLM
    from tests.tiny import make_checkpoint

    path = make_checkpoint("llama", tmp_path, tokenizer=tiny_tokenizer, hidden_size=256, intermediate_size=512)
    llm = LLM(str(path), dtype="bfloat16", progress=False, num_kv_blocks=256)
    names = {m.kernel_name for m in llm.engine.core.runner.model.modules() if hasattr(m, "kernel_name")}
    assert names == {"triton_skinny_dense"}


def _rms_norm_ref(x, weight, eps, residual=None):
    """The fused_ops RMSNorm semantics in float64: (x + residual) rounded to the dtype, normalized, rounded,
    times the weight."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.double()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).double()
    return y * weight.double(), x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(4096, 1024), (6144, 1024), (1000, 1400), (6144, 4096)])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("with_residual", [False, True])
def test_skinny_rms_norm_prologue_matches_reference(dtype, n, k, m, with_residual):
    pytest.importorskip("triton")
    from kestrel.kernels.triton_ops.skinny_gemm import skinny_rms_norm_gemm

    x = torch.randn(m, k, device="cuda", dtype=dtype)
    res = torch.randn(m, k, device="cuda", dtype=dtype) if with_residual else None
    nw = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
    w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(dtype)
    h, new_res = _rms_norm_ref(x, nw, 1e-6, res)
    ref = h @ w.double().T
    for split in (None, 1, 4):
        y, r = skinny_rms_norm_gemm(x, nw, 1e-6, w, residual=res, _config=None if split is None else {"SPLIT_K": split})
        assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2, split
        assert torch.equal(r, new_res)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(1024, 3072), (4096, 14336), (1000, 1400)])
@pytest.mark.parametrize("m", [1, 5, 8])
def test_skinny_silu_mul_prologue_matches_reference(dtype, n, k, m):
    pytest.importorskip("triton")
    from kestrel.kernels.triton_ops.skinny_gemm import skinny_silu_mul_gemm

    gu = torch.randn(m, 2 * k, device="cuda", dtype=dtype)
    w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(dtype)
    g, u = gu.double().chunk(2, dim=-1)
    ref = (g * torch.sigmoid(g) * u) @ w.double().T
    for split in (None, 1, 4):
        y = skinny_silu_mul_gemm(gu, w, _config=None if split is None else {"SPLIT_K": split})
        assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2, split
