"""The KDA state cache kind: its spec's parts and views, one state group for all its layers with a pool of
max_num_seqs + 1 slots (slot 0 the null slot), the slot manager under the coordinator (admission by free slot,
slots back on free/preemption), and prefix caching turned off for a model that has it."""
import logging

import pytest
import torch

from kestrel.core.kv_spec import KDAStateSpec, MLASpec, group_layers
from kestrel.core.sampling_params import SamplingParams
from kestrel.engine.kv import KVCacheManager, manager_class
from kestrel.engine.kv.managers import FullAttentionManager, StateSlotManager
from kestrel.engine.request import Request
from kestrel.worker.kv_allocation import allocate_kv_cache, bytes_per_block, state_bytes

KDA = KDAStateSpec(torch.bfloat16, num_heads=2, head_dim=8, conv_width=4)
MLA = MLASpec(torch.bfloat16, 16, 8)


def specs():
    return {"l0.kda": KDA, "l1.kda": KDA, "l2.kda": KDA, "l3.mla": MLA, "l4.kda": KDA}


def req(rid, n):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=2), eos_token_id=None, max_tokens=2)


def test_one_state_group_sized_by_max_num_seqs():
    groups = group_layers(specs(), block_size=4, max_num_seqs=3)
    by_kind = {type(g.spec): g for g in groups}
    assert len(groups) == 2
    assert by_kind[KDAStateSpec].layer_names == ["l0.kda", "l1.kda", "l2.kda", "l4.kda"]
    assert by_kind[KDAStateSpec].spec.num_state_slots == 4  # 3 requests + the null slot
    assert by_kind[MLASpec].layer_names == ["l3.mla"]
    assert manager_class(by_kind[KDAStateSpec].spec) is StateSlotManager
    assert manager_class(by_kind[MLASpec].spec) is FullAttentionManager


def test_state_parts_and_allocation():
    groups = group_layers(specs(), block_size=4, max_num_seqs=3)
    assert KDA.page_bytes == 0
    assert KDA.state_parts() == [(torch.float32, (2, 8, 8)), (torch.bfloat16, (48, 3))]
    assert bytes_per_block(groups) == 4 * 24 * 2  # one MLA page of 4 tokens: the state takes nothing per block
    assert state_bytes(groups) == 4 * 4 * (2 * 8 * 8 * 4 + 48 * 3 * 2)  # 4 layers x 4 slots
    layers = {name: type("L", (), {})() for name in specs()}
    allocate_kv_cache(groups, layers, num_blocks=5, device=torch.device("cpu"))
    recurrent, conv = layers["l4.kda"].kv_cache
    assert recurrent.shape == (4, 2, 8, 8) and recurrent.dtype == torch.float32
    assert conv.shape == (4, 48, 3) and conv.dtype == torch.bfloat16
    assert layers["l3.mla"].kv_cache.shape == (5, 4, 24)
    recurrent.fill_(1.0)  # layers do not share state memory
    assert layers["l0.kda"].kv_cache[0].abs().sum() == 0


def test_slots_under_the_coordinator(caplog):
    groups = group_layers(specs(), block_size=4, max_num_seqs=2)
    with caplog.at_level(logging.INFO, logger="kestrel.engine.kv.coordinator"):
        kv = KVCacheManager(20, groups=groups)
    assert "Prefix caching is off for this model: its KDAStateSpec layers" in caplog.text
    assert not kv.enable_prefix_caching
    s = [g.group_id for g in groups if isinstance(g.spec, KDAStateSpec)][0]
    a, b, c = req("a", 5), req("b", 3), req("c", 2)
    assert kv.allocate_slots(a, 5) and kv.allocate_slots(b, 3)
    assert sorted(kv.block_ids(a)[s] + kv.block_ids(b)[s]) == [1, 2]  # never the null slot 0
    assert not kv.allocate_slots(c, 2)  # blocks to spare, no slot: nothing changes
    assert kv.block_ids(c)[s] == [] and kv.num_free_blocks == 20 - 3
    slot_a = kv.block_ids(a)[s][0]
    kv.free(a)  # finished or preempted: the slot goes back
    assert kv.allocate_slots(c, 2) and kv.block_ids(c)[s] == [slot_a]
    assert kv.get_computed_blocks(req("d", 12)) == ([[], []], 0)


def test_unsized_state_spec_is_refused():
    with pytest.raises(ValueError, match="has 0 state slots: size the pool"):
        KVCacheManager(8, groups=group_layers({"k": KDA}, block_size=4))


def test_groups_cross_the_process_boundary():
    from kestrel.executor.messages import decode_groups, encode_groups

    groups = group_layers(specs(), block_size=4, max_num_seqs=3)
    assert decode_groups(encode_groups(groups)) == groups
