"""Paged KV-cache bookkeeping: one block pool with ref counts, a free list in LRU order and a hash-chained prefix
cache, shared by one manager per KV-cache group (kestrel/core/kv_spec.py) under a coordinator. Pure Python: the
tensors themselves live in the model runner.

A full block's hash covers its tokens and its parent's hash, so equal hashes mean equal prefixes; the pool maps
(group, hash) to a block, since each group keeps its own copy of a prefix. A block whose last user finished stays
in that map while it sits on the free list; a later request with the same prefix takes it back, and only when the
block is reallocated for new tokens is its hash evicted (oldest freed first).

Full-attention groups keep every block of a request. Sliding-window groups free the blocks that fell out of the
window while the request runs (their place in the block table points at the null block, id 0, which the kernels
never read), and a prefix hit there needs only the blocks under the window before the hit point."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from kestrel.core.kv_spec import FullAttentionSpec, KVCacheGroup, KVCacheSpec, MLASpec, SlidingWindowSpec, cdiv
from kestrel.core.step import PLACEHOLDER
from kestrel.engine.request import Request

_ROOT_HASH = b"kestrel-kv-root"
NULL_BLOCK_ID = 0  # reserved when a sliding-window group exists: stands for blocks freed out of the window


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


class BlockPool:
    def __init__(self, num_blocks: int, reserve_null: bool = False):
        if num_blocks < 1 + reserve_null:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        first = 1 if reserve_null else 0
        self.null_block = self.blocks[0] if reserve_null else None
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(first, num_blocks))  # head: evict first
        self.cached: dict[tuple[int, bytes], KVBlock] = {}

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

    def cache(self, block: KVBlock, key: tuple[int, bytes]) -> None:
        if block.block_hash is None and key not in self.cached and block is not self.null_block:
            block.block_hash = key
            self.cached[key] = block

    def reset_prefix_cache(self) -> None:
        for b in self.cached.values():
            b.block_hash = None
        self.cached.clear()


class FullAttentionManager:
    """The blocks one group holds per request, for layers that read every earlier token."""

    def __init__(self, group_id: int, spec: KVCacheSpec | None, pool: BlockPool, block_size: int):
        self.group_id, self.spec, self.pool, self.block_size = group_id, spec, pool, block_size
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the same, as ids (kept in step: read every step)
        self.num_cached: dict[str, int] = {}  # leading blocks already registered in the prefix cache

    def max_hit(self, hashes: list[bytes], limit: int) -> int:
        """Longest prefix (in blocks, <= limit) this group can serve from the cache."""
        n = 0
        while n < limit and self.pool.lookup((self.group_id, hashes[n])) is not None:
            n += 1
        return n

    def hit_blocks(self, hashes: list[bytes], n: int) -> list[KVBlock]:
        return [self.pool.lookup((self.group_id, h)) for h in hashes[:n]]

    def remove_skipped(self, rid: str, num_computed: int) -> None:
        """Free blocks no future query reads (none, for full attention)."""

    def num_new_blocks(self, rid: str, total_tokens: int, hits: list[KVBlock]) -> int:
        have = len(self.req_blocks.get(rid, ())) + len(hits)
        return max(0, cdiv(total_tokens, self.block_size) - have)

    def add(self, rid: str, hits: list[KVBlock], new: list[KVBlock]) -> None:
        blocks = self.req_blocks.setdefault(rid, [])
        ids = self.req_block_ids.setdefault(rid, [])
        blocks.extend(hits)
        blocks.extend(new)
        ids.extend(b.block_id for b in hits)
        ids.extend(b.block_id for b in new)
        if hits:
            self.num_cached[rid] = len(hits)

    def cache_blocks(self, rid: str, hashes: list[bytes], num_full: int) -> None:
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return
        num_full = min(num_full, len(blocks))
        start = self.num_cached.get(rid, 0)
        for i in range(start, num_full):
            self.pool.cache(blocks[i], (self.group_id, hashes[i]))
        self.num_cached[rid] = max(start, num_full)

    def free(self, rid: str) -> None:
        """Release a request's blocks, tail first (so shared prefixes outlive tails)."""
        blocks = self.req_blocks.pop(rid, [])
        self.req_block_ids.pop(rid, None)
        self.num_cached.pop(rid, None)
        self.pool.release(reversed(blocks))


