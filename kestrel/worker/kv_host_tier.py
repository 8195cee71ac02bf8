"""The host-memory KV tier's worker side (--kv-offloading-size): one host tensor per KV-cache slot tensor
(kestrel/worker/kv_allocation.py), [num_host_slots, row_bytes] uint8, pinned where the cache is on CUDA, and the
copies of whole block rows between them. A block id is one row of every slot tensor, so a block's copy is its row
in each: the same for every full-attention group, whatever the group. The scheduler side (which key sits in which
slot, the LRU, the byte bound) is kestrel/engine/kv/host_tier.py; both size the tier with `host_tier_slots`."""
from __future__ import annotations

import torch

from kestrel.core.kv_connector import KVConnectorMeta, KVConnectorWorker
from kestrel.worker.kv_allocation import bytes_per_block

GiB = 2**30


def host_tier_bytes(size_gib: float, tp_size: int = 1) -> int:
    """This rank's share of --kv-offloading-size (vLLM's meaning: summed over the tensor-parallel ranks)."""
    return int(size_gib * GiB) // max(1, tp_size)


def host_tier_slots(size_gib: float, groups, tp_size: int = 1) -> int:
    """Host blocks the byte bound buys: a host block costs what a device block id costs (a row of every slot)."""
    return host_tier_bytes(size_gib, tp_size) // bytes_per_block(groups)


class HostTierWorker(KVConnectorWorker):
    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int):
        self.kv_caches = kv_caches
        pin = bool(kv_caches) and kv_caches[0].is_cuda
        self.host = [torch.zeros((num_slots, t.shape[1]), dtype=t.dtype, pin_memory=pin) for t in kv_caches]

    def start_load_kv(self, meta: KVConnectorMeta) -> None:
        """Synchronous copies, saves then loads (a load may write a block whose old contents a save of the same
        step reads). On CUDA these run on the current stream, in order with the forwards; the next step is an
        async copy on a side stream with an event the forward waits on (and, for saves, the block held back
        from reallocation until its copy is done), so that a step's transfers overlap the previous forward."""
        if meta.saves:
            blocks, slots = self._ids(meta.saves)
            for dev, host in zip(self.kv_caches, self.host):
                host[slots] = dev[blocks.to(dev.device)].to("cpu")
        if meta.loads:
            blocks, slots = self._ids(meta.loads)
            for dev, host in zip(self.kv_caches, self.host):
                dev[blocks.to(dev.device)] = host[slots].to(dev.device, non_blocking=True)

    @staticmethod
    def _ids(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, slots = zip(*pairs)
        return torch.tensor(blocks, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)
