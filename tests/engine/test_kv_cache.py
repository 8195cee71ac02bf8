"""Block pool and prefix cache, without a model."""
from hypothesis import given, settings, strategies as st

from kestrel.engine.kv import KVCacheManager
from kestrel.engine.request import Request
from kestrel.core.sampling_params import SamplingParams


def req(rid, tokens, **sp):
    return Request(rid, list(tokens), SamplingParams(**sp), max_tokens=16)


def allocate_prompt(kv, r):
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits)
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)
    return n


def test_prefix_hit_shares_blocks_and_counts():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", range(10))  # 2 full blocks + 2 tokens
    assert allocate_prompt(kv, a) == 0
    b = req("b", list(range(8)) + [99, 98, 97])
    assert allocate_prompt(kv, b) == 8
    (ids_a,), (ids_b,) = kv.block_ids(a), kv.block_ids(b)  # one KV group
    assert ids_a[:2] == ids_b[:2]
    assert ids_a[2] != ids_b[2]
    assert kv.pool.blocks[ids_a[0]].ref_cnt == 2
    assert kv.prefix_hits == 8 and kv.prefix_queries == 21
    kv.free(a), kv.free(b)
    assert kv.num_free_blocks == 10


def test_full_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    allocate_prompt(kv, req("a", range(8)))
    assert allocate_prompt(kv, req("b", range(8))) == 4  # last block recomputed for logits


def test_hash_chain_depends_on_parent():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    allocate_prompt(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # same second block, different first block: no hit at all
    assert allocate_prompt(kv, req("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])) == 0


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a, b, e = req("a", [1, 2, 3]), req("b", [5, 6, 7]), req("e", [8, 9, 4])
    for r in (a, b, e):
        allocate_prompt(kv, r)
    for r in (a, b, e):  # freed in this order: a's prefix is the least recently used
        kv.free(r)
    assert len(kv.pool.cached) == 3
    c = req("c", [5, 6, 8])  # takes b's cached block back off the free list
    assert allocate_prompt(kv, c) == 2
    assert kv.pool.cached[(0, b.block_hashes[0])].ref_cnt == 1
    d = req("d", [10, 11, 12])  # two new blocks: the oldest free ones, evicting a's prefix only
    allocate_prompt(kv, d)
    assert (0, a.block_hashes[0]) not in kv.pool.cached
    assert (0, b.block_hashes[0]) in kv.pool.cached and (0, e.block_hashes[0]) in kv.pool.cached


def test_allocate_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = req("a", range(12))
    assert not kv.allocate_slots(r, 12)
    assert kv.num_free_blocks == 2 and "a" not in kv.req_blocks


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 3), st.booleans()), min_size=1, max_size=25))
def test_random_allocations_never_leak(ops):
    kv = KVCacheManager(num_blocks=24, block_size=4)
    live = []
    for i, (length, prefix_kind, free_now) in enumerate(ops):
        tokens = [prefix_kind] * min(length, 8) + list(range(100 + i, 100 + i + max(0, length - 8)))
        r = req(f"r{i}", tokens)
        hits, n = kv.get_computed_blocks(r)
        if kv.allocate_slots(r, r.num_tokens - n, hits):
            r.num_computed_tokens = r.num_tokens
            kv.cache_full_blocks(r)
            live.append(r)
        assert 0 <= kv.num_free_blocks <= 24
        if free_now and live:
            kv.free(live.pop(0))
    for r in live:
        kv.free(r)
    assert kv.num_free_blocks == 24
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_lookahead_slots_are_held_past_the_step_in_both_allocation_paths():
    """An EAGLE-3 chain writes its draft K/V up to k - 1 positions past a step's tokens: allocate_slots holds blocks
    for them (the decode fast path, and the per-group path that a prefix hit takes), refuses when the pool is
    short, and holds no block for them without lookahead."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", range(6))
    assert kv.allocate_slots(a, 6, lookahead=2) and len(kv.block_ids(a)[0]) == 2  # 8 slots
    assert kv.allocate_slots(a, 6, lookahead=3) and len(kv.block_ids(a)[0]) == 3  # 9 slots: one more block
    a.num_computed_tokens = 6
    kv.cache_full_blocks(a)
    b = req("b", list(range(4)) + [9, 9])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and kv.allocate_slots(b, 2, hits, lookahead=3) and len(kv.block_ids(b)[0]) == 3
    c = req("c", range(20, 30))
    assert kv.num_free_blocks == 3 and not kv.allocate_slots(c, 10, lookahead=3)  # 4 blocks wanted
    assert kv.block_ids(c)[0] == [] and kv.num_free_blocks == 3
    assert kv.allocate_slots(c, 10) and len(kv.block_ids(c)[0]) == 3
