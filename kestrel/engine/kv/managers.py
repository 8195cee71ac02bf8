"""One manager per KV-cache group: which pool blocks each request holds in that group. The coordinator
(coordinator.py) drives every manager through the `KVManager` interface and the spec -> manager table
`MANAGERS`; it knows no cache kind by name.

How to add a cache kind: a spec (kestrel/core/kv_spec.py, or beside its layer), a manager here (subclass
KVManager, or the manager whose block rules it shares), and one line in MANAGERS. A kind whose page is several
per-token parts under one block table (an MLA latent and its indexer keys) is only a spec: its manager is
FullAttentionManager. A kind that holds a fixed-size state per request instead of blocks (a recurrent state):
`uniform_table = False`, `blocks_needed` and `num_new_blocks` 0 (it takes nothing from the block pool),
`can_add` says whether its own slot pool has room, `add` takes a slot and records it as the request's one table
entry (`req_block_ids[rid] = [slot]`), `free` gives it back, and `max_hit` returns 0 unless it keeps state
snapshots at block boundaries (tests/engine/test_kv_coordinator.py has a tiny one without; StateSlotManager
below keeps them: `plan_step` saves, `take_copies` hands the runner its slot copies). Its spec declares
`state_parts` and `num_state_slots` (the slot pool's size, null slot included) and views its state in
`layer_view`; the runner allocates the slots beside the pool (kestrel/worker/kv_allocation.py). Behind a KV
tier (--kv-offloading-size), a paged kind needs nothing more (its blocks are the tier's ROWS unit); a kind whose
hits come from a pool of its own declares its own `tier_unit` (the worker side must know its tensors:
kestrel/worker/kv_host_tier.py unit_tensors), tells the tier of its pool's evictions (`set_tier`), loads its
TierHit entries in `add` and takes a failed load out of its pool in `forget` (StateSlotManager does all four)."""
from __future__ import annotations

from kestrel.core.kv_spec import FullAttentionSpec, KDAStateSpec, KVCacheSpec, MLASpec, SlidingWindowSpec, cdiv
from kestrel.core.kv_connector import ROWS
from kestrel.engine.kv.pool import BlockPool, KVBlock, TierHit


