"""Sparse MLA (DSA) pieces on their own: the capability audit (every MLA backend and every sparse layer class states
`supports_dense_mha_prefill` itself), the builder's route table, and the reference kernels (chunked top-k equals
one big top-k and a brute-force selection; sparse attention over every visible token equals dense MLA; slots
outside the selection are never read)."""
import pytest
import torch

from kestrel.attention.backend import CommonAttentionMetadata
from kestrel.attention.backends.torch_mla import mla_latent_attention_ref
from kestrel.attention.backends.torch_sparse_mla import (TorchSparseMLABackend, request_of_tokens, select_topk_ref,
                                                         sparse_mla_attention_ref)
from kestrel.attention.mla import MLABackend
from kestrel.attention.selector import backend_candidates
from kestrel.attention.sparse_mla import DENSE, DENSE_PREFILL, SPARSE, SparseMLAAttention, declares_dense_mha_prefill
from kestrel.core.kv_spec import SparseMLASpec


def _all_subclasses(cls):
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_all_subclasses(sub)]
    return out


def test_every_mla_backend_and_sparse_layer_declares_dense_prefill():
    backend_candidates()  # imports every backend module this machine can import
    import kestrel.models.deepseek_v32  # noqa: F401  (the models' layer classes)

    backends = [c for c in _all_subclasses(MLABackend) if not c.__name__.startswith("_")]
    layers = [SparseMLAAttention, *_all_subclasses(SparseMLAAttention)]
    assert {"torch_mla", "torch_mla_absorbed", "torch_sparse_mla"} <= {b.name for b in backends}
    undeclared = [c.__qualname__ for c in backends + layers if "supports_dense_mha_prefill" not in vars(c)]
    assert undeclared == []


def test_capability_is_not_inherited():
    class Wrapper(SparseMLAAttention):  # a layer with its own forward that says nothing about dense prefill
        pass

    assert declares_dense_mha_prefill(SparseMLAAttention)
    assert not declares_dense_mha_prefill(Wrapper)


def _common(q_lens, seq_lens):
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    decodes = next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))
    return CommonAttentionMetadata(qsl[-1], len(q_lens), decodes, max(q_lens), max(seq_lens),
                                   torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                                   qsl, seq_lens)


@pytest.mark.parametrize("backend_dense,layer_dense,decode_ctx,longest,route", [
    (True, True, 20, 8, DENSE_PREFILL), (True, True, 20, 9, SPARSE), (True, True, 8, 8, DENSE),
    (True, True, 8, 9, SPARSE), (True, False, 20, 8, SPARSE), (True, False, 8, 8, SPARSE),
    (False, True, 20, 8, SPARSE), (False, True, 8, 8, SPARSE)])
def test_route_is_backend_and_layer_and_length(backend_dense, layer_dense, decode_ctx, longest, route):
    spec = SparseMLASpec(torch.float32, 32, 8, index_head_dim=16, index_topk=8, layer_dense_prefill=layer_dense,
                         block_size=4)
    builder_cls = type("B", (TorchSparseMLABackend.builder_cls,), {"dense_prefill": backend_dense})
    builder = builder_cls(spec, 4, torch.device("cpu"))
    common = _common([1, 3, longest], [decode_ctx, 5, longest])  # a decode, two prefills (index_topk 8)
    meta = builder.build(common, torch.zeros(3, 8, dtype=torch.int32), torch.zeros(common.num_tokens,
                                                                                     dtype=torch.int64))
    assert meta.route == route
    # the dense routes expand the prefills; the decode is always absorbed, and scored unless the route is DENSE
    assert meta.num_absorbed_reqs == (3 if route == SPARSE else 1)
    assert meta.num_scored_tokens == {SPARSE: common.num_tokens, DENSE_PREFILL: 1, DENSE: 0}[route]


