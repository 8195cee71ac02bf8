"""The KDA state cache kind: its spec's parts and views, one state group for all its layers with a pool of
max_num_seqs + 1 slots (slot 0 the null slot), the slot manager under the coordinator (admission by free slot,
slots back on free/preemption), prefix caching turned off for it without snapshot slots, and with them: states
saved at block-aligned chunk ends, hits at the last snapshot within the attention hit, the chunk rule, LRU
eviction of unreferenced snapshots, and the runner's slot copies (CPU, and CUDA where there is one)."""
import logging

import pytest
import torch

from kestrel.core.kv_spec import KDAStateSpec, MLASpec, group_layers
from kestrel.core.sampling_params import SamplingParams
from kestrel.engine.kv import KVCacheManager, manager_class
from kestrel.engine.kv.managers import FullAttentionManager, StateSlotManager
from kestrel.engine.request import Request
from kestrel.worker.kv_allocation import allocate_kv_cache, bytes_per_block, copy_state_slots, state_bytes

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

    groups = group_layers(specs(), block_size=4, max_num_seqs=3, num_snapshots=2)
    assert decode_groups(encode_groups(groups)) == groups


def snapshot_kv(num_snapshots=2, num_blocks=40, max_num_seqs=2):
    groups = group_layers(specs(), block_size=4, max_num_seqs=max_num_seqs, num_snapshots=num_snapshots)
    kv = KVCacheManager(num_blocks, groups=groups)
    s = [g.group_id for g in groups if isinstance(g.spec, KDAStateSpec)][0]
    return kv, kv.managers[s], s


def prefill(kv, r, chunks):
    """Run `chunks` (token counts) of request `r` as the scheduler would: allocate, compute, cache."""
    for n in chunks:
        computed, hit = kv.get_computed_blocks(r) if r.num_computed_tokens == 0 else (None, 0)
        assert kv.allocate_slots(r, n, computed)
        r.num_computed_tokens += hit + n
        kv.cache_full_blocks(r)


def shared(rid, n, tail):
    return Request(rid, list(range(1, n + 1)) + tail, SamplingParams(max_tokens=2), eos_token_id=None, max_tokens=2)


def test_snapshots_at_block_aligned_chunk_ends():
    kv, state, s = snapshot_kv()
    assert kv.enable_prefix_caching and state.first_snapshot == 3  # slots 1, 2 for requests, 3, 4 snapshots
    a = shared("a", 14, [])
    prefill(kv, a, [6, 6, 2])  # chunk ends 6 (mid-block), 12 (block 3's end), 14
    (restores, saves) = kv.take_state_copies()
    slot_a = kv.block_ids(a)[s][0]
    assert restores == [] and saves == [(s, slot_a, 3)]  # one save, at 12, into the first snapshot slot
    assert kv.take_state_copies() == ([], [])  # handed over once
    b = shared("b", 14, [99, 98])  # shares 3.5 blocks: the attention blocks serve 3, the snapshot at 12 too
    computed, hit = kv.get_computed_blocks(b)
    assert hit == 12 and computed[s] == [state.snapshots.blocks[0]]
    assert kv.allocate_slots(b, 4, computed)
    slot_b = kv.block_ids(b)[s][0]
    assert kv.take_state_copies() == ([(s, 3, slot_b)], [(s, slot_b, 4)])  # restore; and save at 16
    c = shared("c", 10, [77, 76, 75])  # 2.5 blocks shared: attention 2 blocks, no snapshot at 8: no hit
    assert kv.get_computed_blocks(c)[1] == 0


def test_chunk_rule():
    kv, _, _ = snapshot_kv()
    assert kv.aligned_chunk(0, 14) == 12  # crosses 4, 8, 12: ends on 12
    assert kv.aligned_chunk(12, 2) == 2  # within one block: whole
    assert kv.aligned_chunk(5, 3) == 3 and kv.aligned_chunk(5, 7) == 7  # ends on 8, on 12
    assert kv.aligned_chunk(13, 1) == 1  # a decode
    off = KVCacheManager(40, groups=group_layers(specs(), block_size=4, max_num_seqs=2, num_snapshots=2),
                         enable_prefix_caching=False)
    assert off.aligned_chunk(0, 14) == 14
    r = shared("r", 14, [])
    assert off.allocate_slots(r, 12) and off.take_state_copies() == ([], [])  # no prefix caching: no saves


def tokens_req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=2), eos_token_id=None, max_tokens=2)


