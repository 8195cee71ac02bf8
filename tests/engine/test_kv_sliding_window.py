"""KV-cache groups: a sliding-window group frees the blocks that fell out of its window while the request runs,
its prefix hits need only the blocks under the window, and a full-attention group beside it bounds the hit."""
import torch
from hypothesis import given, settings, strategies as st

from kestrel.core.kv_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec, group_layers
from kestrel.engine.kv import NULL_BLOCK_ID, KVCacheManager
from kestrel.engine.request import Request
from kestrel.core.sampling_params import SamplingParams

BS, WINDOW = 4, 6  # a query needs the 5 keys before it: ceil(5 / 4) = 2 blocks before its own
FULL = FullAttentionSpec(torch.float32, 2, 8, block_size=BS)
SLIDING = SlidingWindowSpec(torch.float32, 2, 8, sliding_window=WINDOW, block_size=BS)


def hybrid(num_blocks, caching=True):
    # 2 full + 4 sliding layers: 1 full group and 2 sliding groups of 2 layers
    specs = {f"l{i}": (FULL if i in (2, 5) else SLIDING) for i in range(6)}
    groups = group_layers(specs)
    assert [type(g.spec) for g in groups] == [SlidingWindowSpec, SlidingWindowSpec, FullAttentionSpec]
    return KVCacheManager(num_blocks, BS, caching, groups)


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(), max_tokens=64)


def run_prompt(kv, r, chunk):
    """Prefill in chunks the way the scheduler does: allocate, compute, cache."""
    hits, n = kv.get_computed_blocks(r)
    first = True
    while r.num_computed_tokens + (n if first else 0) < r.num_tokens:
        todo = min(chunk, r.num_tokens - r.num_computed_tokens - (n if first else 0))
        assert kv.allocate_slots(r, todo, hits if first else None)
        r.num_computed_tokens += (n if first else 0) + todo
        first = False
        kv.cache_full_blocks(r)
    return n


def test_grouping_cuts_layers_into_equal_groups():
    groups = group_layers({f"l{i}": (FULL if i % 6 == 5 else SLIDING) for i in range(26)})  # Gemma 3 1B's pattern
    assert [len(g.layer_names) for g in groups] == [4, 4, 4, 4, 4, 2, 4]
    assert sum(isinstance(g.spec, SlidingWindowSpec) for g in groups) == 6


def test_sliding_group_frees_blocks_out_of_window_while_running():
    kv = hybrid(64)
    r = req("a", range(40))
    run_prompt(kv, r, chunk=8)
    sliding, full = kv.block_ids(r)[0], kv.block_ids(r)[2]
    assert len(full) == 10 and NULL_BLOCK_ID not in full
    # next query at position 40 needs keys 35..40: blocks 8.. (positions 32..) stay, blocks 0..7 are freed
    assert kv.allocate_slots(r, 1)
    assert sliding[:8] == [NULL_BLOCK_ID] * 8 and NULL_BLOCK_ID not in sliding[8:]
    held = {b for ids in kv.block_ids(r) for b in ids if b != NULL_BLOCK_ID}
    assert kv.num_free_blocks == kv.num_blocks - len(held)
    kv.free(r)
    assert kv.num_free_blocks == kv.num_blocks


def test_prefix_hit_needs_only_the_window_and_full_group_bounds_it():
    kv = hybrid(64)
    run_prompt(kv, req("a", range(40)), chunk=40)
    b = req("b", list(range(36)) + [7, 7, 7, 7, 7])
    hits, n = kv.get_computed_blocks(b)
    assert n == 36  # 9 full blocks shared
    assert [blk.block_id for blk in hits[0][:7]] == [NULL_BLOCK_ID] * 7  # outside the window before position 36
    assert all(blk.block_id != NULL_BLOCK_ID for blk in hits[0][7:]) and len(hits[0]) == 9
    assert all(blk.block_id != NULL_BLOCK_ID for blk in hits[2])
    # evict block 8 of the first sliding group: its hit now ends at block 8 (blocks 6, 7 still cached), and
    # the full group and the other sliding group follow it down
    kv.pool.cached.pop((0, b.block_hashes[8]))
    hits2, n2 = kv.get_computed_blocks(b)
    assert n2 == 8 * BS
    assert [len(h) for h in hits2] == [8, 8, 8]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 3), st.integers(1, 12), st.booleans()),
                min_size=1, max_size=20))