class KVManager:
    """The interface. Class attributes the coordinator reads once, at start-up:

    * needs_null_block: the pool reserves block 0 for table entries that no query reads (freed ones).
    * hit_order: managers are asked for the longest prefix hit in ascending order; a kind whose hit can only
      shorten the others' (a sliding window needs the blocks under its window) asks after those that bound it.
    * release_key: None for a kind that frees nothing while a request runs. Otherwise managers with equal keys
      free the same table positions at the same step: the coordinator asks one of them (`frees_due`) per request
      and step, and only when it says yes asks every one of them to `remove_skipped`.
    * uniform_table: the request's table holds one entry per `block_size` tokens from position 0 (entries freed
      early stay, as the null block), so every such group needs the same number of new blocks in a step: the
      coordinator computes it once for all of them (the decode fast path). False: asked on its own.
    * supports_prefix_caching: False for a kind that can never serve a hit (a per-request state kept without
      snapshots at block boundaries): the coordinator then turns prefix caching off for the model, saying so once.
      (Read from the instance: a kind may decide it from its spec.)
    * align_chunks: its hits exist only where a chunk ended on a block boundary (state snapshots): the scheduler
      cuts a chunk that crosses a block boundary at the last one it crosses (KVCacheManager.aligned_chunk).
    * tier_unit: what a KV tier behind the prefix cache (kestrel/core/kv_connector.py) stores of one prefix entry:
      ROWS (a block id's row in every paged cache slot: any paged kind), or a unit of the kind's own (a state
      group's snapshot slots). Lookups go through `find`, which asks the tier where the device misses."""
    needs_null_block = False
    tier_unit = ROWS
    tier = None
    supports_prefix_caching = True
    align_chunks = False
    hit_order = 0
    release_key = None
    uniform_table = True

    def __init__(self, group_id: int, spec: KVCacheSpec, pool: BlockPool):
        self.group_id, self.spec, self.pool, self.block_size = group_id, spec, pool, spec.block_size
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the same, as ids (kept in step: read every step)
        self.num_cached: dict[str, int] = {}  # leading blocks already registered in the prefix cache

    def set_tier(self, tier) -> None:
        """A KV tier (KVConnector) behind the prefix cache: `find` asks it where the device misses."""
        self.tier = tier

    def find(self, h: bytes, pool: BlockPool | None = None) -> KVBlock | None:
        """The prefix entry of block hash `h` in `pool` (the shared one by default), else a TierHit where the KV
        tier holds it, else None."""
        key = (self.group_id, h)
        found = (self.pool if pool is None else pool).lookup(key)
        if found is None and self.tier is not None and self.tier.contains(key):
            return TierHit(key)
        return found

    def forget(self, index: int) -> tuple[int, bytes] | None:
        """Take the entry at `index` of this kind's tier unit (a block id) out of the prefix cache: a KV tier's
        load into it failed. Returns its key."""
        return self.pool.forget(index)

    # ---- admission
    def blocks_needed(self, num_tokens: int, max_chunk: int) -> int:
        """Most pool blocks one request of `num_tokens` tokens holds at once, computed `max_chunk` at a time."""
        raise NotImplementedError

    # ---- prefix cache
    def max_hit(self, hashes: list[bytes], limit: int) -> int:
        """Longest prefix (in blocks, <= limit) this group can serve from the cache."""
        raise NotImplementedError

    def hit_blocks(self, hashes: list[bytes], n: int) -> list[KVBlock]:
        """The table entries of a hit of `n` blocks."""
        raise NotImplementedError

    def cache_blocks(self, rid: str, hashes: list[bytes], num_full: int) -> None:
        """Register the request's first `num_full` blocks (now fully computed) in the prefix cache."""

    def shared_pool_hits(self, hits: list[KVBlock]) -> list[KVBlock]:
        """Of a hit's entries, those from the shared block pool (the coordinator takes their references); a
        kind whose hits come from a pool of its own takes them in add()."""
        return hits

    def reset_prefix_cache(self) -> None:
        """Forget what was registered (the pool's map is cleared by the coordinator)."""
        self.num_cached = {k: 0 for k in self.num_cached}

    # ---- allocation
    def frees_due(self, rid: str, num_computed: int) -> bool:
        """Whether remove_skipped would free anything now (cheap: asked for every request at every step)."""
        return False

    def remove_skipped(self, rid: str, num_computed: int) -> None:
        """Free the blocks no query after `num_computed` tokens reads."""

    def num_new_blocks(self, rid: str, total_tokens: int, hits: list[KVBlock]) -> int:
        """Pool blocks to add so the request holds `total_tokens` tokens (after `hits`)."""
        raise NotImplementedError

    def can_add(self, rid: str) -> bool:
        """Whether add() can succeed beyond the pool blocks it is given (a kind with its own slot pool)."""
        return True

    def add(self, rid: str, hits: list[KVBlock], new: list[KVBlock]) -> None:
        raise NotImplementedError

    def plan_step(self, req, start: int, end: int) -> None:
        """The step will compute the request's tokens start..end (its allocation succeeded): a kind that acts
        at given positions (a state snapshot at a block boundary) records it here. Asked only where overridden
        and prefix caching is on."""

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """State-slot copies the runner makes for this step, (src, dst) pairs: before the forward, after it."""
        return [], []

    def free(self, rid: str) -> None:
        """Release everything the request holds."""
        raise NotImplementedError


