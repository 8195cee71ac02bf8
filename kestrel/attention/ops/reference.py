"""Plain PyTorch references for the Triton ops in this folder.

They follow the same contracts as `triton_attention.py` and are written for clarity, not speed: K/V are
gathered through the block table one sequence at a time and every softmax runs in float32. The tests and
`benchmarks/gpu_attention_check.py` compare the Triton kernels against these.
"""
from __future__ import annotations

import torch


def reshape_and_cache_ref(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write token t's K/V to slot slot_mapping[t] (slot = block * block_size + offset); slot < 0 skips."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """Tokens 0..length-1 of one sequence from a paged cache -> [length, H, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_row.long()[pos // block_size]
    return cache[blocks, pos % block_size]


def _attend(q, k, v, q_pos, scale):
    """q [M, Hq, D], k/v [N, Hkv, D], causal on absolute positions q_pos [M] vs key index. fp32 out."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq, M, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, N, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, M, N]
    kpos = torch.arange(k.shape[0], device=q.device)
    s = s.masked_fill(kpos[None, None, :] > q_pos[None, :, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, vf).transpose(0, 1)  # [M, Hq, D]


def prefill_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out=None, **_):
    """Causal varlen attention; sequence b's queries sit at positions seq_lens[b]-q_len_b .. seq_lens[b]-1."""
    out = torch.empty_like(q) if out is None else out
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        s, e = qsl[b], qsl[b + 1]
        if e == s:
            continue
        seq_len = lens[b]
        k = gather_kv(k_cache, block_tables[b], seq_len)
        v = gather_kv(v_cache, block_tables[b], seq_len)
        q_pos = torch.arange(seq_len - (e - s), seq_len, device=q.device)
        out[s:e] = _attend(q[s:e], k, v, q_pos, scale).to(out.dtype)
    return out


def decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, **_):
    """One query per sequence at position seq_lens[b]-1; seq_len 0 (padding) gives zeros."""
    out = torch.empty_like(q) if out is None else out
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            out[b] = 0
            continue
        k = gather_kv(k_cache, block_tables[b], seq_len)
        v = gather_kv(v_cache, block_tables[b], seq_len)
        q_pos = torch.tensor([seq_len - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, q_pos, scale)[0].to(out.dtype)
    return out


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
