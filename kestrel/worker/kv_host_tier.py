"""The host-memory KV tier's worker side (--kv-offloading-size): host copies of the device's units
(kestrel/core/kv_connector.py): ROWS, a block id's row in every paged cache slot tensor (kestrel/worker/
kv_allocation.py; the same for every paged kind and group), and per state group with snapshots, one snapshot
slot of each of its layers' state tensors. Per unit, one host tensor per device tensor, [host slots, row bytes]
uint8, pinned where the cache is on CUDA, and the copies between them. The scheduler side (which key sits in
which slot, the LRU, the byte bound) is kestrel/engine/kv/host_tier.py; both size the tier with `tier_units`."""
from __future__ import annotations

import logging

import numpy as np
import torch

from kestrel.core.kv_connector import ROWS, KVConnectorMeta, KVConnectorWorker, KVTransferFailures
from kestrel.core.kv_spec import KVCacheGroup
from kestrel.worker.kv_allocation import bytes_per_block, slot_row_bytes
from kestrel.worker.kv_disk_tier import DiskTierWorker, tier_directory

logger = logging.getLogger(__name__)

GiB = 2**30


def host_tier_bytes(size_gib: float, tp_size: int = 1) -> int:
    """This rank's share of --kv-offloading-size (vLLM's meaning: summed over the tensor-parallel ranks)."""
    return int(size_gib * GiB) // max(1, tp_size)


def unit_entry_bytes(groups: list[KVCacheGroup], num_blocks: int) -> dict[int, tuple[int, int]]:
    """unit -> (bytes of one entry, bytes the device keeps of the unit): ROWS where a kind is paged, and each
    state group that keeps snapshots (its layers' states in one snapshot slot)."""
    units = {}
    if any(g.spec.page_bytes for g in groups):
        units[ROWS] = (bytes_per_block(groups), num_blocks * bytes_per_block(groups))
    for g in groups:
        if g.spec.state_bytes and g.spec.num_snapshot_slots:
            entry = len(g.layer_names) * g.spec.state_bytes
            units[g.group_id] = (entry, g.spec.num_snapshot_slots * entry)
    return units


