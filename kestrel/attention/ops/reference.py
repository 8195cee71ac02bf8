"""Plain PyTorch references for the Triton ops in this folder, and the attention of the `torch_ref` backend.

They follow the same contracts as `triton_attention.py` and are written for clarity, not speed: K/V are
gathered through the block table one sequence at a time and every softmax runs in float32. The tests and
`benchmarks/gpu_attention_check.py` compare the Triton kernels against these.

Masking follows transformers (masking_utils: causal, and `sliding_window_overlay`): a query at absolute
position p sees the keys at positions max(0, p - W + 1) .. p for a sliding window W (W keys, itself included),
all of 0 .. p without one. Only the blocks that hold a visible key are read: blocks that fell out of the window
may already hold another request's data. Soft-capping (Gemma 2) replaces a scaled logit s by
cap * tanh(s / cap) before the mask. Attention sinks (gpt-oss): a learned logit per query head joins each
row's softmax denominator as a key with no value (transformers' `sinks` column, dropped after the softmax). A bidirectional prefix of L tokens (PaliGemma's image + prompt) also lets
queries at positions < L see keys at positions < L (transformers' `block_sequence_ids` over the prefix); the
scheduler computes such a prefix in one chunk, so those keys are in the cache.

A float8 cache (kestrel/attention/kv_quant.py) holds K / k_scale and V / v_scale: the write quantises, the
attention reads value * scale in float32.
"""
from __future__ import annotations

import torch

from kestrel.attention.kv_quant import dequantize, is_fp8, quantize


def cache_value(x, cache_dtype, scale=None):
    """What a cache of `cache_dtype` stores for x: x quantised with `scale` (default 1.0) for float8, else x."""
    if is_fp8(cache_dtype):
        return quantize(x, 1.0 if scale is None else scale, cache_dtype)
    return x.to(cache_dtype)


def reshape_and_cache_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Write token t's K/V to slot slot_mapping[t] (slot = block * block_size + offset); slot < 0 skips.
    key/value may be longer than slot_mapping (CUDA-graph padding): the extra rows are ignored."""
    bs = k_cache.shape[1]
    n = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # indexed by (block, offset): the caches may be views with a block stride wider than a block (kv_allocation)
    k_cache[slots // bs, slots % bs] = cache_value(key[:n][keep], k_cache.dtype, k_scale)
    v_cache[slots // bs, slots % bs] = cache_value(value[:n][keep], v_cache.dtype, v_scale)


def gather_kv(cache: torch.Tensor, block_row: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens start..end-1 of one sequence from a paged cache -> [end - start, H, D]. Reads only the blocks
    that hold them (never the block-table entries before `start`'s block)."""
    bs = cache.shape[1]
    first, last = start // bs, -(-end // bs)
    return cache[block_row[first:last].long()].flatten(0, 1)[start - first * bs : end - first * bs]


