"""The host-memory KV tier (--kv-offloading-size GiB, --kv-offloading-backend native), the first KV connector
(kestrel/core/kv_connector.py), scheduler side: which prefix blocks the host holds, in `HostBlockPool`'s slots
(least recently used evicted first, never more slots than the byte bound buys), keyed by the prefix cache's
(group id, block hash). The memory and the copies are the worker's (kestrel/worker/kv_host_tier.py).

- Save: the device pool reallocates a full, hashed block not saved yet (BlockPool.allocate -> on_evict), or, with
  --kv-offloading-save free, such a block loses its last user (BlockPool.release -> on_free: a finished turn's
  prefix): the host takes a slot (evicting its least recently used entry) and the step's metadata asks the
  runner to copy the block's rows there before the next forward. At eviction, the forward that takes the block
  waits for its copy (the multi-turn benchmark, qwen3-0.6b on an H100: returning turns 3x slower than
  recomputing); at free time the runner's side stream copies beside later forwards and only a forward that
  rewrites the block (its reallocation, late under LRU) waits, for more copies in all (blocks the device never
  evicts too). A block the host holds already is only touched.
- Load: a prefix lookup that misses on the device but hits here (the coordinator asks past the device's hit)
  allocates device blocks, registers them in the device's prefix cache and has the runner copy the slots into
  them before the step's forward; the slots loaded or saved in a step are pinned until its metadata is taken,
  so no later save of that step overwrites them (a disk write copies a slot after the step's saves).
- Preemption (the KV offload add-on decides, kestrel/engine/addons/kv_offload.py): a preempted request's block
  rows are either saved at once and held (`hold`: never evicted until `release`, at most half the slots held), or
  kept from the host (`skip`: their eviction saves nothing, so the request is recomputed as without a tier).
- Entries are grouped by unit (kestrel/core/kv_connector.py: a block's rows, or a state group's snapshot), one
  LRU pool each; a tier under this one (the disk, disk_tier.py) is told of every save and asked for misses."""
from __future__ import annotations

from collections import Counter, OrderedDict

from kestrel.core.kv_connector import ROWS, KVConnector, KVConnectorMeta


