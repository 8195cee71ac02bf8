"""The block pool shared by every KV-cache group: ref counts, a free list in LRU order and a hash-chained prefix
cache. Pure Python: the tensors themselves live in the model runner.

A full block's hash covers its tokens and its parent's hash, so equal hashes mean equal prefixes; the pool maps
(group, hash) to a block, since each group keeps its own copy of a prefix. A block whose last user finished stays
in that map while it sits on the free list; a later request with the same prefix takes it back, and only when the
block is reallocated for new tokens is its hash evicted (oldest freed first)."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

_ROOT_HASH = b"kestrel-kv-root"
NULL_BLOCK_ID = 0  # reserved when a manager needs it (needs_null_block): stands for a block no query reads


def hash_block(parent: bytes | None, tokens: list[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(parent or _ROOT_HASH, digest_size=16)
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: tuple[int, bytes] | None = None  # (group id, hash) while registered in the prefix cache


class TierHit(KVBlock):
    """A prefix-hit entry that a KV tier behind the prefix cache holds, not the device: the allocation gives it
    device memory (a block, or a snapshot slot) to load into."""

    def __init__(self, key: tuple[int, bytes]):
        super().__init__(-1)
        self.key = key


class BlockPool:
    def __init__(self, num_blocks: int, reserve_null: bool = False):
        if num_blocks < 1 + reserve_null:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        first = 1 if reserve_null else 0
        self.null_block = self.blocks[0] if reserve_null else None
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(first, num_blocks))  # head: evict first
        self.cached: dict[tuple[int, bytes], KVBlock] = {}
        # (key, block id) -> None: told when a registered block is reallocated (a KV tier saves it), and when one
        # loses its last user (a KV tier may save it then, ahead of the eviction)
        self.on_evict = self.on_free = None

    @property
    def num_blocks(self) -> int:
        """Blocks that requests can hold (the null block excluded)."""
        return len(self.blocks) - (self.null_block is not None)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def lookup(self, key: tuple[int, bytes]) -> KVBlock | None:
        return self.cached.get(key)

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
                    if self.on_evict is not None:
                        self.on_evict(block.block_hash, block_id)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks) -> None:
        """Take a reference on prefix-cache hits (pulling them off the free list when unused)."""
        for b in blocks:
            if b is self.null_block:
                continue
            if b.ref_cnt == 0:
                del self.free[b.block_id]
            b.ref_cnt += 1

    def release(self, blocks) -> None:
        """Drop one reference each; blocks reaching zero go to the free list's tail in the given order."""
        for b in blocks:
            if b is self.null_block:
                continue
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"block {b.block_id} released twice"
            if b.ref_cnt == 0:
                self.free[b.block_id] = None
                if self.on_free is not None and b.block_hash is not None and self.cached.get(b.block_hash) is b:
                    self.on_free(b.block_hash, b.block_id)

    def cache(self, block: KVBlock, key: tuple[int, bytes]) -> None:
        if block.block_hash is None and key not in self.cached and block is not self.null_block:
            block.block_hash = key
            self.cached[key] = block

    def forget(self, block_id: int) -> tuple[int, bytes] | None:
        """Take block `block_id` out of the prefix cache (its contents are wrong); returns the key it had."""
        block = self.blocks[block_id]
        key = block.block_hash
        if key is not None and self.cached.get(key) is block:
            del self.cached[key]
        block.block_hash = None
        return key

    def reset_prefix_cache(self) -> None:
        for b in self.cached.values():
            b.block_hash = None
        self.cached.clear()
