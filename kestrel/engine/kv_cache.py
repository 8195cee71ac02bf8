"""Paged KV-cache bookkeeping: a block pool with ref counts, a free list in LRU order, and a hash-chained
prefix cache. Pure Python: the tensors themselves live in the model runner.

A full block's hash covers its tokens and its parent's hash, so equal hashes mean equal prefixes. A block
whose last user finished stays in the hash map while it sits on the free list; a later request with the same
prefix takes it back, and only when the block is reallocated for new tokens is its hash evicted (oldest freed
first)."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from kestrel.engine.request import PLACEHOLDER, Request

_ROOT_HASH = b"kestrel-kv-root"


def hash_block(parent: bytes | None, tokens: list[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(parent or _ROOT_HASH, digest_size=16)
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # head: evict first
        self.cached: dict[bytes, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # reusing a cached block for new tokens evicts its prefix
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-cache hits (pulling them off the free list when unused)."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free[b.block_id]
            b.ref_cnt += 1

    def release(self, blocks) -> None:
        """Drop one reference each; blocks reaching zero go to the free list's tail in the given order."""
        for b in blocks:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"block {b.block_id} released twice"
            if b.ref_cnt == 0:
                self.free[b.block_id] = None

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for b in self.cached.values():
            b.block_hash = None
        self.cached.clear()


class KVCacheManager:
    """Which blocks each request holds, prefix-cache lookups and statistics."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the same, as ids (kept in step: read every step)
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of them, served from the cache

    # ---- capacity
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- hashing
    def _block_hashes(self, req: Request) -> list[bytes]:
        bs, hashes = self.block_size, req.block_hashes
        extra = getattr(req, "cache_salt", b"") or b""
        known = req.num_tokens - (1 if req.output_token_ids and req.output_token_ids[-1] == PLACEHOLDER else 0)
        while (len(hashes) + 1) * bs <= known:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, req.tokens_slice(i * bs, (i + 1) * bs), extra))
        return hashes

    # ---- allocation
    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks, leaving at least one token to compute (for its logits)."""
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = self._block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[KVBlock] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (plus cache hits).
        Returns False, changing nothing, when the pool is short."""
        blocks = self.req_blocks.get(req.request_id, [])
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        if not computed and total <= len(blocks) * self.block_size:
            return True  # fits in the blocks it holds (most decode steps)
        num_new_blocks = max(0, self.blocks_needed(total) - len(blocks) - len(computed))
        reclaimed = sum(1 for b in computed if b.ref_cnt == 0)  # hits that sit on the free list
        if num_new_blocks + reclaimed > self.pool.num_free:
            return False
        self.pool.touch(list(computed))
        blocks = self.req_blocks.setdefault(req.request_id, blocks)
        ids = self.req_block_ids.setdefault(req.request_id, [])
        new = self.pool.allocate(num_new_blocks)
        blocks.extend(computed)
        blocks.extend(new)
        ids.extend(b.block_id for b in computed)
        ids.extend(b.block_id for b in new)
        if computed:
            self._num_cached_blocks[req.request_id] = len(blocks) - num_new_blocks
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's fully computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks.get(req.request_id)
        if not blocks:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(blocks))
        start = self._num_cached_blocks.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(req)
        for i in range(start, num_full):
            self.pool.cache(blocks[i], hashes[i])
        self._num_cached_blocks[req.request_id] = num_full

    def free(self, req: Request) -> None:
        """Release a finished, aborted or preempted request's blocks, tail first (so shared prefixes outlive tails)."""
        blocks = self.req_blocks.pop(req.request_id, [])
        self.req_block_ids.pop(req.request_id, None)
        self._num_cached_blocks.pop(req.request_id, None)
        self.pool.release(reversed(blocks))

    def block_ids(self, req: Request) -> list[int]:
        """The request's block ids (a live list owned by the manager: read, don't modify)."""
        return self.req_block_ids.get(req.request_id, [])

    def reset_prefix_cache(self) -> bool:
        self.pool.reset_prefix_cache()
        self._num_cached_blocks = {k: 0 for k in self._num_cached_blocks}
        return True
