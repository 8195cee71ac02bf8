"""The CUDA-graph decode path of the Triton DSA backend, run eagerly on the CPU under the Triton interpreter
(TRITON_INTERPRET=1): the static-width selection (scores as wide as the graph's longest context, each row's length
read on the device by the radix top-k), the captured metadata (token positions derived from seq_lens inside the
graph, padded rows at seq_len 0) and the per-route graphs, against today's eager path. On CUDA the same runs are
tests/gpu/test_gpu_dsa.py with real graphs."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from kestrel.attention.backends.torch_sparse_mla import select_topk_ref  # noqa: E402
from kestrel.config import EngineConfig  # noqa: E402
from kestrel.platform import triton_gates as gates  # noqa: E402
from kestrel.worker.warm_up import graph_sizes  # noqa: E402

_ok, _why = gates.triton_runnable()
needs_triton = pytest.mark.skipif(not _ok, reason=_why)
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def test_dsa_backend_declares_graphs_and_the_runner_would_capture():
    """A DSA model on CUDA (faked: graph_sizes reads the runner's device, config, backends and add-ons only) gets
    decode graphs; one route per step makes two forms where the dense routes are declared."""
    from kestrel.attention.backends.triton_sparse_mla import TritonSparseMLABackend
    from kestrel.attention.sparse_mla import DENSE, SPARSE
    from kestrel.core.kv_spec import SparseMLASpec

    assert TritonSparseMLABackend.supports_cuda_graphs
    runner = SimpleNamespace(config=EngineConfig(), device=torch.device("cuda"), backends=[TritonSparseMLABackend],
                             addons=[])
    assert graph_sizes(runner) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    for layer_dense, forms in ((True, (SPARSE, DENSE)), (False, (SPARSE,))):
        spec = SparseMLASpec(torch.bfloat16, 512, 64, index_head_dim=128, index_topk=2048,
                             layer_dense_prefill=layer_dense)
        builder = TritonSparseMLABackend.builder_cls(spec, 16, torch.device("cpu"))
        assert builder.graph_variants() == forms


@needs_triton
@pytest.mark.parametrize("rows,width,k", [(6, 300, 16), (3, 2000, 256)])
def test_radix_topk_reads_each_rows_own_length(rows, width, k):
    """last[r]: row r's candidates end there; what lies after (NaN, huge values) is never read; a row with at
    most k candidates selects them all; a padded row (-1) selects nothing."""
    from kestrel.attention.ops.triton_topk import radix_topk
    from tests.attention.test_triton_topk import assert_is_topk

    gen = torch.Generator().manual_seed(width)
    scores = torch.randn(rows, width, generator=gen)
    last = torch.tensor([width - 1, k - 1, k // 2, -1, k, 3 * k][:rows], dtype=torch.int32)
    for r in range(rows):
        scores[r, last[r] + 1:] = float("nan") if r % 2 else 1e30  # garbage past the row's end
    got = radix_topk(scores.to(DEVICE), k, last=last.to(DEVICE)).cpu()
    for r in range(rows):
        n = int(last[r]) + 1
        if n <= k:
            assert got[r, :n].tolist() == list(range(n)) and (got[r, n:] == -1).all()
        else:
            assert_is_topk(scores[r:r + 1, :n], got[r:r + 1], k)


@needs_triton
@pytest.mark.parametrize("key_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("topk", [8, 64])
def test_static_width_selection_equals_eager(key_dtype, topk):
    """select_topk(static_width=True) at the graph's width (far past every context, its tail never written) with
    padded rows at position -1 gives the eager path's selection and -1 rows for the padding."""
    from kestrel.attention.ops.triton_sparse_mla import select_topk
    from tests.attention.test_triton_indexer_fp8 import _fp8_case
    from tests.attention.test_triton_sparse_mla import DTYPE, SEQ, _dev, _scores_case, assert_same_selection

    if key_dtype == "fp8":
        cache, bt, qsl, req, pos, q, w = _fp8_case(5)
    else:
        cache, bt, qsl, req, pos, q, w = _scores_case(5)
        cache, q = cache.to(DTYPE), q.to(DTYPE)
    n, pad = qsl[-1], 3  # padded rows: position -1, their request row 0
    paged = (tuple(_dev(*cache)) if isinstance(cache, tuple) else _dev(cache)[0], *_dev(bt))
    eager = select_topk(*_dev(q, w), *paged, *_dev(req.int(), pos.int()), max(SEQ), topk).cpu()
    q, w = torch.cat([q, q[:pad]]), torch.cat([w, w[:pad]])
    req_p = torch.cat([req, torch.zeros(pad, dtype=req.dtype)])
    pos_p = torch.cat([pos, torch.full((pad,), -1, dtype=pos.dtype)])
    got = select_topk(*_dev(q, w), *paged, *_dev(req_p.int(), pos_p.int()), 4 * max(SEQ) + 17, topk,
                      static_width=True).cpu()
    assert got.shape == (n + pad, topk) and (got[n:] == -1).all()
    assert_same_selection(got[:n], eager, pos, topk)
    assert_same_selection(got[:n], select_topk_ref(q[:n], w[:n], cache, bt, qsl, SEQ, topk), pos, topk)


@needs_triton
@pytest.mark.skipif(CUDA, reason="CPU float32 under the interpreter; tests/gpu/test_gpu_dsa.py on CUDA")
# (bf16, sparse only, 128): k past every context (max_model_len 64), as index_topk 2048 is in a real model; the
# sparse kernels loop over all k slots, so 2048 cost the interpreter ~6 minutes for the same paths.
@pytest.mark.parametrize("key_dtype,layer_dense,topk", [("bf16", True, 8), ("fp8", True, 8), ("bf16", False, 128)])
def test_decode_graph_path_equals_eager_engine(tmp_path, tiny_tokenizer, monkeypatch, key_dtype, layer_dense, topk):
    """The whole engine (tiny DeepSeek-V3.2) with decode graphs installed but not captured: each decode step
    runs the graph's forward eagerly (DecodeGraphs.replay without a graph) from the captured metadata, padded to
    the next graph size, with the route the step's builder decided; the greedy tokens equal the eager engine's.
    index_topk 8 with the dense routes declared: short contexts replay the DENSE graphs, longer ones the SPARSE;
    every graph form that exists is replayed."""
    from kestrel import LLM, SamplingParams
    from kestrel.attention.backends.triton_sparse_mla import TritonSparseMLABackend
    from kestrel.attention.sparse_mla import SparseMLAAttention
    from kestrel.worker.cuda_graphs import DecodeGraphForms, decode_graphs
    from tests.tiny import make_checkpoint

    monkeypatch.setattr(SparseMLAAttention, "supports_dense_mha_prefill", layer_dense)
    monkeypatch.setattr(TritonSparseMLABackend, "devices", ("cuda", "cpu"))
    monkeypatch.setattr(TritonSparseMLABackend, "dtypes", (torch.float32,))
    path = make_checkpoint("deepseek_v32", tmp_path, tokenizer=tiny_tokenizer, kv_lora_rank=64, qk_rope_head_dim=16,
                           index_topk=topk)
    batches = [[[5, 17, 99, 3]], [[5, 17, 99, 3], list(range(10, 40)), [200 + (7 * i) % 97 for i in range(21)]]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = []
    for graphs in (False, True):
        llm = LLM(str(path), progress=False, dtype="float32", device="cpu", attention_backend="triton_sparse_mla",
                  indexer_key_dtype=key_dtype, async_scheduling="off", max_model_len=64)
        runner = llm.engine.core.executor.runner
        if graphs:
            runner.graphs = decode_graphs(runner, [1, 2, 4])  # 3 requests: one padded row
            runner.graph_sets = [runner.graphs]
        outs.append([[o.outputs[0].token_ids for o in llm.generate(b, params)] for b in batches])
    assert outs[1] == outs[0]
    forms = runner.graphs.by_form if isinstance(runner.graphs, DecodeGraphForms) else {None: runner.graphs}
    assert len(forms) == (2 if layer_dense else 1)
    assert all(g.replays > 0 for g in forms.values()), {f: g.replays for f, g in forms.items()}
