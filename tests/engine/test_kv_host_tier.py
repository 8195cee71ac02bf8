"""The host-memory KV tier behind the prefix cache (--kv-offloading-size): its LRU and byte bound, the KV
coordinator's saves on eviction and loads on a host hit, and whole-engine runs where a prompt whose blocks the
device evicted is served from the host (cached tokens reported, the same greedy tokens)."""
import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.core.kv_connector import ROWS
from kestrel.core.sampling_params import SamplingParams as SP
from kestrel.engine.kv import KVCacheManager
from kestrel.engine.kv.coordinator import TierHit
from kestrel.engine.kv.host_tier import HostBlockPool, HostTierConnector
from kestrel.engine.request import Request
from kestrel.errors import ConfigError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


# ---- the host pool
def test_host_pool_bytes_bound_the_slots_and_lru_evicts_oldest():
    pool = HostBlockPool(num_bytes=3 * 100 + 99, block_bytes=100)
    assert pool.num_slots == 3 and pool.num_bytes == 300 <= 399
    slots = [pool.put(k) for k in "abc"]
    assert sorted(slots) == [0, 1, 2] and len(pool) == 3
    assert pool.get("a") == slots[0]  # touched: "b" is now the least recently used
    d = pool.put("d")
    assert d == slots[1] and "b" not in pool and len(pool) == 3
    assert pool.put("c") == slots[2]  # held already: keeps its slot, touched
    e = pool.put("e")  # LRU order now a, d, c -> "a" goes
    assert e == slots[0] and "a" not in pool and set(pool.entries) == {"c", "d", "e"}


def test_host_pool_never_evicts_pinned_slots():
    pool = HostBlockPool(200, 100)
    a, b = pool.put("a"), pool.put("b")
    pool.pinned.update({a, b})
    assert pool.put("c") is None and set(pool.entries) == {"a", "b"}
    pool.pinned.discard(b)
    assert pool.put("c") == b
    pool.clear()
    assert len(pool) == 0 and pool.put("x") is not None


def test_host_pool_of_less_than_a_block_holds_nothing():
    pool = HostBlockPool(99, 100)
    assert pool.num_slots == 0 and pool.put("a") is None


# ---- the coordinator with the host tier's connector (pure Python)
def req(rid, tokens):
    return Request(rid, list(tokens), SP(max_tokens=4), max_tokens=4)


def run_prompt(kv, r):
    """Schedule the whole prompt (with its hits), compute it, register its blocks, finish."""
    computed, hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - hit, computed)
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)
    kv.free(r)
    return hit


def test_evicted_blocks_are_saved_and_a_host_hit_loads_them_back():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    tier = HostTierConnector.single(num_bytes=10 * 64, block_bytes=64)
    kv.set_connector(tier)
    a = list(range(100, 109))  # 9 tokens: 2 full blocks + 1
    assert run_prompt(kv, req("a", a)) == 0
    assert kv.build_connector_meta() is None  # nothing evicted yet
    a_blocks = {key: b.block_id for key, b in kv.pool.cached.items()}
    assert len(a_blocks) == 2
    assert run_prompt(kv, req("b", range(200, 216))) == 0  # 4 blocks: every one of a's is reallocated
    meta = kv.build_connector_meta()
    assert not meta.loads and sorted(b for _, b, _ in meta.saves) == sorted(a_blocks.values())
    saved_slot = {blk: slot for _, blk, slot in meta.saves}
    assert all(key in tier.pools[ROWS] for key in a_blocks)
    assert tier.get_num_new_matched_tokens(sorted(a_blocks, key=a_blocks.get) + [(0, b"?")], 4) == 8

    again = req("a2", a)
    computed, hit = kv.get_computed_blocks(again)
    assert hit == 8 and all(isinstance(b, TierHit) for b in computed[0])
    assert kv.allocate_slots(again, again.num_tokens - hit, computed)
    meta = kv.build_connector_meta()
    # loads from the slots a's blocks were saved in, into the device blocks the request now holds
    held = kv.block_ids(again)[0]
    assert [b for _, b, _ in meta.loads] == held[:2]
    assert sorted(s for _, _, s in meta.loads) == sorted(saved_slot[a_blocks[k]] for k in a_blocks)
    # the loaded blocks are registered in the device prefix cache again
    assert all(kv.pool.lookup(k) is not None for k in a_blocks)
    # b's blocks were evicted for them: saved to the host (never into a slot loaded in the same step)
    loaded = {s for _, _, s in meta.loads}
    assert meta.saves and not loaded & {s for _, _, s in meta.saves}


