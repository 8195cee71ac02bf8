"""The Triton DSA kernels with FP8 indexer keys (float8 e4m3 keys + a float32 scale per token, fp8 queries with
their scales in w: kestrel/attention/indexer_keys.py) against the PyTorch reference: the key write into the layer's
real page views, the scores and the chunked top-k, and the two impls on one step. On CUDA (bf16 model: scores
relative error < 1e-2, top-k recall >= 0.99, both read the same fp8 values) or on the CPU under the Triton
interpreter (TRITON_INTERPRET=1, float32: exact sets)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402

_ok, _why = gates.triton_runnable()
pytestmark = pytest.mark.skipif(not _ok, reason=_why)

from kestrel.attention.backends.torch_sparse_mla import (index_scores_ref, select_topk_ref,  # noqa: E402
                                                         write_index_keys_ref)
from kestrel.attention.indexer_keys import (dequantize_index_keys, quantize_index_keys,  # noqa: E402
                                            quantize_index_queries)
from kestrel.core.kv_spec import SparseMLASpec  # noqa: E402
from tests.attention.test_triton_sparse_mla import QL, SEQ, _case, _dev, assert_same_selection  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
FP8 = torch.float8_e4m3fn


def _fp8_case(seed, heads=16, dim=32, page=16):
    """_case's paged keys quantized into a (keys, scales) cache, and fp8 queries with their weights."""
    gen = torch.Generator().manual_seed(seed)
    cache, bt, qsl, req, pos = _case(SEQ, QL, page, dim, gen)
    k8, ks = quantize_index_keys(cache.view(-1, dim).to(DTYPE))
    q8, w8 = quantize_index_queries(torch.randn(qsl[-1], heads, dim, generator=gen).to(DTYPE),
                                    torch.rand(qsl[-1], heads, generator=gen) * 0.2)
    return (k8.view(cache.shape), ks.view(*cache.shape[:2], 1)), bt, qsl, req, pos, q8, w8


def test_fp8_key_write_into_the_shared_page_matches_reference():
    from kestrel.attention.ops.triton_sparse_mla import write_index_keys

    gen = torch.Generator().manual_seed(0)
    spec = SparseMLASpec(DTYPE, 64, 16, index_head_dim=32, block_size=16, index_dtype=FP8)
    rows = quantize_index_keys(torch.randn(5, 32, generator=gen).to(DEVICE, DTYPE))
    slots = torch.tensor([3, 17, -1, 40, 63], device=DEVICE)
    got, expect = (spec.layer_view(torch.zeros(4, spec.page_bytes, dtype=torch.uint8, device=DEVICE))
                   for _ in range(2))
    write_index_keys(rows, got[1], slots)
    write_index_keys_ref(rows, expect[1], slots)
    assert expect[1][1][2].abs().sum() > 0 and got[1][0].stride(0) == spec.page_bytes  # the page's stride
    for g, e in zip(got[1], expect[1]):
        assert torch.equal(g.view(torch.uint8), e.view(torch.uint8))
    assert got[0].abs().sum() == 0  # the latents untouched