class HostBlockPool:
    """`num_slots` slots of `block_bytes` each (num_slots = the byte bound // block_bytes), keyed, LRU."""

    def __init__(self, num_bytes: int, block_bytes: int):
        if block_bytes <= 0:
            raise ValueError("a host KV block needs a positive size")
        self.block_bytes = block_bytes
        self.num_slots = num_bytes // block_bytes
        self.entries: OrderedDict[tuple[int, bytes], int] = OrderedDict()  # key -> slot; head: evicted first
        self.free_slots = list(range(self.num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.pinned: set[int] = set()
        self.held: Counter = Counter()  # key -> holders (preempted requests): never evicted while held

    @property
    def num_bytes(self) -> int:
        """Bytes the slots take (never more than the bound)."""
        return self.num_slots * self.block_bytes

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key) -> bool:
        return key in self.entries

    def get(self, key) -> int | None:
        """The key's slot, now the most recently used; None where absent."""
        slot = self.entries.get(key)
        if slot is not None:
            self.entries.move_to_end(key)
        return slot

    def put(self, key) -> int | None:
        """A slot for `key` (new: a free one, else the least recently used unpinned entry's), or None where every
        slot is pinned (or there are none). A key already held keeps its slot, touched."""
        if key in self.entries:
            return self.get(key)
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((k for k, s in self.entries.items() if s not in self.pinned and k not in self.held), None)
            if victim is None:
                return None
            slot = self.entries.pop(victim)
        self.entries[key] = slot
        return slot

    def remove(self, key) -> None:
        slot = self.entries.pop(key, None)
        if slot is not None:
            self.free_slots.append(slot)

    def key_of(self, slot: int):
        return next((k for k, s in self.entries.items() if s == slot), None)

    def clear(self) -> None:
        self.entries.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self.pinned.clear()
        self.held.clear()


class HostTierConnector(KVConnector):
    """`units`: unit (kestrel/core/kv_connector.py ROWS, or a state group's id) -> (bytes of this rank's host
    memory for it, bytes of one entry); `unit_of`: each KV-cache group's unit (its manager's `tier_unit`). One
    LRU pool per unit: a paged block and a state snapshot differ in size. `lower`: a tier under this one (the
    disk tier, disk_tier.py), told of every entry saved here and asked for what the host misses."""

    def __init__(self, units: dict[int, tuple[int, int]], unit_of: list[int], lower: KVConnector | None = None,
                 save_on_free: bool = False):
        self.pools = {u: HostBlockPool(num_bytes, entry_bytes) for u, (num_bytes, entry_bytes) in units.items()}
        self.unit_of = unit_of
        self.lower = lower
        self.save_on_free = save_on_free  # --kv-offloading-save free
        self.meta = KVConnectorMeta()
        self._loading: list[tuple[int, int]] = []  # (unit, slot) claimed by the allocation under way
        self._from_lower: list[bool] = []  # per key of the allocation under way: the lower tier loads it
        self.steps_loading = 0  # steps handed out with loads and not yet collected (the add-on counts them down)
        self.holds: dict[str, list] = {}  # preempted request -> keys it holds in the ROWS pool (hold)
        self.skips: dict[str, list] = {}  # preempted request -> keys whose eviction saves nothing (skip)
        self.skipped: Counter = Counter()
        self.saved_blocks = self.loaded_blocks = 0  # counters (statistics)
        self.saved_bytes = self.loaded_bytes = 0

    @classmethod
    def single(cls, num_bytes: int, block_bytes: int) -> "HostTierConnector":
        """One unit of block rows for every group (tests)."""
        return cls({ROWS: (num_bytes, block_bytes)}, _AllRows())

    def _pool(self, key) -> tuple[int, HostBlockPool]:
        unit = self.unit_of[key[0]]
        return unit, self.pools[unit]

    @property
    def num_slots(self) -> int:
        return sum(p.num_slots for p in self.pools.values())

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.pools.values())

    def __len__(self) -> int:
        return sum(len(p) for p in self.pools.values())

    def contains(self, key) -> bool:
        return key in self._pool(key)[1] or self.lower is not None and self.lower.contains(key)

    def update_state_after_alloc(self, keys, targets=None) -> None:
        if targets is None:
            self._loading = []
            self._from_lower = [key not in self._pool(key)[1] for key in keys]
            for k, lower in zip(keys, self._from_lower):
                if not lower:
                    unit, pool = self._pool(k)
                    slot = pool.get(k)
                    pool.pinned.add(slot)
                    self._loading.append((unit, slot))
            if any(self._from_lower):
                self.lower.update_state_after_alloc([k for k, lower in zip(keys, self._from_lower) if lower])
            return
        assert len(targets) == len(self._from_lower)
        mine = [t for t, lower in zip(targets, self._from_lower) if not lower]
        for (unit, slot), index in zip(self._loading, mine):
            self.meta.loads.append((unit, index, slot))
            self.loaded_bytes += self.pools[unit].block_bytes
        self.loaded_blocks += len(mine)
        if len(mine) < len(targets):
            picks = [(k, t) for k, t, lower in zip(keys, targets, self._from_lower) if lower]
            self.lower.update_state_after_alloc([k for k, _ in picks], [t for _, t in picks])
        self._loading, self._from_lower = [], []

    def on_evict(self, key, index: int) -> None:
        if key in self.skipped:
            return  # a preempted request's block, recomputed rather than offloaded
        unit, pool = self._pool(key)
        if key in pool:
            pool.get(key)  # the host copy is the same prefix: keep it, as the most recently used
            return
        slot = pool.put(key)
        if slot is not None:
            pool.pinned.add(slot)  # no later save of this step takes it (a write to disk copies it after them)
            self.meta.saves.append((unit, index, slot))
            self.saved_blocks += 1
            self.saved_bytes += pool.block_bytes
            if self.lower is not None:
                self.lower.on_evict(key, slot)

    def on_free(self, key, index: int) -> None:
        if self.save_on_free:
            self.on_evict(key, index)  # saved now, ahead of its eviction (which then finds it here)

    def hold(self, owner: str, entries: list[tuple[tuple[int, bytes], int]]) -> bool:
        """Save the block rows `entries` ((key, block id), a preempted request's) now, unless held already, and
        hold them against eviction until `release(owner)`. False, doing nothing, where that would hold more than
        half the slots (the rest stays for the prefix cache's evictions)."""
        pool = self.pools.get(ROWS)
        if pool is None or not entries or len(pool.held) + len(entries) > pool.num_slots // 2:
            return False
        keys = []
        for key, index in entries:
            self.on_evict(key, index)  # a new entry saved (its copy made before the next forward), an old one touched
            if key in pool:
                pool.held[key] += 1
                keys.append(key)
        self.holds[owner] = keys
        return True

    def skip(self, owner: str, keys: list[tuple[int, bytes]]) -> None:
        """Save none of `keys` (a preempted request's) when the device evicts them, until `release(owner)`."""
        self.skips[owner] = keys
        self.skipped.update(keys)

    def release(self, owner: str) -> None:
        """The preempted request `owner` runs again (or ended): its holds and skips end."""
        pool = self.pools.get(ROWS)
        for key in self.holds.pop(owner, ()):
            pool.held[key] -= 1
            if pool.held[key] <= 0:
                del pool.held[key]
        for key in self.skips.pop(owner, ()):
            self.skipped[key] -= 1
            if self.skipped[key] <= 0:
                del self.skipped[key]

    def build_connector_meta(self) -> KVConnectorMeta | None:
        meta, self.meta = self.meta, KVConnectorMeta()
        for pool in self.pools.values():
            pool.pinned.clear()
        lower = self.lower.build_connector_meta() if self.lower is not None else None
        if lower is not None:
            meta.extend(lower)
        if meta.has_loads:
            self.steps_loading += 1
        return meta or None

    def discard(self, key) -> None:
        self._pool(key)[1].remove(key)
        if self.lower is not None:
            self.lower.discard(key)

    def on_save_failed(self, unit: int, slot: int) -> None:
        key = self.pools[unit].key_of(slot)
        if key is not None:
            self.discard(key)

    def reset(self) -> None:
        """Transfers already handed out stay valid (their slots are simply forgotten)."""
        for pool in self.pools.values():
            pool.clear()
        self.holds.clear()
        if self.lower is not None:
            self.lower.reset()

    def stats(self) -> dict:
        stats = {"host_kv_blocks": len(self), "host_kv_slots": self.num_slots,
                 "host_kv_saved_blocks": self.saved_blocks, "host_kv_loaded_blocks": self.loaded_blocks,
                 "host_kv_saved_bytes": self.saved_bytes, "host_kv_loaded_bytes": self.loaded_bytes}
        if self.lower is not None:
            stats.update(self.lower.stats())
        return stats


class _AllRows:
    """unit_of for a connector whose every group is paged."""

    def __getitem__(self, group: int) -> int:
        return ROWS