class SlidingWindowManager(FullAttentionManager):
    """Blocks of a sliding-window group: those wholly before every future query's window go back to the pool
    during the request, and their entries become the null block."""

    def __init__(self, group_id: int, spec: SlidingWindowSpec, pool: BlockPool, block_size: int):
        super().__init__(group_id, spec, pool, block_size)
        self.window_blocks = cdiv(spec.sliding_window - 1, block_size)  # blocks a query needs before its own
        self.first_live: dict[str, int] = {}

    def max_hit(self, hashes: list[bytes], limit: int) -> int:
        """Largest n <= limit such that the `window_blocks` blocks before n are all cached (n = 0 always is)."""
        n = limit
        while n > 0:
            start = max(0, n - self.window_blocks)
            miss = next((i for i in range(n - 1, start - 1, -1)
                         if self.pool.lookup((self.group_id, hashes[i])) is None), None)
            if miss is None:
                return n
            n = miss  # no window ending after a miss can be complete
        return 0

    def hit_blocks(self, hashes: list[bytes], n: int) -> list[KVBlock]:
        start = max(0, n - self.window_blocks)
        return [self.pool.null_block] * start + [self.pool.lookup((self.group_id, h)) for h in hashes[start:n]]

    def first_needed(self, num_computed: int) -> int:
        """The first block a query after `num_computed` tokens still reads."""
        return max(0, num_computed - self.spec.sliding_window + 1) // self.block_size

    def remove_skipped(self, rid: str, num_computed: int) -> None:
        self.free_before(rid, self.first_needed(num_computed))

    def free_before(self, rid: str, first_needed: int) -> None:
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return
        ids = self.req_block_ids[rid]
        start = self.first_live.get(rid, 0)
        if first_needed <= start:
            return
        end = min(first_needed, len(blocks))
        freed = blocks[start:end]
        null = self.pool.null_block
        for i in range(start, end):
            blocks[i], ids[i] = null, null.block_id
        self.first_live[rid] = end
        self.pool.release(reversed(freed))

    def free(self, rid: str) -> None:
        self.first_live.pop(rid, None)
        super().free(rid)


def manager_class(spec: KVCacheSpec | None):
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager
    if spec is None or isinstance(spec, (FullAttentionSpec, MLASpec)):
        return FullAttentionManager
    raise NotImplementedError(f"no KV manager for {type(spec).__name__}")