def tier_units(groups: list[KVCacheGroup], num_blocks: int, num_bytes: int) -> dict[int, tuple[int, int]]:
    """unit -> (host bytes, bytes of one entry): the byte bound shared among the units as the device shares its
    KV memory among them, so the tier mirrors the device's mix (both sides compute it from the same inputs)."""
    units = unit_entry_bytes(groups, num_blocks)
    total = sum(dev for _, dev in units.values())
    return {u: (num_bytes * dev // total, entry) for u, (entry, dev) in units.items()}


def unit_tensors(groups: list[KVCacheGroup], kv_caches: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    """unit -> the device tensors one entry spans (allocate_kv_cache's list: the slots, then each stateful
    layer's state slots in group order)."""
    num_slots = len(slot_row_bytes(groups))
    units = {ROWS: kv_caches[:num_slots]}
    states = iter(kv_caches[num_slots:])
    for g in groups:
        if g.spec.state_bytes:
            tensors = [next(states) for _ in g.layer_names]
            if g.spec.num_snapshot_slots:
                units[g.group_id] = tensors
    return units


class HostTierWorker(KVConnectorWorker):
    """`units`: unit -> its device tensors (unit_tensors); `slots`: unit -> host slots; `lower`: a file tier
    under this one (kestrel/worker/kv_disk_tier.py), which writes host slots and reads into the device."""

    def __init__(self, units: dict[int, list[torch.Tensor]], slots: dict[int, int], lower=None):
        self.units = units
        self.lower = lower
        pin = any(t.is_cuda for ts in units.values() for t in ts)
        self.host = {u: [torch.zeros((slots.get(u, 0), t.shape[1]), dtype=t.dtype, pin_memory=pin) for t in ts]
                     for u, ts in units.items()}

    def start_load_kv(self, meta: KVConnectorMeta) -> KVTransferFailures | None:
        """Synchronous copies, saves then loads (a load may write a block whose old contents a save of the same
        step reads); then the file tier's writes (of host slots just saved), reads and removals. On CUDA these
        run on the current stream, in order with the forwards; the next step is an async copy on a side stream
        with an event the forward waits on (and, for saves, the block held back from reallocation until its copy
        is done), so that a step's transfers overlap the previous forward. A failed copy is reported, never
        raised: its entries are dropped and its readers computed again."""
        failures = KVTransferFailures()
        for unit, dev_ids, slots in _by_unit(meta.saves):
            if not self._copy("save", self.host[unit], slots, self.units[unit], dev_ids):
                failures.saves += [(unit, s) for s in slots.tolist()]
        for unit, dev_ids, slots in _by_unit(meta.loads):
            if not self._copy("load", self.units[unit], dev_ids, self.host[unit], slots):
                failures.loads += [(unit, d) for d in dev_ids.tolist()]
        if self.lower is not None:
            self.lower.write(meta.writes, self.host, set(failures.saves))
            failures.loads += self.lower.read(meta.reads, self.units)
            self.lower.remove(meta.removes)
        if failures and _other_rank():
            # only rank 0 answers a step: a failure here would go unseen and the ranks' caches would disagree
            raise RuntimeError(f"KV tier transfers failed on tensor-parallel rank {torch.distributed.get_rank()}: "
                               f"{failures}")
        return failures or None

    @staticmethod
    def _copy(what: str, dst: list[torch.Tensor], dst_ids: torch.Tensor, src: list[torch.Tensor],
              src_ids: torch.Tensor) -> bool:
        """Rows src_ids of each src tensor into rows dst_ids of its dst tensor; False (logged) where it fails."""
        try:
            copy_rows(dst, dst_ids, src, src_ids)
            return True
        except (RuntimeError, OSError) as e:
            logger.warning("KV tier: %d block %ss failed (%s); their entries are dropped", len(dst_ids), what, e)
            return False

    def wait_for_save(self) -> None:
        if self.lower is not None:
            self.lower.wait()


def _other_rank() -> bool:
    """A tensor-parallel rank other than 0."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0


def copy_rows(dst: list[torch.Tensor], dst_ids: torch.Tensor, src: list[torch.Tensor], src_ids: torch.Tensor) -> None:
    for d, s in zip(dst, src):
        d[dst_ids.to(d.device)] = s[src_ids.to(s.device)].to(d.device, non_blocking=d.is_cuda)


def readers_of(failures: KVTransferFailures, step, requests: dict, block_rows) -> list[str]:
    """The requests of `step` that read a failed load: a block id in their table (paged units), or a restore
    from a failed snapshot slot into their state slot."""
    rows = {d for u, d in failures.loads if u == ROWS}
    restored = {(u, d) for u, d in failures.loads if u != ROWS}
    into = {(g, dst) for g, src, dst in step.state_restores if (g, src) in restored}
    found = []
    for c in step.chunks:
        st = requests[c.request_id]
        ids, lens = block_rows.ids[st.table_row], block_rows.lens[st.table_row]
        held = [ids[g, :lens[g]] for g in range(len(lens))]
        if (rows and any(np.isin(h, list(rows)).any() for h in held)
                or any(lens[g] and (g, int(held[g][0])) in into for g in range(len(lens)))):
            found.append(c.request_id)
    return found


def _by_unit(transfers: list[tuple[int, int, int]]):
    """(unit, device indices, tier slots) per unit, in first-seen order."""
    by: dict[int, tuple[list[int], list[int]]] = {}
    for unit, dev, slot in transfers:
        d, s = by.setdefault(unit, ([], []))
        d.append(dev)
        s.append(slot)
    for unit, (d, s) in by.items():
        yield unit, torch.tensor(d, dtype=torch.int64), torch.tensor(s, dtype=torch.int64)


def build_connector_worker(config, groups: list[KVCacheGroup], kv_caches: list[torch.Tensor],
                           num_blocks: int) -> KVConnectorWorker | None:
    """The KV tier's worker side for this config (None: no tier), over the KV cache just allocated."""
    size = config.cache.kv_offloading_size
    if not size:
        return None
    units = tier_units(groups, num_blocks, host_tier_bytes(size, config.parallel.tensor_parallel_size))
    lower = None
    if config.cache.kv_offloading_disk_path:
        lower = DiskTierWorker(tier_directory(config, groups))
    return HostTierWorker(unit_tensors(groups, kv_caches), {u: b // e for u, (b, e) in units.items()}, lower)