def test_random_hybrid_allocations_never_leak(ops):
    kv = hybrid(48)
    live = []
    for i, (length, prefix_kind, chunk, free_now) in enumerate(ops):
        r = req(f"r{i}", [prefix_kind] * min(length, 12) + list(range(100 + i, 100 + i + max(0, length - 12))))
        hits, n = kv.get_computed_blocks(r)
        if kv.allocate_slots(r, min(chunk, r.num_tokens - n), hits):
            r.num_computed_tokens = n + min(chunk, r.num_tokens - n)
            kv.cache_full_blocks(r)
            while r.num_computed_tokens < r.num_tokens and kv.allocate_slots(
                    r, min(chunk, r.num_tokens - r.num_computed_tokens)):
                r.num_computed_tokens += min(chunk, r.num_tokens - r.num_computed_tokens)
                kv.cache_full_blocks(r)
            live.append(r)
        held = [b for ids in kv.block_ids(r) for b in ids]
        assert len(held) == 0 or r in live
        if free_now and live:
            kv.free(live.pop(0))
    for r in live:
        kv.free(r)
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_hits_of_every_group_are_taken_before_new_blocks():
    """A request's hits in a later group sit on the free list while an earlier group takes new blocks: they must
    be claimed first, or the earlier group's allocation evicts and reuses them (found by the Gemma 3 tests)."""
    kv = hybrid(40)
    a = req("a", range(24))
    run_prompt(kv, a, chunk=24)  # 6 blocks in each of the 3 groups
    fresh = kv.pool.allocate(kv.pool.num_free)
    kv.free(a)  # a's blocks now head the free list (group 0's first), the never-used ones follow
    kv.pool.release(fresh)
    b = req("b", list(range(12)) + list(range(50, 78)))  # 3 blocks shared, 7 new blocks per group
    hits, n = kv.get_computed_blocks(b)
    assert n == 12
    assert kv.allocate_slots(b, b.num_tokens - n, hits)
    held = [i for ids in kv.block_ids(b) for i in ids if i != NULL_BLOCK_ID]
    assert len(held) == len(set(held))  # no block serves two places
    for group_hits in hits:
        for blk in group_hits:
            if blk.block_id != NULL_BLOCK_ID:
                assert blk.ref_cnt == 1 and kv.pool.cached[blk.block_hash] is blk


def mixed_windows(num_blocks):
    """Groups in the order full, window 6, window 10, window 6: two windows interleaved."""
    wide = SlidingWindowSpec(torch.float32, 2, 8, sliding_window=10, block_size=BS)
    specs = [FULL, SLIDING, wide, SLIDING]
    return KVCacheManager(num_blocks, BS, True, [KVCacheGroup(i, s, [f"l{i}"]) for i, s in enumerate(specs)])


def cache_per_group(kv, r):
    """cache_full_blocks without its shortcut: every group registers every full block each time."""
    hashes = kv._block_hashes(r)
    for m in kv.managers:
        m.cache_blocks(r.request_id, hashes, min(r.num_computed_tokens // BS, len(hashes)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 9), st.integers(0, 2)), min_size=1, max_size=60))
def test_shared_count_allocation_matches_per_group_allocation(ops):
    """allocate_slots computes one block count for all groups and frees windows once per window size; the
    per-group form asks every group. Both must leave the same block tables, free-list order and prefix cache,
    through prefills with hits, decode steps, pool exhaustion and frees; likewise cache_full_blocks, which skips
    steps that filled no block, against registering every group's full blocks each step."""
    kvs = [mixed_windows(40), mixed_windows(40)]
    allocate = [kvs[0].allocate_slots, kvs[1]._allocate_per_group]
    cache = [kvs[0].cache_full_blocks, lambda r: cache_per_group(kvs[1], r)]
    reqs: list[list[Request]] = [[], []]
    for i, (slot, num_new, action) in enumerate(ops):
        results = []
        for kv, alloc, cache_blocks, rs in zip(kvs, allocate, cache, reqs):
            if action == 0 or not rs:  # admit a request, maybe with a prefix hit
                r = req(f"r{i}", [slot % 2] * 9 + list(range(100 + i, 100 + i + num_new)))
                hits, n = kv.get_computed_blocks(r)
                ok = alloc(r, min(r.num_tokens - n, 8), hits)
                if ok:
                    r.num_computed_tokens = n + min(r.num_tokens - n, 8)
                    rs.append(r)
            else:
                r = rs[slot % len(rs)]
                if action == 1:  # a step of `num_new` tokens (decode: the sampled ones are appended first)
                    while r.num_tokens < r.num_computed_tokens + num_new:
                        r.output_token_ids.append(7 + r.num_tokens % 3)
                    ok = alloc(r, num_new)
                    if ok:
                        r.num_computed_tokens += num_new
                else:
                    kv.free(r)
                    rs.remove(r)
                    ok = None
            if ok:
                cache_blocks(r)
            results.append((ok, {r.request_id: kv.block_ids(r) for r in rs}, list(kv.pool.free),
                            sorted(kv.pool.cached), sorted(kv.grown)))
        assert results[0] == results[1]
