"""Triton sparse MLA (DSA) for CUDA: the indexer-key write, indexer scores over the paged key cache with a chunked
top-k, and absorbed MLA over each token's index list (attention/ops/triton_sparse_mla.py), for decodes and sparse
prefills alike; short prefills on the dense route go through triton_mla's dense prefill.

CUDA graphs for decode (SparseMLAMetadataBuilder captures one graph per route a decode step can take: SPARSE, and
DENSE where the dense routes are declared). The DENSE graph is triton_mla's decode plus the indexer-key write. The
SPARSE graph has static shapes and reads nothing on the host: the scores are as wide as the graph's longest context
(max_model_len) but each token's visible part alone is computed, and the radix select (triton_topk.py) reads each
row's length from the token positions on the device (padded rows, at -1, select nothing and attend to nothing).
Its cost: one program per row reading the row's scores five times (about 10-40 us a layer for one 32k row,
estimated, not yet timed on the H200), where eager steps use torch.topk over the step's longest context.
Importing fails without Triton, and the selector then skips it."""
from __future__ import annotations

import torch

from kestrel.attention.backends.triton_mla import TritonMLABackend, TritonMLAImpl
from kestrel.attention.ops.triton_sparse_mla import select_topk, sparse_mla_attention, write_index_keys
from kestrel.attention.sparse_mla import SparseMLAImpl, SparseMLAMetadata, SparseMLAMetadataBuilder
from kestrel.core.kv_spec import SparseMLASpec
from kestrel.platform import is_fp8_fnuz, supports_triton_fp8
from kestrel.platform.triton_gates import interpreter_mode


class TritonSparseMLAImpl(SparseMLAImpl, TritonMLAImpl):
    # the top-k of eager steps (sparse prefills): "torch" until the H100/H200 A/B of benchmarks/profile_dsa.py
    # (--eager-topk) decides; CUDA-graph decode steps always take the radix select
    eager_topk = "torch"
    # rows of one request sharing each indexer-key tile in eager steps' scores (1: one row a program, as in decode);
    # 2 and 4 are the candidates of the same A/B
    eager_score_rows = 1

    def write_index_keys(self, index_k, index_cache, slot_mapping) -> None:
        write_index_keys(index_k, index_cache, slot_mapping)

    def select_topk(self, index_q, index_w, index_cache, meta: SparseMLAMetadata) -> torch.Tensor:
        return select_topk(index_q, index_w, index_cache, meta.block_tables, meta.token_req, meta.token_pos,
                           meta.max_seq_len, meta.index_topk, topk_impl=self.eager_topk,
                           static_width=meta.static_width, rows_per_program=self.eager_score_rows)

    def attend_sparse(self, q_lat, q_pe, cache, meta: SparseMLAMetadata, topk) -> torch.Tensor:
        return sparse_mla_attention(q_lat, q_pe, cache, meta.block_tables, meta.token_req, topk, self.scale)


class TritonSparseMLABackend(TritonMLABackend):
    name = "triton_sparse_mla"
    cache_specs = (SparseMLASpec,)
    supports_sparse_mla = True
    supports_dense_mha_prefill = True
    supports_cuda_graphs = True
    impl_cls = TritonSparseMLAImpl
    builder_cls = SparseMLAMetadataBuilder

    @classmethod
    def validate_spec(cls, spec) -> tuple[bool, str]:
        ok, why = super().validate_spec(spec)
        d = getattr(spec, "index_head_dim", 0)
        if ok and (d & (d - 1) or d < 16):
            return False, f"index head dim {d}: the kernel needs a power of two >= 16"
        fp8_ok = interpreter_mode() or (supports_triton_fp8() and not is_fp8_fnuz())
        if ok and getattr(spec, "index_dtype", None) is not None and not fp8_ok:
            return False, "float8 indexer keys need Triton float8 conversions (sm_89+)"
        return ok, why