class KVCacheManager:
    """The coordinator: one manager per KV-cache group over one shared pool; which blocks each request holds in
    every group, prefix-cache lookups and statistics. Without groups, one full-attention group."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 groups: list[KVCacheGroup] | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        specs = [g.spec for g in groups] if groups else [None]
        self.pool = BlockPool(num_blocks, reserve_null=any(isinstance(s, SlidingWindowSpec) for s in specs))
        # full-attention groups first: their hits bound the sliding ones' (see get_computed_blocks)
        self.managers = [manager_class(s)(i, s, self.pool, block_size) for i, s in enumerate(specs)]
        self._hit_order = sorted(self.managers, key=lambda m: isinstance(m, SlidingWindowManager))
        # Sliding groups with one window free the same positions at the same step: one representative per window
        # decides whether any of them has something to free (see allocate_slots).
        self._sliding = [m for m in self.managers if isinstance(m, SlidingWindowManager)]
        self._window_reps = [(w, m.first_live) for w, m in
                             {m.spec.sliding_window: m for m in reversed(self._sliding)}.items()]
        self._held_ids = self.managers[0].req_block_ids  # every group holds as many blocks per request
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of them, served from the cache
        # requests whose block ids grew since the scheduler last sent them to the runner (it discards them then)
        self.grown: set[str] = set()

    # ---- capacity
    @property
    def num_groups(self) -> int:
        return len(self.managers)

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

    @property
    def req_blocks(self) -> dict[str, list[KVBlock]]:
        """Blocks held per request in group 0 (tests and statistics)."""
        return self.managers[0].req_blocks

    def blocks_needed(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """Most blocks one request of `num_tokens` tokens holds at once, over all groups."""
        chunk = max_chunk or num_tokens
        return sum(cdiv(num_tokens, self.block_size) if m.spec is None
                   else m.spec.blocks_needed(num_tokens, self.block_size, chunk) for m in self.managers)

    # ---- hashing
    def _block_hashes(self, req: Request) -> list[bytes]:
        bs, hashes = self.block_size, req.block_hashes
        known = req.num_tokens - (1 if req.output_token_ids and req.output_token_ids[-1] == PLACEHOLDER else 0)
        while (len(hashes) + 1) * bs <= known:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, req.tokens_slice(i * bs, (i + 1) * bs),
                                     req.block_extra(i * bs, (i + 1) * bs)))
        return hashes

    # ---- allocation
    def get_computed_blocks(self, req: Request) -> tuple[list[list[KVBlock]], int]:
        """Longest cached prefix every group can serve, in full blocks, leaving at least one token to compute
        (for its logits). Returns the hit blocks per group and the number of tokens they cover."""
        empty = [[] for _ in self.managers]
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return empty, 0
        hashes = self._block_hashes(req)
        n = min(len(hashes), (req.num_tokens - 1) // self.block_size)
        while True:  # each group can only shorten the hit; stop when no group does
            shorter = n
            for m in self._hit_order:
                shorter = m.max_hit(hashes, shorter)
            if shorter == n:
                break
            n = shorter
        self.prefix_queries += req.num_tokens
        self.prefix_hits += n * self.block_size
        return [m.hit_blocks(hashes, n) for m in self.managers], n * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[list[KVBlock]] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (plus cache hits), after
        freeing what sliding windows no longer need. Returns False, changing nothing, when the pool is short.

        Every group holds the same number of blocks per request (a window-freed one stays as the null block, and
        a hit is `n` blocks in every group), so without hits (every step but a request's first) all groups need
        the same number of new blocks: computed once, not per group. _allocate_per_group is the plain form."""
        if computed and any(computed):
            return self._allocate_per_group(req, num_new_tokens, computed)
        rid, bs = req.request_id, self.block_size
        num_computed = req.num_computed_tokens
        due = None  # window -> first block still needed, for the windows with blocks to free this step
        for window, first_live in self._window_reps:
            # SlidingWindowManager.first_needed without its max(0, .): a negative value is never due
            first_needed = (num_computed - window + 1) // bs
            if first_needed > first_live.get(rid, 0):
                due = due or {}
                due[window] = first_needed
        if due:
            for m in self._sliding:  # group order, as the per-group form releases them
                if (first_needed := due.get(m.spec.sliding_window)) is not None:
                    m.free_before(rid, first_needed)
        held = self._held_ids.get(rid)
        need = (num_computed + num_new_tokens + bs - 1) // bs - (len(held) if held else 0)
        if need <= 0:
            return True  # fits in the blocks it holds (most decode steps)
        if need * len(self.managers) > self.pool.num_free:
            return False
        for m in self.managers:
            m.add(rid, (), self.pool.allocate(need))
        self.grown.add(rid)
        return True

    def _allocate_per_group(self, req: Request, num_new_tokens: int,
                            computed: list[list[KVBlock]] | None = None) -> bool:
        """allocate_slots, asking each group on its own (requests with prefix-cache hits come this way)."""
        rid = req.request_id
        hits = computed if computed and any(computed) else [[] for _ in self.managers]
        num_hit_tokens = len(hits[0]) * self.block_size
        for m in self.managers:
            m.remove_skipped(rid, req.num_computed_tokens + num_hit_tokens)
        total = req.num_computed_tokens + num_hit_tokens + num_new_tokens
        need = [m.num_new_blocks(rid, total, h) for m, h in zip(self.managers, hits)]
        if not any(need) and not any(hits):
            return True  # fits in the blocks it holds (most decode steps)
        reclaimed = len({b.block_id for h in hits for b in h if b.ref_cnt == 0 and b is not self.pool.null_block})
        if sum(need) + reclaimed > self.pool.num_free:
            return False
        for h in hits:  # every group's hits leave the free list before any new block is taken from it
            self.pool.touch(h)
        for m, h, n in zip(self.managers, hits, need):
            m.add(rid, h, self.pool.allocate(n))
        self.grown.add(rid)
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's fully computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        if num_full <= self.managers[0].num_cached.get(req.request_id, 0):
            return  # no block filled since the last call (most decode steps); every group has cached as many
        hashes = self._block_hashes(req)
        for m in self.managers:
            m.cache_blocks(req.request_id, hashes, min(num_full, len(hashes)))

    def free(self, req: Request) -> None:
        """Release a finished, aborted or preempted request's blocks in every group."""
        for m in self.managers:
            m.free(req.request_id)
        self.grown.discard(req.request_id)

    def block_ids(self, req: Request) -> list[list[int]]:
        """The request's block ids per group (live lists owned by the managers: read, don't modify)."""
        return [m.req_block_ids.get(req.request_id, []) for m in self.managers]

    def reset_prefix_cache(self) -> bool:
        self.pool.reset_prefix_cache()
        for m in self.managers:
            m.num_cached = {k: 0 for k in m.num_cached}
        return True