def test_save_on_free_copies_a_finished_prefix_at_once_and_its_eviction_copies_nothing():
    """--kv-offloading-save free: a's full blocks are saved as a finishes (the copy runs beside later forwards);
    when b's allocation evicts them, nothing is copied again, and a host hit loads them back as before."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    tier = HostTierConnector({ROWS: (10 * 64, 64)}, HostTierConnector.single(1, 1).unit_of, save_on_free=True)
    kv.set_connector(tier)
    a = list(range(100, 109))
    run_prompt(kv, req("a", a))
    a_blocks = {key: b.block_id for key, b in kv.pool.cached.items()}
    meta = kv.build_connector_meta()
    assert sorted(b for _, b, _ in meta.saves) == sorted(a_blocks.values()) and not meta.loads
    run_prompt(kv, req("b", range(200, 216)))  # evicts a's blocks; b's own 4 are saved as b finishes
    meta = kv.build_connector_meta()
    b_blocks = [blk.block_id for key, blk in kv.pool.cached.items() if key not in a_blocks]
    assert len(b_blocks) == 4 and sorted(b for _, b, _ in meta.saves) == sorted(b_blocks)  # b's only
    assert tier.saved_blocks == 2 + 4  # each block once: none at a's eviction
    again = req("a2", a)
    computed, hit = kv.get_computed_blocks(again)
    assert hit == 8 and all(isinstance(b, TierHit) for b in computed[0])


def test_no_connector_no_host_hit_and_reset_clears_the_tier():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = list(range(100, 109))
    run_prompt(kv, req("a", a))
    run_prompt(kv, req("b", range(200, 216)))
    assert kv.get_computed_blocks(req("a2", a))[1] == 0

    kv = KVCacheManager(num_blocks=4, block_size=4)
    tier = HostTierConnector.single(10 * 64, 64)
    kv.set_connector(tier)
    run_prompt(kv, req("a", a))
    run_prompt(kv, req("b", range(200, 216)))
    kv.build_connector_meta()
    assert len(tier.pools[ROWS]) == 2
    kv.reset_prefix_cache()
    assert len(tier.pools[ROWS]) == 0 and kv.get_computed_blocks(req("a2", a))[1] == 0


def test_a_device_short_of_blocks_for_the_loads_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    tier = HostTierConnector.single(10 * 64, 64)
    kv.set_connector(tier)
    a = list(range(100, 109))
    run_prompt(kv, req("a", a))
    run_prompt(kv, req("b", range(200, 216)))
    kv.build_connector_meta()
    hog = req("hog", range(300, 312))
    assert kv.allocate_slots(hog, 12)  # 3 of 4 blocks held (b's blocks it took are saved)
    assert len(kv.build_connector_meta().saves) == 3
    again = req("a2", a)
    computed, hit = kv.get_computed_blocks(again)
    assert hit == 8
    assert not kv.allocate_slots(again, 1, computed)  # 2 loads + 1 new > 1 free
    assert kv.build_connector_meta() is None and len(tier.pools[ROWS]) == 5 and not tier.pools[ROWS].pinned


# ---- the engine
A = [(7 * i + 3) % 90 + 5 for i in range(40)]  # 40 tokens: 2 full blocks of 16 before the last token


def others(k):
    return [[(11 * i + 13 * j + 1) % 90 + 5 for i in range(60)] for j in range(1, k + 1)]


def a_twice(llm):
    first = llm.generate([A], GREEDY)[0]
    for p in others(3):  # 5 blocks each (with outputs) in a pool of 8: A's blocks are reallocated
        llm.generate([p], GREEDY)
    return first, llm.generate([A], GREEDY)[0]


def test_llm_serves_an_evicted_prefix_from_the_host_tier(tiny_llama):
    llm = LLM(str(tiny_llama), progress=False, num_kv_blocks=8, max_model_len=128, kv_offloading_size=0.001)
    tier = llm.engine.core.kv_offload.connector
    first, second = a_twice(llm)
    assert first.num_cached_tokens == 0
    assert tier.saved_blocks >= 2 and tier.loaded_blocks == 2
    stats = llm.engine.core.get_stats()
    assert stats["host_kv_loaded_blocks"] == 2 and stats["host_kv_saved_blocks"] == tier.saved_blocks
    assert 0 < stats["host_kv_blocks"] <= stats["host_kv_slots"] == tier.pools[ROWS].num_slots
    assert second.num_cached_tokens == 32  # all of A's full blocks (the last token is computed)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # /reset_prefix_cache clears the host tier too
    for p in others(3):
        llm.generate([p], GREEDY)
    assert len(tier.pools[ROWS]) > 0
    llm.engine.core.reset_prefix_cache()
    assert len(tier.pools[ROWS]) == 0
    assert llm.generate([A], GREEDY)[0].num_cached_tokens == 0


def test_llm_without_the_tier_recomputes_the_evicted_prefix(tiny_llama):
    llm = LLM(str(tiny_llama), progress=False, num_kv_blocks=8, max_model_len=128)
    assert llm.engine.core.kv_offload is None
    first, second = a_twice(llm)
    assert second.num_cached_tokens == 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_bad_sizes_are_refused():
    from kestrel.config import EngineConfig
    from kestrel.engine.addons.kv_offload import KVOffload
    config = EngineConfig()
    config.cache.kv_offloading_size = 0
    with pytest.raises(ConfigError, match="positive"):
        KVOffload.check_config(config)
    config.cache.kv_offloading_size, config.cache.enable_prefix_caching = 1.0, False
    with pytest.raises(ConfigError, match="prefix caching"):
        KVOffload.check_config(config)


def test_the_step_metadata_crosses_the_worker_boundary():
    from kestrel.core.kv_connector import KVConnectorMeta
    from kestrel.core.step import StepInput
    from kestrel.executor.messages import encoder, step_decoder
    step = StepInput(kv_connector_meta=KVConnectorMeta(saves=[(ROWS, 3, 0)], loads=[(ROWS, 5, 1), (0, 6, 2)]))
    back = step_decoder.decode(encoder.encode(step))
    assert back.kv_connector_meta == step.kv_connector_meta
    assert step_decoder.decode(encoder.encode(StepInput())).kv_connector_meta is None


def test_the_worker_copies_saves_then_loads():
    from kestrel.core.kv_connector import KVConnectorMeta
    from kestrel.worker.kv_host_tier import HostTierWorker
    caches = [torch.arange(24, dtype=torch.uint8).reshape(4, 6), torch.arange(12, dtype=torch.uint8).reshape(4, 3)]
    want = [c.clone() for c in caches]
    w = HostTierWorker({ROWS: caches}, {ROWS: 2})
    # block 1 is evicted (saved to slot 0) and reused by a load of slot 0: it ends as it was
    w.start_load_kv(KVConnectorMeta(saves=[(ROWS, 1, 0), (ROWS, 2, 1)], loads=[(ROWS, 1, 0)]))
    assert all(torch.equal(c, x) for c, x in zip(caches, want))
    w.start_load_kv(KVConnectorMeta(loads=[(ROWS, 0, 1)]))  # block 2's rows into block 0
    assert all(torch.equal(c[0], x[2]) for c, x in zip(caches, want))


def test_every_tensor_parallel_rank_saves_and_loads_its_shard(tp_checkpoint):
    """TP=2, pipelined: the step metadata reaches each worker, whose host tier holds its shard of the blocks."""
    from tests.tp import engine

    def run(eng, prompt):
        rid = eng.add_request(prompt, GREEDY)
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished and o.request_id == rid:
                    out = o
        return out

    eng = engine(tp_checkpoint("qwen3"), 2, async_scheduling="on", num_kv_blocks=8, max_model_len=128,
                 kv_offloading_size=0.001)
    try:
        first = run(eng, A)
        for p in others(3):
            run(eng, p)
        second = run(eng, A)
        assert second.num_cached_tokens == 32
        assert second.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        eng.core.shutdown()