def _paged(rows: torch.Tensor, block_size: int):
    """Per-request rows laid into a shuffled paged cache -> cache [blocks, bs, D], block table [1, n]."""
    n = -(-rows.shape[0] // block_size)
    perm = torch.randperm(n + 3)[:n]
    cache = torch.randn(n + 3, block_size, rows.shape[1])
    padded = torch.cat([rows, torch.zeros(n * block_size - rows.shape[0], rows.shape[1])])
    cache[perm] = padded.view(n, block_size, -1)
    return cache, perm[None].to(torch.int32)


def test_chunked_topk_equals_brute_force():
    torch.manual_seed(0)
    seq_len, q_len, heads, dim, topk = 37, 9, 16, 32, 6
    keys = torch.randn(seq_len, dim)
    q, w = torch.randn(q_len, heads, dim), torch.randn(q_len, heads)
    cache, table = _paged(keys, 4)
    whole = select_topk_ref(q, w, cache, table, [0, q_len], [seq_len], topk)
    chunked = select_topk_ref(q, w, cache, table, [0, q_len], [seq_len], topk, budget_bytes=1)  # one row a chunk
    assert torch.equal(whole, chunked)
    for i in range(q_len):
        pos = seq_len - q_len + i
        scores = (w[i, :, None] * (q[i] @ keys[:pos + 1].T).relu()).sum(0)
        assert set(whole[i].tolist()) == set(scores.topk(topk).indices.tolist())


def test_topk_pads_rows_with_fewer_visible_tokens():
    torch.manual_seed(1)
    keys = torch.randn(5, 16)
    cache, table = _paged(keys, 4)
    out = select_topk_ref(torch.randn(5, 16, 16), torch.randn(5, 16), cache, table, [0, 5], [5], 4)
    for i in range(5):  # query i sees positions 0..i
        chosen = out[i][out[i] >= 0].tolist()
        assert len(set(chosen)) == len(chosen) == min(4, i + 1) and max(chosen) <= i
        assert (out[i] == -1).sum() == 4 - len(chosen)


def test_sparse_attention_over_all_visible_equals_dense_and_skips_unselected():
    torch.manual_seed(2)
    L, R, H, seq_len, q_len, bs = 32, 8, 4, 11, 3, 4
    lat = torch.randn(seq_len, L + R)
    cache, table = _paged(lat, bs)
    q_lat, q_pe = torch.randn(q_len, H, L), torch.randn(q_len, H, R)
    all_visible = torch.tensor([[p if p <= seq_len - q_len + i else -1 for p in range(seq_len)] for i in range(q_len)])
    req = request_of_tokens([0, q_len], "cpu")
    sparse = sparse_mla_attention_ref(q_lat, q_pe, cache, table, req, all_visible, 0.3)
    dense = mla_latent_attention_ref(q_lat, q_pe, cache, table, [0, q_len], [seq_len], 0.3)
    torch.testing.assert_close(sparse, dense)
    # a selection of 3 positions: NaN everywhere else in the cache changes nothing
    pick = torch.tensor([[0, 4, 8, -1], [1, 2, 9, 7], [3, 5, 10, -1]])  # -1: no position
    want = sparse_mla_attention_ref(q_lat, q_pe, cache, table, req, pick, 0.3)
    poisoned = torch.full_like(cache, float("nan"))
    flat_slots = table[0].long()[pick[pick >= 0] // bs] * bs + pick[pick >= 0] % bs
    poisoned.view(-1, L + R)[flat_slots] = cache.view(-1, L + R)[flat_slots]
    got = sparse_mla_attention_ref(q_lat, q_pe, poisoned, table, req, pick, 0.3)
    assert torch.equal(got, want) and not got.isnan().any()


def test_spec_pages_latent_and_index_keys_and_crosses_to_workers():
    """One block's page: the latents then the indexer keys (DeepSeek: 16 x (1,152 + 256) bytes); the two views
    do not overlap; the spec survives the executor's encoding to TP workers (looked up by name)."""
    from kestrel.core.kv_spec import group_layers
    from kestrel.executor.messages import decode_groups, encode_groups

    spec = SparseMLASpec(torch.bfloat16, 512, 64, index_head_dim=128, index_topk=2048, layer_dense_prefill=True)
    assert spec.page_bytes == 16 * (1152 + 256)
    rows = torch.zeros(3, spec.page_bytes, dtype=torch.uint8)
    latent, keys = spec.layer_view(rows)
    assert latent.shape == (3, 16, 576) and keys.shape == (3, 16, 128)
    keys.fill_(1.0)
    assert latent.abs().sum() == 0
    groups = group_layers({"a": spec, "b": spec}, 16)
    assert [g.spec for g in decode_groups(encode_groups(groups))] == [g.spec for g in groups]
