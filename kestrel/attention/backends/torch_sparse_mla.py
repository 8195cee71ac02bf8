"""Reference DSA (sparse MLA) in plain PyTorch: indexer-key write, indexer scores with a causal top-k per query
token (computed in row chunks, so no [tokens x context x heads] tensor is ever larger than a fixed budget), and
absorbed MLA over each token's selected latents. Runs anywhere; the CPU backend and the yardstick for kernels."""
from __future__ import annotations

import torch

from kestrel.attention.backends.torch_mla import TorchMLABackend, TorchMLAImpl, write_rows_ref
from kestrel.attention.indexer_keys import dequantize_index_keys
from kestrel.attention.sparse_mla import SparseMLAImpl, SparseMLAMetadata, SparseMLAMetadataBuilder
from kestrel.core.kv_spec import SparseMLASpec

SCORE_BUDGET_BYTES = 64 << 20  # float32 scores of one row chunk: [rows, index heads, context]


def request_of_tokens(query_start_loc: list[int], device) -> torch.Tensor:
    """[num tokens] int64: the request each token of the batch belongs to."""
    lens = torch.tensor([e - s for s, e in zip(query_start_loc, query_start_loc[1:])], device=device)
    return torch.repeat_interleave(torch.arange(len(lens), device=device), lens)


def gather_rows(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A request's first seq_len per-token rows from a paged cache [blocks, block_size, D] -> [seq_len, D]."""
    bs = cache.shape[1]
    return cache[block_table_row[:-(-seq_len // bs)].long()].flatten(0, 1)[:seq_len]


def gather_index_keys(index_cache, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A request's first seq_len indexer keys -> [seq_len, D]; an FP8 (keys, scales) cache dequantized (float32)."""
    if isinstance(index_cache, tuple):
        keys, scales = index_cache
        return dequantize_index_keys(gather_rows(keys, block_table_row, seq_len),
                                     gather_rows(scales, block_table_row, seq_len))
    return gather_rows(index_cache, block_table_row, seq_len)


def write_index_keys_ref(index_k, index_cache, slot_mapping) -> None:
    """SparseMLAImpl.write_index_keys' contract: one tensor, or FP8 (keys, scales) part by part."""
    if isinstance(index_cache, tuple):
        for rows, part in zip(index_k, index_cache):
            write_rows_ref(rows, part, slot_mapping)
    else:
        write_rows_ref(index_k, index_cache, slot_mapping)


def index_scores_ref(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [r, H, D], w [r, H] (scales folded in), keys [S, D] -> [r, S] float32 sum_h w * ReLU(q_h . k)."""
    logits = torch.einsum("rhd,sd->rhs", q.float(), keys.float()).relu_()
    return torch.einsum("rh,rhs->rs", w.float(), logits)


def select_topk_ref(index_q, index_w, index_cache, block_tables, query_start_loc: list[int], seq_lens: list[int],
                    index_topk: int, budget_bytes: int = SCORE_BUDGET_BYTES) -> torch.Tensor:
    """Per query token, the positions of its min(index_topk, visible) best-scoring visible tokens -> [T, k] int64
    (k = min(index_topk, longest context), -1 padding). Queries sit at the end of their request's context.
    index_cache: [blocks, bs, D], or FP8 (keys, scales) with index_q float8 and its scales in index_w."""
    t, heads = index_q.shape[:2]
    k = min(index_topk, max(seq_lens, default=0))
    out = torch.full((t, k), -1, dtype=torch.int64, device=index_q.device)
    for b, seq_len in enumerate(seq_lens):
        s, e = query_start_loc[b], query_start_loc[b + 1]
        if e == s:
            continue
        keys = gather_index_keys(index_cache, block_tables[b], seq_len)
        rows = max(1, budget_bytes // (heads * seq_len * 4))
        for r0 in range(s, e, rows):
            r1 = min(e, r0 + rows)
            scores = index_scores_ref(index_q[r0:r1], index_w[r0:r1], keys)
            q_pos = torch.arange(seq_len - (e - r0), seq_len - (e - r1), device=keys.device)
            visible = torch.arange(seq_len, device=keys.device)[None, :] <= q_pos[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            kk = min(k, seq_len)
            best = scores.topk(kk, dim=-1)
            out[r0:r1, :kk] = best.indices.masked_fill(best.values == float("-inf"), -1)
    return out


def sparse_mla_attention_ref(q_lat, q_pe, cache, block_tables, token_req: torch.Tensor, topk: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Absorbed MLA of each token over its selected positions only: q_lat [T, H, L], q_pe [T, H, R], cache
    [blocks, block_size, L + R], token_req [T] (request of each token), topk [T, k] positions (-1: none)
    -> [T, H, L], float32 math."""
    L, bs = q_lat.shape[-1], cache.shape[1]
    valid = topk >= 0
    pos = topk.clamp(min=0)
    blocks = block_tables.long()[token_req[:, None], pos // bs]
    lat = cache[blocks, pos % bs].float().masked_fill(~valid[..., None], 0)  # [T, k, L + R]; -1 reads nothing
    q = torch.cat([q_lat, q_pe], dim=-1).float()
    scores = torch.einsum("thd,tkd->thk", q, lat) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("thk,tkl->thl", scores.softmax(-1), lat[..., :L]).to(q_lat.dtype)


class TorchSparseMLAImpl(SparseMLAImpl, TorchMLAImpl):
    def write_index_keys(self, index_k, index_cache, slot_mapping) -> None:
        write_index_keys_ref(index_k, index_cache, slot_mapping)

    def select_topk(self, index_q, index_w, index_cache, meta: SparseMLAMetadata) -> torch.Tensor:
        nr = meta.num_absorbed_reqs
        return select_topk_ref(index_q, index_w, index_cache, meta.block_tables, meta.query_start_loc_cpu[:nr + 1],
                               meta.seq_lens_cpu[:nr], meta.index_topk)

    def attend_sparse(self, q_lat, q_pe, cache, meta: SparseMLAMetadata, topk) -> torch.Tensor:
        return sparse_mla_attention_ref(q_lat, q_pe, cache, meta.block_tables, meta.token_req.long(), topk,
                                        self.scale)


class TorchSparseMLABackend(TorchMLABackend):
    name = "torch_sparse_mla"
    cache_specs = (SparseMLASpec,)
    supports_sparse_mla = True
    supports_dense_mha_prefill = True
    impl_cls = TorchSparseMLAImpl
    builder_cls = SparseMLAMetadataBuilder