class FullAttentionManager(KVManager):
    """The blocks one group holds per request, for layers that read every earlier token."""

    def blocks_needed(self, num_tokens: int, max_chunk: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def max_hit(self, hashes: list[bytes], limit: int) -> int:
        n = 0
        while n < limit and self.find(hashes[n]) is not None:
            n += 1
        return n

    def hit_blocks(self, hashes: list[bytes], n: int) -> list[KVBlock]:
        return [self.find(h) for h in hashes[:n]]

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
    during the request, and their entries become the null block. A prefix hit needs only the blocks under the
    window before the hit point, so a full-attention group's hit bounds this one's (asked after it)."""
    needs_null_block = True
    hit_order = 1

    def __init__(self, group_id: int, spec: SlidingWindowSpec, pool: BlockPool):
        super().__init__(group_id, spec, pool)
        self.window = spec.sliding_window
        self.release_key = ("window", spec.sliding_window)  # every group of one window frees in the same step
        self.window_blocks = cdiv(spec.sliding_window - 1, self.block_size)  # blocks a query needs before its own
        self.first_live: dict[str, int] = {}

    def blocks_needed(self, num_tokens: int, max_chunk: int) -> int:
        return min(cdiv(num_tokens, self.block_size), cdiv(self.window - 1 + max_chunk, self.block_size) + 1)

    def max_hit(self, hashes: list[bytes], limit: int) -> int:
        """Largest n <= limit such that the `window_blocks` blocks before n are all cached (n = 0 always is)."""
        n = limit
        while n > 0:
            start = max(0, n - self.window_blocks)
            miss = next((i for i in range(n - 1, start - 1, -1) if self.find(hashes[i]) is None), None)
            if miss is None:
                return n
            n = miss  # no window ending after a miss can be complete
        return 0

    def hit_blocks(self, hashes: list[bytes], n: int) -> list[KVBlock]:
        start = max(0, n - self.window_blocks)
        return [self.pool.null_block] * start + [self.find(h) for h in hashes[start:n]]

    def first_needed(self, num_computed: int) -> int:
        """The first block a query after `num_computed` tokens still reads."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def frees_due(self, rid: str, num_computed: int) -> bool:
        # first_needed without its max(0, .): a negative value is never due
        return (num_computed - self.window + 1) // self.block_size > self.first_live.get(rid, 0)

    def remove_skipped(self, rid: str, num_computed: int) -> None:
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return
        start = self.first_live.get(rid, 0)
        end = min(self.first_needed(num_computed), len(blocks))
        if end <= start:
            return
        ids = self.req_block_ids[rid]
        freed = blocks[start:end]
        null = self.pool.null_block
        for i in range(start, end):
            blocks[i], ids[i] = null, null.block_id
        self.first_live[rid] = end
        self.pool.release(reversed(freed))

    def free(self, rid: str) -> None:
        self.first_live.pop(rid, None)
        super().free(rid)


class StateSlotManager(KVManager):
    """One state slot per request (a recurrent state: kestrel/core/kv_spec.py KDAStateSpec) from the group's own
    pool of spec.num_state_slots, slot 0 being the null slot no request gets. It takes no pool blocks; the slot is
    the request's one table entry. A slot's old contents are never read: the runner starts a request without
    computed tokens (new, or preempted and recomputed) from a zero state.

    Prefix caching, where the spec has snapshot slots (its last num_snapshot_slots): a prefill chunk that ends on
    a block boundary saves the request's state there into a snapshot slot (a copy the runner makes after the
    step's forward), and the snapshot is registered under the hash of the block it ends, once the attention
    groups register that block. A hit of n blocks is the largest n (within the other groups' hit) whose block
    n - 1 has a snapshot; the runner copies it into the request's slot before the forward, and the request
    computes from token n * block_size on. Snapshots live in a BlockPool of their own (ids 0..S-1 are slots
    first_snapshot + id), ref-counted: a save holds its snapshot from the step that schedules it until the
    snapshot is registered (or its request ends first); registered, it waits on the free list, evicted least
    recently used first (a hit takes and gives back a reference: the restore is queued before any later save
    can overwrite it, as restores precede the forward and saves follow it), and a save is skipped when every
    snapshot is held, or when its block has one already. Only chunk ends are saved, so the scheduler cuts
    prefill chunks at block boundaries (align_chunks: the coordinator's aligned_chunk)."""
    uniform_table = False
    hit_order = 2  # a snapshot hit only shortens the attention groups' hit (and a window's)

    def __init__(self, group_id: int, spec: KVCacheSpec, pool: BlockPool):
        super().__init__(group_id, spec, pool)
        num_snapshots = spec.num_snapshot_slots
        num_working = spec.num_state_slots - num_snapshots
        if num_working < 2:
            raise ValueError(f"{type(spec).__name__} has {num_working} state slots: size the pool with "
                             "group_layers(..., max_num_seqs=...)")
        self.free_slots = list(range(num_working - 1, 0, -1))  # popped from the end: 1 first
        self.first_snapshot = num_working
        self.snapshots = BlockPool(num_snapshots) if num_snapshots else None
        self.supports_prefix_caching = self.align_chunks = self.snapshots is not None
        self.pending: dict[str, list[tuple[int, KVBlock]]] = {}  # rid -> (blocks it ends, snapshot) to register
        self.restores: list[tuple[int, int]] = []  # (snapshot slot, request slot): before the next forward
        self.saves: list[tuple[int, int]] = []  # (request slot, snapshot slot): after the next forward
        self.loading: list[KVBlock] = []  # snapshots a KV tier loads this step: held until its copies are taken
        self.tier_unit = group_id  # a KV tier keeps this group's snapshots (all its layers' states) as one unit

    def set_tier(self, tier) -> None:
        super().set_tier(tier)
        if self.snapshots is not None:  # a snapshot slot reallocated: the tier saves it (by its state slot)
            self.snapshots.on_evict = lambda key, snap: tier.on_evict(key, self.first_snapshot + snap)

    def forget(self, index: int) -> tuple[int, bytes] | None:
        return self.snapshots.forget(index - self.first_snapshot)

    def _hit(self, h: bytes) -> KVBlock | None:
        """The snapshot saved after block hash `h`: on the device, or in the KV tier where a snapshot slot is
        free to load it into."""
        found = self.find(h, self.snapshots)
        return None if isinstance(found, TierHit) and not self.snapshots.num_free else found

    def blocks_needed(self, num_tokens: int, max_chunk: int) -> int:
        return 0

    def max_hit(self, hashes: list[bytes], limit: int) -> int:
        n = limit if self.snapshots else 0
        while n > 0 and self._hit(hashes[n - 1]) is None:
            n -= 1
        return n

    def hit_blocks(self, hashes: list[bytes], n: int) -> list[KVBlock]:
        """The one snapshot a hit of n blocks restores (from the snapshot pool, not the shared one, or the KV
        tier's)."""
        return [self._hit(hashes[n - 1])] if n else []

    def shared_pool_hits(self, hits: list[KVBlock]) -> list[KVBlock]:
        return []

    def num_new_blocks(self, rid: str, total_tokens: int, hits: list[KVBlock]) -> int:
        return 0

    def can_add(self, rid: str) -> bool:
        return rid in self.req_block_ids or bool(self.free_slots)

    def add(self, rid: str, hits: list[KVBlock], new: list[KVBlock]) -> None:
        if rid not in self.req_block_ids:
            self.req_block_ids[rid] = [self.free_slots.pop()]
        for snap in hits:  # a request's first step: it starts from the snapshot's state
            if isinstance(snap, TierHit):
                snap = self._load(snap.key)
            else:
                self.snapshots.touch([snap])
                self.snapshots.release([snap])  # to the free list's tail: the most recently used
            self.restores.append((self.first_snapshot + snap.block_id, self.req_block_ids[rid][0]))

    def _load(self, key: tuple[int, bytes]) -> KVBlock:
        """A snapshot slot for the KV tier's snapshot `key`, registered, loaded before the step's restores (the
        runner makes the tier's loads first) and held until the step's copies are taken, so no other load or
        save of the step reuses it."""
        self.tier.update_state_after_alloc([key])
        snap = self.snapshots.allocate(1)[0]  # may evict another snapshot: the tier saves it first
        self.snapshots.cache(snap, key)
        self.tier.update_state_after_alloc([key], [self.first_snapshot + snap.block_id])
        self.loading.append(snap)
        return snap

    def plan_step(self, req, start: int, end: int) -> None:
        """A prefill chunk computing tokens start..end that ends on a block boundary saves the state there (the
        prompt's block hashes are known: the hit lookup computed them)."""
        n = end // self.block_size
        if (self.snapshots is None or end % self.block_size or start >= req.num_prompt_tokens
                or not self.snapshots.num_free):
            return
        hashes = req.block_hashes
        if n <= len(hashes) and self.snapshots.lookup((self.group_id, hashes[n - 1])) is not None:
            return  # another request saved this very prefix's state
        snap = self.snapshots.allocate(1)[0]
        self.pending.setdefault(req.request_id, []).append((n, snap))
        self.saves.append((self.req_block_ids[req.request_id][0], self.first_snapshot + snap.block_id))

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        restores, saves = self.restores, self.saves
        self.restores, self.saves = [], []
        if self.loading:  # registered and unreferenced now: the most recently used
            self.snapshots.release(self.loading)
            self.loading = []
        return restores, saves

    def cache_blocks(self, rid: str, hashes: list[bytes], num_full: int) -> None:
        """Register the request's saved snapshots whose block is now computed (and hashed), and let them go."""
        pending = self.pending.get(rid)
        if not pending:
            return
        done = [(n, snap) for n, snap in pending if n <= num_full]
        for n, snap in done:
            self.snapshots.cache(snap, (self.group_id, hashes[n - 1]))
        self.snapshots.release(snap for _, snap in done)
        rest = [p for p in pending if p[0] > num_full]
        if rest:
            self.pending[rid] = rest
        else:
            del self.pending[rid]

    def free(self, rid: str) -> None:
        slots = self.req_block_ids.pop(rid, None)
        if slots:
            self.free_slots.extend(slots)
        pending = self.pending.pop(rid, ())
        if pending:  # saved (or about to be) but never registered: free, without a hash
            self.snapshots.release(snap for _, snap in pending)

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        if self.snapshots is not None:
            self.snapshots.reset_prefix_cache()


# spec class -> its manager, looked up along the spec's MRO (a subclass without a line of its own takes its
# base's manager): adding a cache kind adds one line here
MANAGERS: dict[type[KVCacheSpec], type[KVManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    MLASpec: FullAttentionManager,
    KDAStateSpec: StateSlotManager,
}


def manager_class(spec: KVCacheSpec) -> type[KVManager]:
    for cls in type(spec).__mro__:
        if cls in MANAGERS:
            return MANAGERS[cls]
    raise NotImplementedError(f"no KV manager for {type(spec).__name__}: add one to "
                              "kestrel.engine.kv.managers.MANAGERS")
