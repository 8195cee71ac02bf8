"""What each attention-like layer keeps per token: its KV-cache spec. Layers with equal specs form a group; each
group has its own block table and its own manager (kestrel/engine/kv_cache.py) under one coordinator, and the
model runner allocates every layer's cache from its spec.

A new kind of cache (MLA latent, indexer keys, recurrent state) is a new spec class here, a manager for it in the
KV manager, and a backend that reads it: never a special case in the runner or the scheduler."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of all cache kinds: `page_bytes` is what one block of `block_size` tokens costs in one layer."""
    dtype: torch.dtype

    def page_bytes(self, block_size: int) -> int:
        raise NotImplementedError

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        raise NotImplementedError

    def layer_view(self, cache: torch.Tensor):
        """What a layer holds of its slot (viewed as `cache_shape`): a (k_cache, v_cache) pair by default."""
        return cache[0], cache[1]


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """K and V for every token, paged: one [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer."""
    num_kv_heads: int = 1
    head_dim: int = 1

    def page_bytes(self, block_size: int) -> int:
        return 2 * block_size * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def blocks_needed(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """Most blocks one request of `num_tokens` tokens holds at once (admission checks)."""
        return cdiv(num_tokens, block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Paged like full attention, but a query at position p reads only keys p - window + 1 .. p: blocks that fall
    out of every future query's window are freed while the request runs."""
    sliding_window: int = 0

    def blocks_needed(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        return min(cdiv(num_tokens, block_size), cdiv(self.sliding_window - 1 + max_chunk, block_size) + 1)


@dataclass(frozen=True)
class MLASpec(KVCacheSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): one latent per token, the normalised kv_lora_rank part followed
    by the rotated qk_rope_head_dim key part, shared by every head; one [num_blocks, block_size, latent_dim] tensor
    per layer. Prefix caching as for full attention: every block is kept while the request runs."""
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def page_bytes(self, block_size: int) -> int:
        return block_size * self.latent_dim * torch.empty((), dtype=self.dtype).element_size()

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.latent_dim)

    def layer_view(self, cache: torch.Tensor):
        return cache

    def blocks_needed(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        return cdiv(num_tokens, block_size)


@dataclass
class KVCacheGroup:
    """Layers (by name) sharing one spec, one block table and one manager. Layer i of every group shares cache
    tensor i (`slot`): one block id then costs the same memory in every group, so all groups draw on one pool."""
    group_id: int
    spec: KVCacheSpec
    layer_names: list[str]


def group_layers(specs: dict[str, KVCacheSpec]) -> list[KVCacheGroup]:
    """Group layers by spec, in model order. With several specs, each spec's layers are cut into groups of the
    smallest spec's layer count, so every group has (at most) the same number of layers: Gemma 3's 4 full and 22
    sliding layers become 1 + 6 groups of 4 layers that share 4 cache tensors."""
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(spec, []).append(name)
    pages = {s.page_bytes(16) for s in by_spec}
    if len(pages) > 1:
        raise NotImplementedError(f"layers with different page sizes in one model ({sorted(pages)} bytes a block): "
                                  "not supported yet")
    size = min(len(v) for v in by_spec.values())
    groups: list[KVCacheGroup] = []
    for spec, names in by_spec.items():
        for i in range(0, len(names), size):
            groups.append(KVCacheGroup(len(groups), spec, names[i:i + size]))
    return groups
