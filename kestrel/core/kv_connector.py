"""The KV connector interface: KV-cache tiers behind the prefix cache (host memory, and a disk tier under it; a
remote store would be one more implementation), in vLLM's shape (vllm/distributed/kv_transfer/kv_connector/v1/base.py), split as vLLM splits it:

- the scheduler side (`KVConnector`, driven by the KV coordinator, kestrel/engine/kv/coordinator.py): the
  lookup of how many more prompt blocks past the device's prefix hit the tier holds
  (`get_num_new_matched_tokens`), the binding of the device blocks allocated for them (`update_state_after_alloc`),
  the pool's evictions of full, hashed blocks (`on_evict`, the save trigger), and each step's transfers
  (`build_connector_meta`, sent to the runner in StepInput.kv_connector_meta);
- the worker side (`KVConnectorWorker`, owned by the model runner over its KV-cache tensors): saves and loads of
  whole block rows before the step's forward (`start_load_kv`, which reports what failed; on CUDA on a side
  stream, kestrel/worker/kv_copy_stream.py); `wait_for_save` where copies run asynchronously.

A tier under another (the disk under the host tier) is told of the entries the tier above it saved
(`on_evict(key, slot)`, the slot being the upper tier's) and loads straight into the device.

A failed transfer never yields wrong tokens: a failed save is dropped from its tier (`on_save_failed`); a failed
load's device entry leaves the prefix cache, the tiers forget its key (`discard`), and the requests that read it
this step drop the step's tokens and are computed again (the KV offload add-on, kestrel/engine/addons/
kv_offload.py).

It lives here, below the engine and the worker, so that both read the same metadata type."""
from __future__ import annotations

from dataclasses import dataclass, field


# A tier stores units of device memory, each transfer naming its unit: ROWS, a block id's row in every paged
# cache slot tensor (what every paged kind's block is: full attention, sliding window, MLA latents with their
# indexer keys), or a state group's id, one snapshot slot of that group's layers' state tensors (recurrent-state
# snapshots). A cache kind's manager declares its unit (KVManager.tier_unit).
ROWS = -1


@dataclass
class KVConnectorMeta:
    """One step's transfers, (unit, device index, tier slot) each. The runner makes the saves first (device ->
    tier: blocks the device pool evicted this step, still intact since no forward ran since), then the loads (tier
    -> device: blocks of this step's prefix hits), all before the forward reads them. The scheduler side never
    hands a save into a slot that a load of the same step reads (it pins the slots it loads from)."""
    saves: list[tuple[int, int, int]] = field(default_factory=list)
    loads: list[tuple[int, int, int]] = field(default_factory=list)
    # a file tier under the host tier: host slots written to files (unit, host slot, file name; in the
    # background, after this step's saves), files read into the device (unit, device index, file name; after this
    # step's loads, checked) and files removed (names; in order with the writes)
    writes: list[tuple[int, int, str]] = field(default_factory=list)
    reads: list[tuple[int, int, str]] = field(default_factory=list)
    removes: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.writes or self.reads or self.removes)

    @property
    def has_loads(self) -> bool:
        return bool(self.loads or self.reads)

    def extend(self, other: "KVConnectorMeta") -> None:
        for name in ("saves", "loads", "writes", "reads", "removes"):
            getattr(self, name).extend(getattr(other, name))


@dataclass
class KVTransferFailures:
    """What a step's transfers failed to do (the worker's report, in RunnerOutput.kv_failures): loads (unit,
    device index) whose contents are wrong, saves (unit, tier slot) whose copy is wrong, and the requests that
    read a failed load in this step."""
    loads: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


class KVConnector:
    """The scheduler side. Keys are the prefix cache's: (KV-cache group id, block hash)."""

    def get_num_new_matched_tokens(self, keys: list[tuple[int, bytes]], block_size: int) -> int:
        """Tokens of the leading blocks of `keys` (one group's blocks after the device's hit, in order) that the
        tier holds."""
        n = 0
        while n < len(keys) and self.contains(keys[n]):
            n += 1
        return n * block_size

    def contains(self, key: tuple[int, bytes]) -> bool:
        """Whether the tier holds the block `key` (the coordinator asks block by block, every group)."""
        raise NotImplementedError

    def update_state_after_alloc(self, keys: list[tuple[int, bytes]], targets: list[int] | None = None) -> None:
        """A request's allocation takes the tier's blocks `keys`: first called without targets, before the
        device memory is allocated (the tier pins what it will load: the allocation's evictions must not
        overwrite it), then with the device indices (block ids, or snapshot slots) they load into."""
        raise NotImplementedError

    def on_evict(self, key: tuple[int, bytes], index: int) -> None:
        """The device reallocates `index` (a block id, or a state snapshot slot), which held the prefix entry
        `key` (group id, block hash)."""

    def on_free(self, key: tuple[int, bytes], index: int) -> None:
        """Block `index`, holding the prefix entry `key`, lost its last user: it stays cached on the device until
        reallocated (on_evict). A tier that saves ahead of eviction copies it now, off the critical path: nothing
        writes the block before it is reallocated, and the eviction then has nothing left to copy."""

    def build_connector_meta(self) -> KVConnectorMeta | None:
        """The transfers since the last call (None: nothing to do), for the next step."""
        return None

    def discard(self, key: tuple[int, bytes]) -> None:
        """Forget the entry `key` (a load of it failed)."""

    def on_save_failed(self, unit: int, slot: int) -> None:
        """The save into this tier's `slot` of `unit` failed: forget what it was to hold."""

    def reset(self) -> None:
        """Forget everything held (/reset_prefix_cache)."""

    def stats(self) -> dict:
        return {}


class KVConnectorWorker:
    """The worker side: the tier's memory and the copies, over the runner's KV-cache tensors (one uint8 tensor
    [num_blocks, row_bytes] per cache slot: kestrel/worker/kv_allocation.py)."""

    def start_load_kv(self, meta: KVConnectorMeta | None, step=None) -> KVTransferFailures | None:
        """Make the step's saves, then its loads, before its forward (`step`: its StepInput, whose writes must
        not overtake a save still reading a block); returns what failed (None: nothing). Called every step,
        `meta` None where the step has no transfers (copies of earlier steps may still be in flight)."""
        raise NotImplementedError

    def wait_for_save(self) -> None:
        """Where saves run asynchronously: wait until they are done."""
