"""Reference MLA in plain PyTorch, both paths: absorbed attention over the paged latent cache and dense attention
over expanded contexts. Runs anywhere; the CPU backend and the yardstick for the Triton MLA kernels.
`torch_mla_absorbed` declares no dense prefill, so its builder sends every token through the absorbed path
(the shape of a backend that only has a decode kernel)."""
from __future__ import annotations

import torch

from kestrel.attention.mla import MLABackend, MLAImpl, MLAMetadata


def write_latent_ref(kv_c, k_pe, cache, slot_mapping) -> None:
    write_rows_ref(torch.cat([kv_c, k_pe], dim=-1), cache, slot_mapping)


def write_rows_ref(rows, cache, slot_mapping) -> None:
    """rows [T, D] into a paged cache [blocks, block_size, D] at their slots (-1: padding, not written)."""
    n, bs = rows.shape[0], cache.shape[1]
    valid = slot_mapping[:n] >= 0
    slots = slot_mapping[:n][valid]
    # indexed by (block, offset): the cache may be a view with a block stride wider than a block (kv_allocation)
    cache[slots // bs, slots % bs] = rows[valid].to(cache.dtype)


def _causal_mask(q_len: int, seq_len: int, device) -> torch.Tensor:
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    return torch.arange(seq_len, device=device)[None, :] <= q_pos  # [q_len, seq_len]


def mla_latent_attention_ref(q_lat, q_pe, cache, block_tables, query_start_loc, seq_lens, scale) -> torch.Tensor:
    """Absorbed MLA: q_lat [T, H, L], q_pe [T, H, R] over each request's latents (cache [blocks, block_size, L + R],
    the first L dims also the values), causal within the request -> [T, H, L] in float32 math."""
    L = q_lat.shape[-1]
    bs = cache.shape[1]
    out = torch.zeros_like(q_lat)
    qsl = query_start_loc.tolist() if torch.is_tensor(query_start_loc) else query_start_loc
    sl = seq_lens.tolist() if torch.is_tensor(seq_lens) else seq_lens
    for b in range(len(qsl) - 1):
        s, e, seq_len = qsl[b], qsl[b + 1], sl[b]
        if e == s or seq_len == 0:
            continue
        lat = cache[block_tables[b, :-(-seq_len // bs)].long()].flatten(0, 1)[:seq_len].float()  # [S, L + R]
        q = torch.cat([q_lat[s:e], q_pe[s:e]], dim=-1).float()  # [q, H, L + R]
        scores = torch.einsum("qhd,sd->hqs", q, lat) * scale
        scores = scores.masked_fill(~_causal_mask(e - s, seq_len, q.device), float("-inf"))
        out[s:e] = torch.einsum("hqs,sl->qhl", scores.softmax(-1), lat[:, :L]).to(out.dtype)
    return out


def mla_dense_attention_ref(q_nope, q_pe, k_nope, k_pe, v, q_start, ctx_start, seq_lens, scale) -> torch.Tensor:
    """Expanded MLA: per request, q [q_len, H, nope + R] against k = [k_nope, k_pe (shared by the heads)] and v
    over its whole context (ctx_start offsets into k/v), causal -> [T, H, v]."""
    out = q_nope.new_zeros(q_nope.shape[0], q_nope.shape[1], v.shape[-1])
    for j, seq_len in enumerate(seq_lens):
        s, e, c0 = q_start[j], q_start[j + 1], ctx_start[j]
        q = torch.cat([q_nope[s:e], q_pe[s:e]], dim=-1).float()
        kp = k_pe[c0:c0 + seq_len].float()[:, None, :].expand(-1, q.shape[1], -1)
        k = torch.cat([k_nope[c0:c0 + seq_len].float(), kp], dim=-1)
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale
        scores = scores.masked_fill(~_causal_mask(e - s, seq_len, q.device), float("-inf"))
        out[s:e] = torch.einsum("hqs,shv->qhv", scores.softmax(-1), v[c0:c0 + seq_len].float()).to(out.dtype)
    return out


class TorchMLAImpl(MLAImpl):
    def write_latent(self, kv_c, k_pe, cache, slot_mapping) -> None:
        write_latent_ref(kv_c, k_pe, cache, slot_mapping)

    def attend_latent(self, q_lat, q_pe, cache, meta: MLAMetadata) -> torch.Tensor:
        nr = meta.num_absorbed_reqs
        qsl = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
        sl = meta.seq_lens_cpu or meta.seq_lens.tolist()
        return mla_latent_attention_ref(q_lat, q_pe, cache, meta.block_tables, qsl[:nr + 1], sl[:nr], self.scale)

    def attend_dense(self, q_nope, q_pe, cache, meta: MLAMetadata, layer, out) -> None:
        k_nope, k_pe, v = self.expand_contexts(cache, meta, layer)
        na, nr = meta.num_absorbed_reqs, meta.num_reqs
        q_start = [x - meta.num_absorbed_tokens for x in meta.query_start_loc_cpu[na:nr + 1]]
        out.copy_(mla_dense_attention_ref(q_nope, q_pe, k_nope, k_pe, v, q_start, meta.dense_ctx_start_cpu,
                                          meta.seq_lens_cpu[na:nr], self.scale))


class TorchMLABackend(MLABackend):
    name = "torch_mla"
    devices = ("cpu", "cuda")
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    supports_dense_mha_prefill = True
    impl_cls = TorchMLAImpl


class TorchMLAAbsorbedBackend(TorchMLABackend):
    name = "torch_mla_absorbed"
    supports_dense_mha_prefill = False
