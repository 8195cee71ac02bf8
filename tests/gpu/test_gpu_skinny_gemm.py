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
    names = {m.kernel_name for m in llm.engine.core.executor.runner.model.modules() if hasattr(m, "kernel_name")}
    assert names == {"triton_skinny_dense"}
