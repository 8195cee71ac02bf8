"""The coordinator: one manager per KV-cache group (managers.py) over one shared block pool (pool.py); which
blocks each request holds in every group, prefix-cache lookups, the admission limit and statistics. It reads
only the managers' interface: a new cache kind never edits this file.

A KV tier behind the prefix cache (a KV connector, kestrel/core/kv_connector.py: the host tier of
--kv-offloading-size, host_tier.py) is an option set by its engine add-on (`set_connector`): every manager's
lookup asks it where the device misses (KVManager.find), a hit there is a `TierHit` entry that the allocation
turns into a fresh device block loaded before the step (a manager whose hits come from a pool of its own, state
snapshots, loads its own in add()), and the pools tell it of every registered entry they reallocate (the save)."""
from __future__ import annotations

import logging

import torch

from kestrel.core.kv_connector import ROWS
from kestrel.core.kv_spec import FullAttentionSpec, KVCacheGroup
from kestrel.core.step import PLACEHOLDER
from kestrel.engine.kv.managers import KVManager, manager_class
from kestrel.engine.kv.pool import BlockPool, KVBlock, TierHit, hash_block
from kestrel.engine.request import Request

logger = logging.getLogger(__name__)


class KVCacheManager:
    """Without groups (tests), one full-attention group of `block_size` tokens a block; with groups, the block
    size is the specs' own."""

    def __init__(self, num_blocks: int, block_size: int | None = None, enable_prefix_caching: bool = True,
                 groups: list[KVCacheGroup] | None = None):
        if not groups:
            groups = [KVCacheGroup(0, FullAttentionSpec(torch.float16, block_size=block_size or 16), [])]
        specs = [g.spec for g in groups]
        self.block_size = specs[0].block_size
        if block_size is not None and block_size != self.block_size or any(
                s.block_size != self.block_size for s in specs):
            raise ValueError(f"KV-cache groups of block sizes {sorted({s.block_size for s in specs})} under one "
                             f"coordinator of block size {block_size or self.block_size}")
        classes = [manager_class(s) for s in specs]
        self.pool = BlockPool(num_blocks, reserve_null=any(c.needs_null_block for c in classes))
        self.managers = [c(i, s, self.pool) for i, (c, s) in enumerate(zip(classes, specs))]
        no_hits = sorted({type(m.spec).__name__ for m in self.managers if not m.supports_prefix_caching})
        if enable_prefix_caching and no_hits:
            logger.info("Prefix caching is off for this model: its %s layers keep a per-request state that a "
                        "cached prefix cannot restore (no state snapshots)", ", ".join(no_hits))
            enable_prefix_caching = False
        self.enable_prefix_caching = enable_prefix_caching
        self._align_chunks = enable_prefix_caching and any(m.align_chunks for m in self.managers)
        # managers that act at given positions of a step (plan_step) and hand the runner state copies: prefix
        # caching's state snapshots, so none without it
        self._planners = [m for m in self.managers if type(m).plan_step is not KVManager.plan_step
                          and enable_prefix_caching]
        self._hit_order = sorted(self.managers, key=lambda m: m.hit_order)  # stable: group order within a rank
        # The decode fast path (allocate_slots): groups that free during a request, one representative per
        # release key; groups with uniform tables, whose new-block count is computed once; the others.
        self._releasing = [m for m in self.managers if m.release_key is not None]
        self._release_reps = list({m.release_key: m for m in reversed(self._releasing)}.items())
        self._uniform = [m for m in self.managers if m.uniform_table]
        self._others = [m for m in self.managers if not m.uniform_table]
        self._held_ids = self._uniform[0].req_block_ids if self._uniform else {}
        self._hit_group = self.managers.index(self._uniform[0]) if self._uniform else None  # counts hit blocks
        self._cached_counts = self._uniform[0].num_cached if self._uniform else None
        if self.enable_prefix_caching and not self._uniform:  # a hit's length is counted in a uniform group
            logger.info("Prefix caching is off for this model: it has no layer with a block per block_size tokens")
            self.enable_prefix_caching = self._align_chunks = False
            self._planners = []
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of them, served from the cache
        self.tier_queries = 0  # prompt tokens looked up past the device's hit, with a KV tier behind it
        self.tier_hits = 0  # of them, served from the tier (vLLM's external prefix cache)
        # requests resumed after a preemption (vLLM's PrefixCacheStats.preempted_*): their tokens when admitted
        # again, and of them the ones served from the prefix cache or a tier; the rest is computed again
        self.preempted_queries = self.preempted_hits = 0
        # requests whose block ids grew since the scheduler last sent them to the runner (it discards them then)
        self.grown: set[str] = set()
        self.connector = None  # a KV tier behind the prefix cache (set_connector)
        # (request, [(key, block id)]) -> None: a KV tier's engine add-on deciding what a preemption offloads
        self.on_preempt = None

    def set_connector(self, connector) -> None:
        """Put a KV tier (kestrel/core/kv_connector.py KVConnector) behind the prefix cache, behind every
        manager's lookups and every pool's evictions."""
        self.connector = connector
        self.pool.on_evict = connector.on_evict  # a block id is its index in the ROWS unit
        self.pool.on_free = connector.on_free
        for m in self.managers:
            m.set_tier(connector)

    def build_connector_meta(self):
        """The KV tier's transfers for the step being scheduled (StepInput.kv_connector_meta), or None."""
        return self.connector.build_connector_meta() if self.connector is not None else None

    def drop_failed_transfers(self, failures) -> None:
        """A KV tier's transfers failed (kestrel/core/kv_connector.py KVTransferFailures): a failed save is
        forgotten by its tier; a failed load's device entry leaves the prefix cache and every tier forgets its
        key, so nobody hits it again (its readers are computed again by the caller)."""
        for unit, slot in failures.saves:
            self.connector.on_save_failed(unit, slot)
        owners = {}
        for m in self.managers:
            owners.setdefault(m.tier_unit, m)
        for unit, index in failures.loads:
            key = owners[unit].forget(index)
            if key is not None:
                self.connector.discard(key)

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
        """Most pool blocks one request of `num_tokens` tokens holds at once, over all groups."""
        chunk = max_chunk or num_tokens
        return sum(m.blocks_needed(num_tokens, chunk) for m in self.managers)

    def max_prompt_tokens(self, max_chunk: int, max_model_len: int) -> int:
        """The admission limit: the longest prompt (below max_model_len) whose request, with the first token
        generated after it, fits the pool on its own, computed `max_chunk` tokens at a time. The scheduler admits
        by this number and the engine announces it to the frontend."""
        fits = lambda n: self.blocks_needed(n + 1, max_chunk) <= self.num_blocks  # noqa: E731
        lo, hi = 0, max(0, max_model_len - 1)  # blocks_needed grows with the length: the largest n that fits
        if not fits(0):
            return 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def aligned_chunk(self, start: int, num_new: int) -> int:
        """How many of `num_new` tokens after `start` to compute in one chunk: all, or, where a cache kind keeps
        its hits only at chunk ends (state snapshots), up to the last block boundary the chunk crosses. The rule:
        a chunk crossing a block boundary ends on one, so every prefill's full blocks, its last one included,
        end a chunk (the tail after the last boundary runs as the next step: one more step per prompt, the
        price of a snapshot there); a chunk within one block (a decode, a small budget) is kept whole."""
        if not self._align_chunks:
            return num_new
        boundary = (start + num_new) // self.block_size * self.block_size
        return boundary - start if boundary > start else num_new

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
        hits = [m.hit_blocks(hashes, n) for m in self.managers]
        self.prefix_queries += req.num_tokens
        self.prefix_hits += n * self.block_size
        if self.connector is not None:
            device = self._device_blocks(hits, n)
            self.tier_queries += req.num_tokens - device * self.block_size
            self.tier_hits += (n - device) * self.block_size
        return hits, n * self.block_size

    @staticmethod
    def _device_blocks(hits: list[list[KVBlock]], n: int) -> int:
        """Of a hit of n blocks, the leading blocks the device serves (before the first a tier serves); each
        group's entries end at block n (a state snapshot's one entry stands for block n - 1)."""
        first = n
        for h in hits:
            i = next((i for i, b in enumerate(h) if isinstance(b, TierHit)), None)
            if i is not None:
                first = min(first, n - len(h) + i)
        return first

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[list[KVBlock]] | None = None,
                       lookahead: int = 0) -> bool:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (plus cache hits), and
        `lookahead` slots after them (an EAGLE-3 draft chain writes there), after freeing what no query reads any
        more. Returns False, changing nothing, when the pool is short.

        Every uniform-table group holds the same number of entries per request, so without hits (every step but
        a request's first) they all need the same number of new blocks: computed once, not per group, and most
        decode steps free nothing and allocate nothing. Hits, or a group of another kind, take
        _allocate_per_group (the plain form)."""
        if computed is not None and req.num_preemptions and req.num_computed_tokens == 0:
            ok = self._allocate_per_group(req, num_new_tokens, computed, lookahead)
            if ok:  # a preempted request admitted again
                self.preempted_queries += req.num_tokens - (req.output_token_ids[-1:] == [PLACEHOLDER])
                self.preempted_hits += len(computed[self._hit_group]) * self.block_size if self._uniform else 0
            return ok
        if self._others or self._planners or (computed and any(computed)):
            return self._allocate_per_group(req, num_new_tokens, computed, lookahead)
        rid, bs = req.request_id, self.block_size
        num_computed = req.num_computed_tokens
        due = None  # release keys with something to free this step
        for key, rep in self._release_reps:
            if rep.frees_due(rid, num_computed):
                due = due or set()
                due.add(key)
        if due:
            for m in self._releasing:  # group order, as the per-group form releases them
                if m.release_key in due:
                    m.remove_skipped(rid, num_computed)
        held = self._held_ids.get(rid)
        need = (num_computed + num_new_tokens + lookahead + bs - 1) // bs - (len(held) if held else 0)
        if need <= 0:
            return True  # fits in the blocks it holds (most decode steps)
        if need * len(self._uniform) > self.pool.num_free:
            return False
        for m in self._uniform:
            m.add(rid, (), self.pool.allocate(need))
        self.grown.add(rid)
        return True

    def _allocate_per_group(self, req: Request, num_new_tokens: int, computed: list[list[KVBlock]] | None = None,
                            lookahead: int = 0) -> bool:
        """allocate_slots, asking each group on its own."""
        rid = req.request_id
        hits = computed if computed and any(computed) else [[] for _ in self.managers]
        num_hit_tokens = len(hits[self._hit_group]) * self.block_size if self._uniform else 0
        for m in self.managers:
            m.remove_skipped(rid, req.num_computed_tokens + num_hit_tokens)
        total = req.num_computed_tokens + num_hit_tokens + num_new_tokens
        need = [m.num_new_blocks(rid, total + lookahead, h) for m, h in zip(self.managers, hits)]
        if not any(need) and not any(hits) and all(rid in m.req_block_ids for m in self._others):
            self._plan(req, total - num_new_tokens, total)
            return True  # fits in what it holds (most decode steps)
        own = [m.shared_pool_hits(h) for m, h in zip(self.managers, hits)]  # all of a group's hits, or none
        shared = [[b for b in o if not isinstance(b, TierHit)] for o in own]
        tier = [(g, i) for g, o in enumerate(own) for i, b in enumerate(o) if isinstance(b, TierHit)]
        reclaimed = len({b.block_id for h in shared for b in h if b.ref_cnt == 0 and b is not self.pool.null_block})
        if (sum(need) + len(tier) + reclaimed > self.pool.num_free
                or not all(m.can_add(rid) for m in self._others)):
            return False
        for h in shared:  # every group's hits leave the free list before any new block is taken from it
            self.pool.touch(h)
        if tier:
            hits = self._load_tier_hits(hits, tier)
        for m, h, n in zip(self.managers, hits, need):
            m.add(rid, h, self.pool.allocate(n))
        self.grown.add(rid)
        self._plan(req, total - num_new_tokens, total)
        return True

    def _load_tier_hits(self, hits: list[list[KVBlock]], tier: list[tuple[int, int]]) -> list[list[KVBlock]]:
        """Device blocks for the KV tier's hits (entries `tier`, (group, index)): allocated (their evictions
        may save other blocks to the tier, never the ones loaded here: the tier pins them first), registered in
        the prefix cache under the hits' keys, and loaded by the runner before the step's forward."""
        keys = [hits[g][i].key for g, i in tier]
        self.connector.update_state_after_alloc(keys)
        blocks = self.pool.allocate(len(tier))
        hits = [list(h) for h in hits]
        for (g, i), key, b in zip(tier, keys, blocks):
            self.pool.cache(b, key)
            hits[g][i] = b
        self.connector.update_state_after_alloc(keys, [b.block_id for b in blocks])
        return hits

    def _plan(self, req: Request, start: int, end: int) -> None:
        for m in self._planners:
            m.plan_step(req, start, end)

    def take_state_copies(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """The state-slot copies (group id, src slot, dst slot) the steps scheduled since the last call ask of
        the runner: restores (before the forward) and saves (after it)."""
        restores, saves = [], []
        for m in self._planners:
            r, s = m.take_copies()
            restores += [(m.group_id, a, b) for a, b in r]
            saves += [(m.group_id, a, b) for a, b in s]
        return restores, saves

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's fully computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        if self._cached_counts is not None and num_full <= self._cached_counts.get(req.request_id, 0):
            return  # no block filled since the last call (most decode steps); every group has cached as many
        hashes = self._block_hashes(req)
        for m in self.managers:
            m.cache_blocks(req.request_id, hashes, min(num_full, len(hashes)))

    def preempt(self, req: Request) -> None:
        """Release a preempted request's blocks. Where a KV tier's add-on decides what preemptions offload
        (`on_preempt`), the request's computed full blocks, decode-generated ones included (and those a step in
        flight computes: a copy is queued after that step's forward), are registered in the prefix cache first and
        handed to it as (key, block id) per paged entry, before they go back to the free list."""
        if self.on_preempt is not None and self.enable_prefix_caching:
            self.cache_full_blocks(req)
            rid = req.request_id
            entries = [(b.block_hash, b.block_id) for m in self.managers if m.tier_unit == ROWS
                       for b in m.req_blocks.get(rid, ()) if b.block_hash is not None and b is not self.pool.null_block]
            self.on_preempt(req, entries)
        self.free(req)

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
        if self.connector is not None:
            self.connector.reset()
        for m in self.managers:
            m.reset_prefix_cache()
        return True
