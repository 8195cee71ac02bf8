"""Reference paged attention in plain PyTorch: gathers each request's K/V through its block table.
Slow but simple and exact; the CPU backend and the yardstick for the Triton kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadata


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    nb, bs, h, d = k_cache.shape
    n = slot_mapping.shape[0]
    valid = slot_mapping[:n] >= 0
    slots = slot_mapping[:n][valid]
    k_cache.view(nb * bs, h, d).index_copy_(0, slots, k[:n][valid].to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slots, v[:n][valid].to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    bs = cache.shape[1]
    nblk = -(-seq_len // bs)
    return cache[block_table[:nblk].long()].flatten(0, 1)[:seq_len]  # [seq_len, Hkv, D]


def paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                        sliding_window: int = 0, logits_soft_cap: float = 0.0) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]; causal with each request's cached prefix; with a sliding window W a query at
    position p sees keys p - W + 1 .. p; soft-capping squashes scores to (-cap, cap) before the softmax."""
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist() if torch.is_tensor(query_start_loc) else query_start_loc
    sl = seq_lens.tolist() if torch.is_tensor(seq_lens) else seq_lens
    hq, hkv = q.shape[1], k_cache.shape[2]
    for b, seq_len in enumerate(sl):
        s, e = qsl[b], qsl[b + 1]
        if e == s:
            continue
        k = gather_kv(k_cache, block_tables[b], seq_len).to(q.dtype)
        v = gather_kv(v_cache, block_tables[b], seq_len).to(q.dtype)
        if hq != hkv:
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
        q_len = e - s
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos[:, None]  # [q_len, seq_len]
        if sliding_window:
            mask &= k_pos > q_pos[:, None] - sliding_window
        qh, kh, vh = q[s:e].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if logits_soft_cap:
            scores = (qh.float() @ kh.float().transpose(1, 2)) * scale
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
            o = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vh.float()).to(q.dtype)
        else:
            o = F.scaled_dot_product_attention(qh.contiguous(), kh.contiguous(), vh.contiguous(), attn_mask=mask,
                                               scale=scale)
        out[s:e] = o.transpose(0, 1)
    return out


class TorchRefImpl(AttentionImpl):
    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        n = meta.num_tokens
        out = torch.zeros_like(q)
        out[:n] = paged_attention_ref(q[:n], k_cache, v_cache, meta.block_tables,
                                      meta.query_start_loc_cpu or meta.query_start_loc,
                                      meta.seq_lens_cpu or meta.seq_lens, self.scale, self.sliding_window,
                                      self.logits_soft_cap)
        return out


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"
    devices = ("cpu", "cuda")
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    supports_sliding_window = True
    impl_cls = TorchRefImpl
