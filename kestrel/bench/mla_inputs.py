"""A batch over a random latent cache for the MLA path tests (CPU and GPU) and benchmarks/mla_prefill.py: a layer
with random kv_b_proj, requests with given (query length, context length) over shuffled blocks, and the metadata
each backend's builder makes."""
from __future__ import annotations

import torch

from kestrel.attention.backend import CommonAttentionMetadata
from kestrel.attention.mla import MLAAttention
from kestrel.layers.linear import Linear
from kestrel.models.context import ModelContext


def make_layer(heads=4, rank=64, rope=16, nope=32, v=24, dtype=torch.float32, device="cpu", seed=0):
    torch.manual_seed(seed)
    kv_b = Linear(rank, heads * (nope + v), params_dtype=dtype, prefix="kv_b_proj").to(device)
    kv_b.weight.normal_(0, rank ** -0.5)
    layer = MLAAttention(ModelContext(None, dtype), "layers.0.mla_attn", heads, nope, rope, v, rank, kv_b,
                         rotary=None, scale=(nope + rope) ** -0.5)
    layer.process_weights_after_loading()
    return layer


def make_batch(layer, reqs, block_size, dtype, device, seed=1):
    """reqs: [(q_len, seq_len)], decodes (q_len 1) first. Returns (inputs for forward_mla, cache, common metadata,
    block table, slot mapping); the cache holds random latents for every context token but the new ones."""
    g = torch.Generator().manual_seed(seed)
    H, L, R, nope = layer.num_heads, layer.kv_lora_rank, layer.qk_rope_head_dim, layer.qk_nope_head_dim
    nblk = [-(-s // block_size) for _, s in reqs]
    total = sum(nblk) + 1
    perm = torch.randperm(total, generator=g)[:sum(nblk)]
    width = max(nblk)
    bt = torch.zeros(len(reqs), width, dtype=torch.int32)
    o = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[o:o + n]
        o += n
    cache = torch.randn(total, block_size, L + R, generator=g).to(dtype)
    cache[..., :L] *= 2  # normalised latents are larger than the rope part
    slots, qsl = [], [0]
    for b, (q, s) in enumerate(reqs):
        for p in range(s - q, s):
            slots.append(int(bt[b, p // block_size]) * block_size + p % block_size)
        qsl.append(qsl[-1] + q)
    t = qsl[-1]
    # views of one projection output, as the model gives them (moved before splitting, so they stay views)
    q_nope, q_pe = torch.randn(t, H, nope + R, generator=g).to(device, dtype).split([nope, R], dim=-1)
    kv_c = (2 * torch.randn(t, L, generator=g)).to(dtype)
    k_pe = torch.randn(t, R, generator=g).to(dtype)
    num_decodes = next((i for i, (q, _) in enumerate(reqs) if q != 1), len(reqs))
    sl = [s for _, s in reqs]
    common = CommonAttentionMetadata(t, len(reqs), num_decodes, max(q for q, _ in reqs), max(sl),
                                     torch.tensor(qsl, dtype=torch.int32, device=device),
                                     torch.tensor(sl, dtype=torch.int32, device=device), qsl, sl)
    to = lambda x: x.to(device)  # noqa: E731
    return ((to(q_nope), to(q_pe), to(kv_c), to(k_pe)), to(cache), common, to(bt),
            torch.tensor(slots, dtype=torch.int64, device=device))


def run_backend(backend, layer, batch, block_size, as_decode: bool | None = None):
    """forward_mla through `backend`'s builder and impl on a copy of the batch's cache. as_decode False/True
    overrides the batch's decode count (0: every request counts as a prefill; all: every one as a decode)."""
    (q_nope, q_pe, kv_c, k_pe), cache, common, bt, slots = batch
    cache = cache.clone()
    if as_decode is not None:
        common = CommonAttentionMetadata(**{**common.__dict__, "num_decodes": common.num_reqs if as_decode else 0})
    builder = backend.builder_cls(layer.kv_cache_spec, block_size, cache.device)
    meta = builder.build(common, bt, slots)
    impl = backend.impl_cls(layer.num_heads, layer.head_dim, layer.scale, 1)
    return impl.forward_mla(q_nope, q_pe, kv_c, k_pe, cache, meta, layer), meta


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
