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
from kestrel.platform import triton_gates
from kestrel.worker.kv_allocation import bytes_per_block, slot_row_bytes
from kestrel.worker.kv_copy_stream import CopyStream, PendingSaves
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
        device = next((t.device for ts in units.values() for t in ts), torch.device("cpu"))
        pin = device.type == "cuda"
        self.host = {u: [torch.zeros((slots.get(u, 0), t.shape[1]), dtype=t.dtype, pin_memory=pin) for t in ts]
                     for u, ts in units.items()}
        self.copies = CopyStream(device)  # a side stream on CUDA; none elsewhere (synchronous copies)
        self.pending = PendingSaves()  # device->host copies in flight
        if pin:
            warm_up_copies([t for ts in units.values() for t in ts])

    def start_load_kv(self, meta: KVConnectorMeta | None, step=None) -> KVTransferFailures | None:
        """Before the step's forward: saves then loads on the copy stream (kestrel/worker/kv_copy_stream.py; a
        load may write a block whose old contents a save of the same step reads, and a load from a host slot
        follows the save into it: stream order), the forward waiting for the loads (it reads them) and for the
        saves in flight (of this step or earlier ones) that read a block it writes (`step`'s new blocks and
        snapshot saves; every one where `step` is None); then the file tier's writes (of host slots just saved,
        once those copies are done), reads and removals. On the CPU the copies are synchronous. A failed copy is
        reported, never raised: its entries are dropped and its readers computed again. `meta` None: only the
        guard of the saves in flight."""
        self.pending.poll()
        if meta is None:
            if self.pending:
                self.pending.guard(written_entries(step, None), self.copies.wait)
            return None
        failures = KVTransferFailures()
        with self.copies.context():
            for unit, dev_ids, slots in _by_unit(meta.saves):
                if not self._copy("save", self.host[unit], slots, self.units[unit], dev_ids):
                    failures.saves += [(unit, s) for s in slots.tolist()]
            saved = self.copies.record()
            for unit, dev_ids, slots in _by_unit(meta.loads):
                if not self._copy("load", self.units[unit], dev_ids, self.host[unit], slots):
                    failures.loads += [(unit, d) for d in dev_ids.tolist()]
            loaded = self.copies.record() if meta.loads else None
        self.pending.add(saved, {(u, d) for u, d, _ in meta.saves}, {(u, s) for u, _, s in meta.saves})
        self.copies.wait(loaded)  # the forward reads the loaded blocks
        self.pending.guard(written_entries(step, meta), self.copies.wait)
        if self.lower is not None:
            self.pending.sync({(u, s) for u, s, _ in meta.writes})  # the disk writer reads those host slots
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
        self.pending.sync({s for _, _, w in self.pending.items for s in w})
        self.pending.items.clear()
        if self.lower is not None:
            self.lower.wait()


def _other_rank() -> bool:
    """A tensor-parallel rank other than 0."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0


def copy_rows(dst: list[torch.Tensor], dst_ids: torch.Tensor, src: list[torch.Tensor], src_ids: torch.Tensor) -> None:
    """Rows src_ids of each src tensor into rows dst_ids of its dst tensor. Between the device and pinned host
    memory, asynchronous on the current stream: one Triton launch per tensor pair where the GPU can reach the
    host rows (kestrel/kernels/triton_ops/kv_rows.py), else one copy per run of rows consecutive on both sides
    (an indexed copy would stage through pageable memory, and return before the host rows are written); host to
    host (the CPU), one indexed copy."""
    cuda = next((t.device for t in (*dst, *src) if t.is_cuda), None)
    if cuda is None:
        for d, s in zip(dst, src):
            d[dst_ids] = s[src_ids]
    elif kernel_copies(dst + src):
        from kestrel.kernels.triton_ops.kv_rows import copy_rows_triton
        ids = torch.stack([dst_ids, src_ids]).pin_memory().to(cuda, non_blocking=True)
        copy_rows_triton(dst, ids[0], src, ids[1])
    else:
        copy_runs(dst, dst_ids, src, src_ids)


def kernel_copies(tensors: list[torch.Tensor]) -> bool:
    """Whether the Triton row copy can take these: Triton here, every host tensor pinned."""
    return triton_gates.triton_importable()[0] and all(t.is_cuda or t.is_pinned() for t in tensors)


def warm_up_copies(device_tensors: list[torch.Tensor]) -> None:
    """Compile the row copy's variants at start-up (one per row width and dtype), not at the first eviction."""
    for dtype, row in {(t.dtype, t.shape[1]) for t in device_tensors}:
        dev = torch.zeros((1, row), dtype=dtype, device=device_tensors[0].device)
        host = torch.zeros((1, row), dtype=dtype, pin_memory=True)
        ids = torch.zeros(1, dtype=torch.int64)
        copy_rows([host], ids, [dev], ids)
        copy_rows([dev], ids, [host], ids)
    torch.cuda.synchronize()


def copy_runs(dst: list[torch.Tensor], dst_ids: torch.Tensor, src: list[torch.Tensor], src_ids: torch.Tensor) -> None:
    """copy_rows as one copy per run of rows consecutive on both sides."""
    dl, sl = dst_ids.tolist(), src_ids.tolist()
    runs = [(dl[i], sl[i], j - i) for i, j in _runs(dl, sl)]
    for d, s in zip(dst, src):
        for a, b, n in runs:
            d[a:a + n].copy_(s[b:b + n], non_blocking=True)


def _runs(dst: list[int], src: list[int]):
    """[start, end) index ranges over which both id lists go up by one."""
    start = 0
    for i in range(1, len(dst) + 1):
        if i == len(dst) or dst[i] != dst[i - 1] + 1 or src[i] != src[i - 1] + 1:
            yield start, i
            start = i


def written_entries(step, meta: KVConnectorMeta | None) -> set | None:
    """The (unit, device index) entries that a step writes outside the copy stream: the block ids of its new
    (or resumed) requests and those appended to running ones (ROWS; more than the forward writes: hits
    included), the snapshot slots its state saves fill, and the device entries the disk tier reads into. None
    where the step is unknown (everything)."""
    if step is None:
        return None
    written = {(ROWS, b) for r in step.new_requests for ids in r.block_ids for b in ids}
    written.update((ROWS, b) for c in step.chunks if c.new_block_ids for ids in c.new_block_ids for b in ids)
    written.update((g, dst) for g, _, dst in step.state_saves)
    if meta is not None:
        written.update((u, d) for u, d, _ in meta.reads)
    return written


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