@pytest.mark.parametrize("fp8_dot", [False, True])  # the float8 tiles into float16 for the dot, or straight in
@pytest.mark.parametrize("visible_only,rows", [(False, 1), (True, 1), (False, 4)])  # one tile a program, two
# programs a row striding, or four rows of a request a program
def test_fp8_indexer_scores_match_reference(fp8_dot, visible_only, rows, monkeypatch):
    """The kernel's own conversion path runs here too (the interpreter's dot multiplies float16 and float8 tiles
    exactly, in float32). visible_only with two programs a token: each program converts its query once and strides
    over several tiles; the positions past each token are left as they were (-inf here)."""
    from kestrel.attention.ops import triton_sparse_mla
    from kestrel.attention.ops.triton_sparse_mla import indexer_scores

    (k8, ks), bt, qsl, req, pos, q8, w8 = _fp8_case(1)
    monkeypatch.setattr(triton_sparse_mla, "STRIDED_PROGRAMS", 2 * qsl[-1])
    out = torch.full((qsl[-1], max(SEQ)), float("-inf"), device=DEVICE)
    got = indexer_scores(*_dev(q8, w8), tuple(_dev(k8, ks)), *_dev(bt, req.int(), pos.int()), max(SEQ), out=out,
                         block_n=16, visible_only=visible_only, _fp8_dot=fp8_dot, rows_per_program=rows).cpu()
    for t in range(qsl[-1]):
        b = req[t].item()
        blocks = bt[b, :-(-SEQ[b] // 16)].long()
        keys = dequantize_index_keys(k8[blocks].flatten(0, 1), ks[blocks].flatten(0, 1))[:pos[t] + 1]
        want = index_scores_ref(q8[t:t + 1], w8[t:t + 1], keys)[0]
        assert (got[t, :pos[t] + 1] - want).norm() / want.norm() < (1e-2 if CUDA else 1e-5)
        assert torch.isinf(got[t, pos[t] + 1:]).all()


@pytest.mark.parametrize("topk,budget", [(8, 1), (64, 1 << 20)])
def test_fp8_select_topk_matches_reference(topk, budget):
    from kestrel.attention.ops.triton_sparse_mla import select_topk

    (k8, ks), bt, qsl, req, pos, q8, w8 = _fp8_case(2)
    got = select_topk(*_dev(q8, w8), tuple(_dev(k8, ks)), *_dev(bt, req.int(), pos.int()), max(SEQ), topk,
                      budget_bytes=budget).cpu()
    want = select_topk_ref(q8, w8, (k8, ks), bt, qsl, SEQ, topk)
    assert_same_selection(got, want, pos, topk)


def test_triton_impl_matches_torch_impl_with_fp8_keys():
    """forward_sparse's FP8 branch (rotate + quantize keys and queries) through both impls on one SPARSE step:
    the written (keys, scales) are bit-equal and the selections agree."""
    from kestrel.attention.backend import CommonAttentionMetadata
    from kestrel.attention.backends.torch_sparse_mla import TorchSparseMLABackend
    from kestrel.attention.backends.triton_sparse_mla import TritonSparseMLABackend

    gen = torch.Generator().manual_seed(4)
    H, L, R, D, HI, page, topk = 16, 64, 16, 32, 16, 16, 8
    seq_lens, q_lens, qsl = [40, 9, 30], [1, 1, 6], [0, 1, 2, 8]
    spec = SparseMLASpec(DTYPE, L, R, index_head_dim=D, index_topk=topk, block_size=page, index_dtype=FP8)
    bt = torch.tensor([[5, 1, 7], [2, 0, 0], [4, 6, 3]], dtype=torch.int32)
    common = CommonAttentionMetadata(8, 3, 2, 6, 40, torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
                                     torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), qsl, seq_lens)
    slots = torch.tensor([bt[b, p // page].item() * page + p % page for b, (s, q) in enumerate(zip(seq_lens, q_lens))
                          for p in range(s - q, s)], device=DEVICE)
    rows = torch.zeros(8, spec.page_bytes, dtype=torch.uint8, device=DEVICE)
    _, (old_keys, old_scales) = spec.layer_view(rows)
    k8, ks = quantize_index_keys(torch.randn(8 * page, D, generator=gen).to(DEVICE, DTYPE))
    old_keys.copy_(k8.view(8, page, D))
    old_scales.copy_(ks.view(8, page, 1))
    index_k = torch.randn(8, D, generator=gen).to(DEVICE, DTYPE)
    iq, iw = torch.randn(8, HI, D, generator=gen).to(DEVICE, DTYPE), torch.rand(8, HI, generator=gen).to(DEVICE)
    results = []
    for backend in (TorchSparseMLABackend, TritonSparseMLABackend):
        meta = backend.builder_cls(spec, page, torch.device(DEVICE)).build(common, bt.to(DEVICE), slots)
        impl = backend.impl_cls(H, L + R, 0.3, 1)
        latent, index_cache = spec.layer_view(rows.clone())
        seen = {}
        impl.forward_mla = lambda *a: None  # the attention itself: test_triton_sparse_mla.py
        impl.forward_sparse(None, None, None, None, iq, index_k, iw, (latent, index_cache), meta, None)
        seen["cache"], seen["sel"] = index_cache, meta.topk_indices
        results.append(seen)
    (a, b) = results
    for x, y in zip(a["cache"], b["cache"]):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    hits = sum(len(set(p.tolist()) & set(q.tolist()) - {-1}) for p, q in zip(a["sel"].cpu(), b["sel"].cpu()))
    assert hits / sum(len(set(p.tolist()) - {-1}) for p in a["sel"].cpu()) >= (0.95 if CUDA else 1.0)


@pytest.mark.skipif(CUDA, reason="CPU float32 under the interpreter; tests/gpu/test_gpu_dsa.py on CUDA")
def test_engine_on_triton_with_fp8_keys_equals_reference(tmp_path, tiny_tokenizer, monkeypatch):
    """The whole engine (tiny DeepSeek-V3.2, index_topk 8, chunked prefill) with --indexer-key-dtype fp8 gives the
    same greedy tokens on the Triton backend as on the reference backend: the runner's real (keys, scales) views."""
    from kestrel import LLM, SamplingParams
    from kestrel.attention.backends.triton_sparse_mla import TritonSparseMLABackend
    from tests.tiny import make_checkpoint

    monkeypatch.setattr(TritonSparseMLABackend, "devices", ("cuda", "cpu"))
    monkeypatch.setattr(TritonSparseMLABackend, "dtypes", (torch.float32,))
    path = make_checkpoint("deepseek_v32", tmp_path, tokenizer=tiny_tokenizer, kv_lora_rank=64, qk_rope_head_dim=16,
                           index_topk=8)
    prompts = [[5, 17, 99, 3], list(range(10, 40)), [200 + (7 * i) % 97 for i in range(21)]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("triton_sparse_mla", "torch_sparse_mla"):
        llm = LLM(str(path), progress=False, dtype="float32", device="cpu", attention_backend=backend,
                  indexer_key_dtype="fp8", max_num_batched_tokens=8)
        runner = llm.engine.core.executor.runner
        assert runner.backend.name == backend and runner.kv_cache_groups[0].spec.index_dtype == FP8
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["triton_sparse_mla"] == outs["torch_sparse_mla"]
