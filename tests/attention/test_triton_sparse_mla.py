"""Triton DSA kernels against the PyTorch reference (attention/backends/torch_sparse_mla.py): indexer-key write,
indexer scores over the paged key cache, the chunked top-k, and sparse absorbed MLA with every cache slot outside
the selection NaN-poisoned. On CUDA in bf16 (scores relative error < 1e-2, top-k recall >= 0.99), or on the CPU
under the Triton interpreter (TRITON_INTERPRET=1, float32, tiny shapes: exact sets)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402

_ok, _why = gates.triton_runnable()
pytestmark = pytest.mark.skipif(not _ok, reason=_why)

from kestrel.attention.backends.torch_mla import write_rows_ref  # noqa: E402
from kestrel.attention.backends.torch_sparse_mla import (index_scores_ref, request_of_tokens,  # noqa: E402
                                                         select_topk_ref, sparse_mla_attention_ref)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32


def _case(seq_lens, q_lens, page, dim, gen, extra_blocks=2):
    """A shuffled paged cache holding every request's rows, its block table, and the tokens' request and
    position (each request's queries are the last q_len of its context)."""
    nblk = [-(-s // page) for s in seq_lens]
    perm = torch.randperm(sum(nblk) + extra_blocks, generator=gen)
    bt = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32)
    o = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[o:o + n]
        o += n
    cache = torch.randn(sum(nblk) + extra_blocks, page, dim, generator=gen)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    req = request_of_tokens(qsl, "cpu")
    pos = torch.tensor([seq_lens[r] - (qsl[r + 1] - t) for t, r in enumerate(req.tolist())])
    return cache, bt, qsl, req, pos


def _dev(*xs):
    return [x.to(DEVICE) for x in xs]


def test_writes_into_the_shared_page_match_reference():
    """Latents and indexer keys into the layer's real cache views (SparseMLASpec.layer_view of one slot's rows, as
    kv_allocation builds them): both parts of a block share its page, so each view's block stride is the whole
    page, wider than its own block_size rows. Slots in several blocks, -1 padding skipped."""
    from kestrel.attention.backends.torch_mla import write_latent_ref
    from kestrel.attention.ops.triton_mla import write_latent
    from kestrel.attention.ops.triton_sparse_mla import write_index_keys
    from kestrel.core.kv_spec import SparseMLASpec

    gen = torch.Generator().manual_seed(0)
    L, R, D = 64, 16, 32
    spec = SparseMLASpec(DTYPE, L, R, index_head_dim=D, block_size=16)
    kv_c, k_pe, keys = (torch.randn(5, n, generator=gen).to(DEVICE, DTYPE) for n in (L, R, D))
    slots = torch.tensor([3, 17, -1, 40, 63], device=DEVICE)
    got, expect = (spec.layer_view(torch.zeros(4, spec.page_bytes, dtype=torch.uint8, device=DEVICE))
                   for _ in range(2))
    assert got[0].stride(0) == got[1].stride(0) == 16 * (L + R + D)
    write_latent(kv_c, k_pe, got[0], slots)
    write_index_keys(keys, got[1], slots)
    write_latent_ref(kv_c, k_pe, expect[0], slots)
    write_rows_ref(keys, expect[1], slots)
    assert expect[1].abs().sum() > 0 and expect[0][2].abs().sum() > 0  # the rows of block 2 hold slot 40
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])


SEQ, QL = [37, 130, 5], [4, 1, 5]  # a chunk over a cached prefix, a decode, a whole short prompt


def _scores_case(seed, heads=16, dim=32, page=16):
    gen = torch.Generator().manual_seed(seed)
    cache, bt, qsl, req, pos = _case(SEQ, QL, page, dim, gen)
    q = torch.randn(qsl[-1], heads, dim, generator=gen)
    w = torch.randn(qsl[-1], heads, generator=gen) * 0.2
    return cache, bt, qsl, req, pos, q, w