def test_snapshots_held_until_registered_then_least_recently_used_evicted():
    kv, state, s = snapshot_kv(num_snapshots=2, max_num_seqs=3)
    a, b, c = (tokens_req(r, list(range(base, base + 9))) for r, base in (("a", 100), ("b", 200), ("c", 300)))
    for r in (a, b, c):
        assert kv.allocate_slots(r, 4, kv.get_computed_blocks(r)[0])
    slot = {r.request_id: kv.block_ids(r)[s][0] for r in (a, b, c)}
    f = state.first_snapshot  # 4: slots 1-3 for requests
    assert kv.take_state_copies()[1] == [(s, slot["a"], f), (s, slot["b"], f + 1)]  # c's skipped: both held
    assert state.snapshots.num_free == 0
    for r in (a, b):  # the step ran: registered, then free to evict (a's first)
        r.num_computed_tokens = 4
        kv.cache_full_blocks(r)
    assert state.snapshots.num_free == 2 and len(state.snapshots.cached) == 2
    kv.free(c)
    probe = tokens_req("p", list(range(100, 104)) + [1, 2])
    computed, hit = kv.get_computed_blocks(probe)
    assert hit == 4 and kv.allocate_slots(probe, 2, computed)  # a's snapshot: now the most recently used
    assert kv.take_state_copies() == ([(s, f, kv.block_ids(probe)[s][0])], [])
    kv.free(b)  # its registered snapshot stays cached
    d = tokens_req("d", list(range(50, 59)))
    assert kv.allocate_slots(d, 4, kv.get_computed_blocks(d)[0])
    assert kv.take_state_copies()[1] == [(s, kv.block_ids(d)[s][0], f + 1)]  # evicts b's snapshot, not a's
    assert kv.get_computed_blocks(tokens_req("q", list(range(200, 206))))[1] == 0
    assert kv.get_computed_blocks(tokens_req("q", list(range(100, 106))))[1] == 4
    kv.free(d)  # its save never registered: back without a hash
    assert state.snapshots.num_free == 2 and not state.pending
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(tokens_req("q", list(range(100, 106))))[1] == 0 and not state.snapshots.cached


def test_no_second_snapshot_of_one_prefix():
    kv, state, s = snapshot_kv()
    a, b = tokens_req("a", list(range(1, 10))), tokens_req("b", list(range(1, 10)))
    prefill(kv, a, [4])
    assert len(kv.take_state_copies()[1]) == 1
    assert kv.allocate_slots(b, 2)  # b, admitted with a's 4 tokens known, computes its own from scratch
    assert kv.allocate_slots(b, 2) and kv.take_state_copies() == ([], [])  # ends on 4: a's snapshot is there


def test_copy_state_slots_cpu():
    copy_slots_on(torch.device("cpu"))


@pytest.mark.gpu
def test_copy_state_slots_cuda():
    """The runner's snapshot save and restore on CUDA tensors (the slots the fused decode and graphs write)."""
    copy_slots_on(torch.device("cuda"))


def copy_slots_on(device):
    groups = group_layers(specs(), block_size=4, max_num_seqs=2, num_snapshots=2)
    layers = {name: type("L", (), {})() for name in specs()}
    allocate_kv_cache(groups, layers, num_blocks=5, device=device)
    g = next(g for g in groups if isinstance(g.spec, KDAStateSpec))
    for i, name in enumerate(g.layer_names):
        recurrent, conv = layers[name].kv_cache
        recurrent[1].fill_(i + 0.5)
        conv[2].fill_(-i - 1.0)
    copy_state_slots(groups, layers, [(g.group_id, 1, 3), (g.group_id, 2, 4)])
    for i, name in enumerate(g.layer_names):
        recurrent, conv = layers[name].kv_cache
        assert recurrent.device.type == device.type
        assert torch.equal(recurrent[3], recurrent[1]) and (recurrent[3] == i + 0.5).all()
        assert torch.equal(conv[4], conv[2]) and (conv[4] == -i - 1.0).all()
        assert torch.equal(conv[3], conv[1]) and recurrent[4].abs().sum() == 0  # whole slots, both parts


def test_state_only_model_has_no_prefix_caching(caplog):
    """A hit's length is counted in a group with a block per block_size tokens: without one, no hits."""
    with caplog.at_level(logging.INFO, logger="kestrel.engine.kv.coordinator"):
        kv = KVCacheManager(8, groups=group_layers({"k": KDA}, block_size=4, max_num_seqs=2, num_snapshots=2))
    assert not kv.enable_prefix_caching and "no layer with a block per block_size tokens" in caplog.text
    assert kv.aligned_chunk(0, 14) == 14