def window_start(first_query_pos: int, sliding_window: int | None, chunk_size: int = 0) -> int:
    """The first key position any query at >= first_query_pos can see."""
    lo = max(0, first_query_pos - sliding_window + 1) if sliding_window else 0
    return max(lo, first_query_pos // chunk_size * chunk_size) if chunk_size else lo


def _attend(q, k, v, q_pos, k_pos, scale, sliding_window, softcap, prefix_len: int = 0, chunk_size: int = 0,
            sinks=None):
    """q [M, Hq, D] at positions q_pos [M]; k/v [N, Hkv, D] at positions k_pos [N]; sinks [Hq] or None.
    float32 out."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq, M, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, N, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, M, N]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    visible = k_pos[None, :] <= q_pos[:, None]
    if sliding_window:
        visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
    if chunk_size:  # chunked local attention: the keys of the query's own chunk
        visible &= k_pos[None, :] >= q_pos[:, None] // chunk_size * chunk_size
    if prefix_len:
        visible |= (k_pos[None, :] < prefix_len) & (q_pos[:, None] < prefix_len)
    s = s.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().to(s.device)[:, None, None].expand(-1, s.shape[1], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.matmul(p, vf).transpose(0, 1)  # [M, Hq, D]


def paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out=None, *,
                        sliding_window: int | None = None, softcap: float = 0.0,
                        bidirectional_lens: list[int] | None = None, k_scale=None, v_scale=None,
                        chunk_size: int = 0, sinks=None, **_):
    """Causal varlen attention over a paged cache: q [T, Hq, D] -> [T, Hq, D] (out's dtype, default q's).

    Sequence b's queries q[query_start_loc[b]:query_start_loc[b+1]] sit at positions seq_lens[b] - q_len_b ..
    seq_lens[b] - 1; its K/V (cached prefix and new tokens) are in the cache. A sequence with seq_len 0
    (a padding row) gives zeros. query_start_loc / seq_lens: tensors or lists. k_scale / v_scale: a float8
    cache's scales (default 1.0). chunk_size C: chunked local attention (a query at p sees keys
    floor(p / C) * C .. p; 0 = off). sinks: a float tensor [Hq] of per-head sink logits (None: no sinks).
    """
    out = torch.empty_like(q) if out is None else out
    qsl = query_start_loc.tolist() if torch.is_tensor(query_start_loc) else list(query_start_loc)
    lens = seq_lens.tolist() if torch.is_tensor(seq_lens) else list(seq_lens)
    for b, seq_len in enumerate(lens):
        s, e = qsl[b], qsl[b + 1]
        if e == s:
            continue
        if seq_len == 0:
            out[s:e] = 0
            continue
        lo = window_start(seq_len - (e - s), sliding_window, chunk_size)
        k = dequantize(gather_kv(k_cache, block_tables[b], lo, seq_len), 1.0 if k_scale is None else k_scale)
        v = dequantize(gather_kv(v_cache, block_tables[b], lo, seq_len), 1.0 if v_scale is None else v_scale)
        q_pos = torch.arange(seq_len - (e - s), seq_len, device=q.device)
        k_pos = torch.arange(lo, seq_len, device=q.device)
        prefix = bidirectional_lens[b] if bidirectional_lens else 0
        out[s:e] = _attend(q[s:e], k, v, q_pos, k_pos, scale, sliding_window, softcap, prefix,
                           chunk_size, sinks).to(out.dtype)
    return out


def prefill_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out=None, **kw):
    """`prefill_attention`'s contract: paged_attention_ref (same keyword arguments)."""
    return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out, **kw)


def decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, **kw):
    """One query per sequence at position seq_lens[b]-1; seq_len 0 (padding) gives zeros."""
    qsl = list(range(q.shape[0] + 1))
    return paged_attention_ref(q, k_cache, v_cache, block_tables, qsl, seq_lens, scale, out, **kw)


def rms_norm_ref(x, weight, eps, residual=None):
    """HF Llama RMSNorm; with residual: new_residual = x + residual (rounded to x.dtype), out = norm(new_residual)."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight.float() * normed.to(x.dtype).float()).to(x.dtype)
    return out if residual is None else (out, x)


def silu_and_mul_ref(x):
    half = x.shape[-1] // 2
    gate, up = x[..., :half].float(), x[..., half:].float()
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def rotary_embedding_ref(positions, q, k, cos_sin_cache, rot_dim, is_neox=True):
    """Returns rotated copies of (q, k); cos_sin_cache[pos] = [cos (rot_dim/2) | sin (rot_dim/2)]."""
    half = rot_dim // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rot(x):
        x = x.clone()
        xr = x[..., :rot_dim].float()
        if is_neox:
            x1, x2 = xr[..., :half], xr[..., half:]
            xr = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            xr = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        x[..., :rot_dim] = xr.to(x.dtype)
        return x

    return rot(q), rot(k)