@pytest.mark.parametrize("visible_only", [False, True])  # True: two programs a token, each striding over tiles
def test_indexer_scores_match_reference(visible_only, monkeypatch):
    """Also the radix select's first pass that the kernel adds into hist: each row's top-byte histogram over
    the scores the select reads (the whole row, or with visible_only up to the token's position)."""
    from kestrel.attention.ops import triton_sparse_mla
    from kestrel.attention.ops.triton_sparse_mla import indexer_scores
    from kestrel.attention.ops.triton_topk import radix_histogram
    from tests.attention.test_triton_topk import first_pass_histogram_ref

    cache, bt, qsl, req, pos, q, w = _scores_case(1)
    width = max(SEQ)
    monkeypatch.setattr(triton_sparse_mla, "STRIDED_PROGRAMS", 2 * qsl[-1])
    out = torch.full((qsl[-1], width), float("-inf"), device=DEVICE)  # visible_only leaves the tails as they are
    hist = radix_histogram(qsl[-1], DEVICE)
    got = indexer_scores(*_dev(q.to(DTYPE), w, cache.to(DTYPE), bt, req.int(), pos.int()), width, out=out,
                         block_n=16, visible_only=visible_only, hist=hist).cpu()
    assert torch.equal(hist.cpu(), first_pass_histogram_ref(got, pos.int() if visible_only else None))
    for t in range(qsl[-1]):
        b = req[t].item()
        keys = cache[bt[b, :-(-SEQ[b] // 16)].long()].flatten(0, 1)[:pos[t] + 1].to(DTYPE)
        want = index_scores_ref(q[t:t + 1].to(DTYPE), w[t:t + 1], keys)[0]
        seen = got[t, :pos[t] + 1]
        assert (seen - want).norm() / want.norm() < (1e-2 if CUDA else 1e-5)
        assert torch.isinf(got[t, pos[t] + 1:]).all() and (got[t, pos[t] + 1:] < 0).all()


def test_row_tiles_keep_to_one_request():
    from kestrel.attention.ops.triton_sparse_mla import row_tiles

    req = torch.tensor([0, 0, 0, 0, 0, 1, 2, 2, 2, 2], dtype=torch.int32)
    starts, ends = row_tiles(req, 2)
    assert starts.tolist() == [0, 2, 4, 5, 6, 8] and ends.tolist() == [2, 4, 5, 6, 8, 10]
    starts, ends = row_tiles(req, 4)
    assert starts.tolist() == [0, 4, 5, 6] and ends.tolist() == [4, 5, 6, 10]


@pytest.mark.parametrize("rows", [2, 4])
def test_indexer_scores_rows_per_program_match_reference(rows):
    """Several rows of one request a program (eager prefills): tiles of 4, 1 and 5 rows over three requests,
    whole rows written (-inf past each position)."""
    from kestrel.attention.ops.triton_sparse_mla import indexer_scores

    cache, bt, qsl, req, pos, q, w = _scores_case(4)
    width = max(SEQ) + 7  # past every context: tails of -inf
    got = indexer_scores(*_dev(q.to(DTYPE), w, cache.to(DTYPE), bt, req.int(), pos.int()), width, block_n=16,
                         rows_per_program=rows).cpu()
    for t in range(qsl[-1]):
        b = req[t].item()
        keys = cache[bt[b, :-(-SEQ[b] // 16)].long()].flatten(0, 1)[:pos[t] + 1].to(DTYPE)
        want = index_scores_ref(q[t:t + 1].to(DTYPE), w[t:t + 1], keys)[0]
        assert (got[t, :pos[t] + 1] - want).norm() / want.norm() < (1e-2 if CUDA else 1e-5)
        assert torch.isinf(got[t, pos[t] + 1:]).all() and (got[t, pos[t] + 1:] < 0).all()
    with pytest.raises(ValueError, match="rows_per_program"):
        indexer_scores(*_dev(q.to(DTYPE), w, cache.to(DTYPE), bt, req.int(), pos.int()), width, rows_per_program=3)


@pytest.mark.parametrize("topk,budget", [(8, 1), (64, 1 << 20), (2048, 1 << 20)])
def test_select_topk_matches_reference(topk, budget):
    from kestrel.attention.ops.triton_sparse_mla import select_topk

    cache, bt, qsl, req, pos, q, w = _scores_case(2)
    got = select_topk(*_dev(q.to(DTYPE), w, cache.to(DTYPE), bt, req.int(), pos.int()), max(SEQ), topk,
                      budget_bytes=budget).cpu()  # budget 1: one row a chunk
    want = select_topk_ref(q.to(DTYPE), w, cache.to(DTYPE), bt, qsl, SEQ, topk)
    assert got.shape == (qsl[-1], topk)
    assert_same_selection(got, want, pos, topk)


def assert_same_selection(got, want, pos, topk):
    """Each token selects min(topk, visible) positions; the sets agree (CPU), or >= 99% of them (bf16 on CUDA)."""
    hits = total = 0
    for t in range(got.shape[0]):
        g, r = set(got[t].tolist()) - {-1}, set(want[t].tolist()) - {-1}
        assert len(g) == len(r) == min(topk, pos[t].item() + 1)
        hits, total = hits + len(g & r), total + len(r)
    assert hits / total >= (0.99 if CUDA else 1.0)


def _check_sparse_attention(heads, k, num_splits, cfg, tail_padded=False, seed=3):
    """Each token attends over a random subset of its visible positions (k - 3 at most), -1 padded: in random
    order, or (tail_padded, as select_topk leaves them) the -1 entries last, so that whole splits are empty.
    Every cache slot outside the selection is NaN: a read of one would show."""
    from kestrel.attention.ops.triton_sparse_mla import sparse_mla_attention

    gen = torch.Generator().manual_seed(seed)
    L, R, page = 64, 16, 16
    cache, bt, qsl, req, pos = _case(SEQ, QL, page, L + R, gen)
    T = qsl[-1]
    topk = torch.full((T, k), -1, dtype=torch.int64)
    for t in range(T):
        n = min(k - 3, pos[t].item() + 1)
        topk[t, :n] = torch.randperm(pos[t].item() + 1, generator=gen)[:n]
        if not tail_padded:
            topk[t] = topk[t][torch.randperm(k, generator=gen)]
    selected = torch.zeros(cache.shape[0] * page, dtype=torch.bool)
    for t in range(T):
        p = topk[t][topk[t] >= 0]
        selected[bt[req[t], p // page].long() * page + p % page] = True
    poisoned = cache.clone().view(-1, L + R)
    poisoned[~selected] = float("nan")
    poisoned = poisoned.view_as(cache)
    q_lat, q_pe = torch.randn(T, heads, L, generator=gen), torch.randn(T, heads, R, generator=gen)
    want = sparse_mla_attention_ref(q_lat.to(DTYPE).float(), q_pe.to(DTYPE).float(), cache.to(DTYPE).float(), bt,
                                    req, topk, 0.2)
    got = sparse_mla_attention(*_dev(q_lat.to(DTYPE), q_pe.to(DTYPE), poisoned.to(DTYPE), bt, req.int(), topk),
                               0.2, num_splits=num_splits, _config=cfg).float().cpu()
    assert not got.isnan().any()
    assert (got - want).norm() / want.norm() < (1e-2 if CUDA else 1e-5)


@pytest.mark.parametrize("num_splits,cfg", [(1, None), (4, {"BLOCK_N": 16, "MIN_SPLIT": 16})])
@pytest.mark.parametrize("heads", [16, 20])  # 20: two head blocks, the second partly masked
def test_sparse_mla_attention_matches_reference_unselected_poisoned(heads, num_splits, cfg):
    _check_sparse_attention(heads, 64, num_splits, cfg)


@pytest.mark.parametrize("num_splits", [None, 64])  # None: the shapes' choice (16 splits of one 16-token tile)
@pytest.mark.parametrize("tail_padded", [False, True])
def test_sparse_mla_attention_many_splits_match_reference(num_splits, tail_padded):
    """k 256 over contexts of at most 130: most entries -1. With splits of one BLOCK_N tile (the default shortest
    split), 16 active splits, or 64 launched of which 16 hold entries; tail-padded rows leave splits empty."""
    from kestrel.attention.ops.triton_sparse_mla import sparse_num_splits

    cfg = {"BLOCK_N": 16}
    assert sparse_num_splits(sum(QL), 16, 256, _config=cfg) == 16
    _check_sparse_attention(16, 256, num_splits, cfg, tail_padded)


def test_sparse_num_splits_fill_the_chip_at_small_batch():
    """DeepSeek's shapes (16 heads, k 2048) on 132 SMs: one token gets 32 splits of one 64-token tile (the first
    guess, MIN_SPLIT 256, gave 8); 64 tokens 4 splits as before; from 132 tokens on none."""
    from kestrel.attention.ops.triton_sparse_mla import sparse_num_splits

    got = {t: sparse_num_splits(t, 16, 2048) for t in (1, 8, 16, 32, 64, 128, 132, 256)}
    assert got == {1: 32, 8: 32, 16: 16, 32: 8, 64: 4, 128: 2, 132: 1, 256: 1}
    assert sparse_num_splits(1, 16, 2048, _config={"MIN_SPLIT": 256}) == 8
    assert sparse_num_splits(1, 16, 64) == 1  # one tile: nothing to split
    assert sparse_num_splits(1, 128, 2048) == 32  # 8 head blocks: still 4 programs an SM wanted, 32 tiles at most


def test_triton_impl_matches_torch_impl_on_a_step():
    """The backends' glue: a SPARSE step of two decodes and a prefill chunk over a cached prefix, metadata from
    the builder; the Triton impl's key write, selection and sparse attention equal the reference impl's."""
    from kestrel.attention.backend import CommonAttentionMetadata
    from kestrel.attention.backends.torch_sparse_mla import TorchSparseMLABackend
    from kestrel.attention.backends.triton_sparse_mla import TritonSparseMLABackend
    from kestrel.core.kv_spec import SparseMLASpec

    gen = torch.Generator().manual_seed(4)
    H, L, R, D, HI, page, topk = 16, 64, 16, 32, 16, 16, 8
    seq_lens, q_lens = [40, 9, 30], [1, 1, 6]
    qsl = [0, 1, 2, 8]
    spec = SparseMLASpec(DTYPE, L, R, index_head_dim=D, index_topk=topk, block_size=page)
    bt = torch.tensor([[5, 1, 7], [2, 0, 0], [4, 6, 3]], dtype=torch.int32)
    common = CommonAttentionMetadata(8, 3, 2, 6, 40, torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
                                     torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), qsl, seq_lens)
    slots = torch.tensor([bt[b, p // page].item() * page + p % page for b, (s, q) in enumerate(zip(seq_lens, q_lens))
                          for p in range(s - q, s)], device=DEVICE)
    latent = torch.randn(8, page, L + R, generator=gen).to(DEVICE, DTYPE)
    keys = torch.randn(8, page, D, generator=gen).to(DEVICE, DTYPE)
    new_keys = torch.randn(8, D, generator=gen).to(DEVICE, DTYPE)
    iq, iw = torch.randn(8, HI, D, generator=gen).to(DEVICE, DTYPE), torch.randn(8, HI, generator=gen).to(DEVICE)
    q_lat, q_pe = torch.randn(8, H, L, generator=gen).to(DEVICE, DTYPE), torch.randn(8, H, R, generator=gen).to(
        DEVICE, DTYPE)
    results, reference_selection = [], None
    for backend in (TorchSparseMLABackend, TritonSparseMLABackend):
        meta = backend.builder_cls(spec, page, torch.device(DEVICE)).build(common, bt.to(DEVICE), slots)
        assert meta.route == "sparse" and meta.num_scored_tokens == 8
        impl = backend.impl_cls(H, L + R, 0.3, 1)
        cache = keys.clone()
        impl.write_index_keys(new_keys, cache, meta.slot_mapping)
        sel = impl.select_topk(iq, iw, cache, meta)
        reference_selection = sel if reference_selection is None else reference_selection
        # both attend over the reference's selection (bf16 may flip a near-tied pick)
        out = impl.attend_sparse(q_lat, q_pe, latent, meta, reference_selection.to(sel.dtype).contiguous())
        results.append((cache, sel, out))
    (c0, s0, o0), (c1, s1, o1) = results
    assert torch.equal(c0, c1)
    hits = sum(len(set(a.tolist()) & set(b.tolist()) - {-1}) for a, b in zip(s0.cpu(), s1.cpu()))
    assert hits / sum(len(set(a.tolist()) - {-1}) for a in s0.cpu()) >= (0.95 if CUDA else 1.0)
    assert (s1 == -1).sum() == (s0 == -1).sum()
    assert (o1.float() - o0.float()).norm() / o0.float().norm() < (1e-2 if CUDA else 1e-5)


@pytest.mark.skipif(CUDA, reason="CPU float32 under the interpreter; tests/gpu/test_gpu_dsa.py on CUDA")
# index_topk 64 is past every context here (42 tokens at most), as 2048 is in a real model: the same routes, at a
# fraction of the interpreter's time (the sparse kernels loop over all k slots)
# eager: the sparse prefill's top-k and rows a scores program (TritonSparseMLAImpl's A/B candidates)
@pytest.mark.parametrize("topk,chunk,layer_dense,eager", [(64, None, False, ("torch", 1)), (64, None, True, ("torch", 1)),
                                                          (8, None, True, ("torch", 1)), (8, 8, True, ("torch", 1)),
                                                          (8, 8, True, ("radix", 4)), (8, None, True, ("torch", 2))])
def test_engine_on_triton_sparse_mla_equals_reference(tmp_path, tiny_tokenizer, monkeypatch, topk, chunk,
                                                      layer_dense, eager):
    """The whole engine (tiny DeepSeek-V3.2, prompts over several cache blocks) on the Triton backend gives the
    reference backend's greedy tokens: the kernels reached through the runner's real cache views, block table
    and per-token metadata, which the kernel tests above build by hand. index_topk 64: every step sparse
    (layer_dense False) or on the dense routes; 8: the selection decides, also over chunked prefill."""
    from kestrel import LLM, SamplingParams
    from kestrel.attention.backends.triton_sparse_mla import TritonSparseMLABackend, TritonSparseMLAImpl
    from kestrel.attention.sparse_mla import SparseMLAAttention
    from tests.tiny import make_checkpoint

    monkeypatch.setattr(SparseMLAAttention, "supports_dense_mha_prefill", layer_dense)
    monkeypatch.setattr(TritonSparseMLAImpl, "eager_topk", eager[0])
    monkeypatch.setattr(TritonSparseMLAImpl, "eager_score_rows", eager[1])
    monkeypatch.setattr(TritonSparseMLABackend, "devices", ("cuda", "cpu"))
    monkeypatch.setattr(TritonSparseMLABackend, "dtypes", (torch.float32,))
    path = make_checkpoint("deepseek_v32", tmp_path, tokenizer=tiny_tokenizer, kv_lora_rank=64, qk_rope_head_dim=16,
                           index_topk=topk)
    prompts = [[5, 17, 99, 3], list(range(10, 40)), [200 + (7 * i) % 97 for i in range(21)]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("triton_sparse_mla", "torch_sparse_mla"):
        llm = LLM(str(path), progress=False, dtype="float32", device="cpu", attention_backend=backend,
                  **({"max_num_batched_tokens": chunk} if chunk else {}))
        assert llm.engine.core.executor.runner.backend.name == backend
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["triton_sparse_mla"] == outs["torch_sparse_mla"]
