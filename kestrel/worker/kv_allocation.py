"""The KV cache's memory: one byte tensor per cache slot, shared by the groups' layers, and each layer's view of
its slot through its spec.

Layer i of every KV-cache group shares slot i. A block id is one row of every slot, and a request's block ids
are disjoint across groups (one pool), so two layers sharing a slot never own the same row at once. A row is as
wide as the widest page among the layers sharing the slot; a layer's page is the row's first page_bytes bytes,
its spec's parts one after the other (kestrel/core/kv_spec.py). Where every page of a slot is as wide, a layer's
parts are plain strided views of one contiguous tensor; a narrower page leaves the rest of its rows unused (the
price of one pool for every group: the padding is counted in bytes_per_block, so it is never over-committed)."""
from __future__ import annotations

import torch

from kestrel.core.device import to_device
from kestrel.core.kv_spec import KVCacheGroup


def slot_row_bytes(groups: list[KVCacheGroup]) -> list[int]:
    """Bytes of one block in each cache slot: the widest page among the layers sharing it."""
    num_slots = max(len(g.layer_names) for g in groups)
    return [max(g.spec_of(g.layer_names[i]).page_bytes for g in groups if i < len(g.layer_names))
            for i in range(num_slots)]


def bytes_per_block(groups: list[KVCacheGroup]) -> int:
    """What one block id costs: a row in every slot."""
    return sum(slot_row_bytes(groups))


def state_bytes(groups: list[KVCacheGroup]) -> int:
    """Memory outside the block pool: the state slots of kinds that keep a fixed-size state per request."""
    return sum(len(g.layer_names) * g.spec.num_state_slots * g.spec.state_bytes for g in groups)


def allocate_kv_cache(groups: list[KVCacheGroup], layers: dict, num_blocks: int,
                      device: torch.device) -> list[torch.Tensor]:
    """Zeroed slots of `num_blocks` rows (and each stateful layer's state slots); sets each layer's `kv_cache`
    to its spec's view of them (a reader's to its source's) (and a stateful layer's `state_rows` to its state slots, uint8 [num_state_slots,
    state_bytes]: what copy_state_slots copies). Returns the tensors allocated."""
    slots = [torch.zeros((num_blocks, row), dtype=torch.uint8, device=device) for row in slot_row_bytes(groups)]
    tensors = list(slots)
    for g in groups:
        for i, name in enumerate(g.layer_names):
            state = None
            if g.spec.state_bytes:
                state = torch.zeros((g.spec.num_state_slots, g.spec.state_bytes), dtype=torch.uint8, device=device)
                tensors.append(state)
                layers[name].state_rows = state
            layers[name].kv_cache = g.spec_of(name).layer_view(slots[i], state)
        for name, source in g.readers.items():
            layers[name].kv_cache = layers[source].kv_cache
    return tensors


def copy_state_slots(groups: list[KVCacheGroup], layers: dict, copies: list[tuple[int, int, int]]) -> None:
    """Copy whole state slots, (group id, src slot, dst slot) each, in every layer of the group: prefix-cache
    snapshots saved and restored (kestrel/engine/kv/managers.py StateSlotManager). On the device's current
    stream, so in order with the forwards that write and read the slots (CUDA graphs included)."""
    by_group: dict[int, tuple[list[int], list[int]]] = {}
    for gid, src, dst in copies:
        srcs, dsts = by_group.setdefault(gid, ([], []))
        srcs.append(src)
        dsts.append(dst)
    for gid, (srcs, dsts) in by_group.items():
        names = groups[gid].layer_names
        device = layers[names[0]].state_rows.device
        src, dst = (to_device(ids, torch.int64, device) for ids in (srcs, dsts))  # no host sync
        for name in names:
            rows = layers[name].state_rows
            rows.index_copy_(0, dst, rows.index_select(0, src))
