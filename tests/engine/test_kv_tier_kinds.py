"""Every cache kind the prefix cache covers goes through the host KV tier (--kv-offloading-size), each through its
manager's declared unit (KVManager.tier_unit): a sliding window's blocks (only those under the window are
loaded), MLA latents (with DSA's indexer keys: the same block rows) and recurrent-state snapshots (Kimi Linear's
KDA state slots). Offline engines on tiny models with a device pool small enough to evict: prompt A, prompts that
evict A's blocks, A again: with the tier the second A reports A's full blocks as cached and gives the same
greedy tokens; without it, none."""
import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.core.kv_connector import ROWS
from kestrel.core.kv_spec import FullAttentionSpec, KDAStateSpec, KVCacheGroup, SlidingWindowSpec
from kestrel.core.sampling_params import SamplingParams as SP
from kestrel.engine.kv import KVCacheManager
from kestrel.engine.kv.host_tier import HostTierConnector
from kestrel.engine.kv.pool import TierHit
from kestrel.engine.request import Request
from tests.tiny import make_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
A = [(7 * i + 3) % 90 + 5 for i in range(40)]  # 2 full blocks of 16 before the last token


def others(k):
    return [[(11 * i + 13 * j + 1) % 90 + 5 for i in range(60)] for j in range(1, k + 1)]


def req(rid, tokens):
    return Request(rid, list(tokens), SP(max_tokens=4), max_tokens=4)


def tiered(groups, num_blocks, units):
    kv = KVCacheManager(num_blocks=num_blocks, groups=groups)
    tier = HostTierConnector(units, [m.tier_unit for m in kv.managers])
    kv.set_connector(tier)
    return kv, tier


def run_prompt(kv, r):
    """Compute the prompt in chunks as the scheduler cuts them (at block boundaries where snapshots are kept),
    register its blocks, finish."""
    computed, hit = kv.get_computed_blocks(r)
    start = hit
    while start < r.num_tokens:
        n = kv.aligned_chunk(start, r.num_tokens - start)
        assert kv.allocate_slots(r, n, computed if start == hit else None)
        start = r.num_computed_tokens = start + n
        kv.take_state_copies()
        kv.cache_full_blocks(r)
    kv.free(r)
    return hit


# ---- the coordinator (pure Python)
def test_a_sliding_window_loads_only_the_blocks_under_its_window():
    bs = 4
    groups = [KVCacheGroup(0, FullAttentionSpec(torch.float16, block_size=bs), ["f"]),
              KVCacheGroup(1, SlidingWindowSpec(torch.float16, block_size=bs, sliding_window=6), ["s"])]
    kv, tier = tiered(groups, 20, {ROWS: (100 * 64, 64)})
    a = list(range(100, 125))  # 6 full blocks + 1 a group
    run_prompt(kv, req("a", a))
    run_prompt(kv, req("b", range(200, 236)))  # 9 blocks a group: 18 of 19, all of a's but the last freed
    meta = kv.build_connector_meta()
    assert {u for u, _, _ in meta.saves} == {ROWS} and len(meta.saves) == 11
    again = req("a2", a)
    computed, hit = kv.get_computed_blocks(again)
    assert hit == 24
    assert all(isinstance(b, TierHit) for b in computed[0])  # full attention: all 6
    window = computed[1]  # the window (6 tokens) needs the 2 blocks before the hit point; the rest are null
    assert [isinstance(b, TierHit) for b in window] == [False] * 4 + [True] * 2
    assert all(b is kv.pool.null_block for b in window[:4])
    assert kv.allocate_slots(again, again.num_tokens - hit, computed)
    loads = kv.build_connector_meta().loads
    assert len(loads) == 8 and all(u == ROWS for u, _, _ in loads)
    held = kv.block_ids(again)
    assert sorted(b for _, b, _ in loads) == sorted(held[0][:6] + held[1][4:6])
    kv.free(again)
    assert kv.num_free_blocks == kv.num_blocks


def state_tier(state_layers: list[str]):
    """A full-attention group and a KDA state group of 3 working slots and 1 snapshot slot, with a host tier."""
    state = KDAStateSpec(torch.float16, block_size=4, num_heads=1, head_dim=2, num_slots=3, num_snapshots=1)
    groups = [KVCacheGroup(0, FullAttentionSpec(torch.float16, block_size=4), ["f"]),
              KVCacheGroup(1, state, state_layers)]
    entry = len(state_layers) * state.state_bytes
    return tiered(groups, 8, {ROWS: (20 * 64, 64), 1: (4 * entry, entry)})


def test_state_snapshots_are_saved_and_loaded_as_their_groups_unit():
    kv, tier = state_tier(["k0", "k1"])
    assert [m.tier_unit for m in kv.managers] == [ROWS, 1]
    snapshot_slot = 3  # after the 3 working slots
    a = list(range(100, 109))  # 2 full blocks + 1: the snapshot after block 2
    run_prompt(kv, req("a", a))
    run_prompt(kv, req("b", range(200, 229)))  # its snapshot takes the only snapshot slot; its blocks, a's
    meta = kv.build_connector_meta()
    assert (1, snapshot_slot) in {(u, d) for u, d, _ in meta.saves}  # a's snapshot, by its state slot
    again = req("a2", a)
    computed, hit = kv.get_computed_blocks(again)
    assert hit == 8 and isinstance(computed[1][0], TierHit)
    assert kv.allocate_slots(again, again.num_tokens - hit, computed)
    meta = kv.build_connector_meta()
    assert sorted(u for u, _, _ in meta.loads) == [ROWS, ROWS, 1]
    assert (1, snapshot_slot) in {(u, d) for u, d, _ in meta.loads}
    # b's snapshot, evicted for a's, is saved before the load overwrites the slot (saves precede loads)
    assert (1, snapshot_slot) in {(u, d) for u, d, _ in meta.saves}
    restores, _ = kv.take_state_copies()
    assert restores == [(1, snapshot_slot, kv.block_ids(again)[1][0])]
    state_mgr = kv.managers[1]
    assert not state_mgr.loading and state_mgr.snapshots.num_free == 1  # held only until the copies were taken
    kv.free(again)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_snapshot_in_the_tier_is_no_hit_without_a_free_snapshot_slot():
    kv, tier = state_tier(["k0"])
    a = list(range(100, 109))
    run_prompt(kv, req("a", a))
    run_prompt(kv, req("b", range(200, 229)))
    kv.build_connector_meta()
    hog = req("hog", range(300, 309))  # holds the snapshot slot (a save pending registration)
    computed, hit = kv.get_computed_blocks(hog)
    assert hit == 0 and kv.allocate_slots(hog, 8, computed)  # a chunk ending on a block boundary: a save
    assert kv.managers[1].snapshots.num_free == 0
    assert kv.get_computed_blocks(req("a2", a))[1] == 0


# ---- whole engines
def a_twice(llm):
    first = llm.generate([A], GREEDY)[0]
    for p in others(3):
        llm.generate([p], GREEDY)
    return first, llm.generate([A], GREEDY)[0]


# name -> (tiny checkpoint, engine arguments: a device pool that three other prompts evict A from)
ENGINES = {"mla": ("deepseek_v2", dict(num_kv_blocks=8)),  # MLA latents
           "dsa": ("deepseek_v32", dict(num_kv_blocks=8)),  # latents + indexer keys in one page
           "window": ("gemma3", dict(num_kv_blocks=40)),  # 5 sliding-window groups and 1 full-attention group
           "kimi": ("kimi_linear", dict(num_kv_blocks=8, num_state_snapshots=1))}  # MLA + KDA state snapshots


@pytest.mark.parametrize("name", list(ENGINES))
def test_an_evicted_prefix_comes_back_from_the_host_tier(name, tmp_path, tiny_tokenizer):
    kind, engine_kw = ENGINES[name]
    path = make_checkpoint(kind, tmp_path, tokenizer=tiny_tokenizer)
    kw = dict(progress=False, max_model_len=128, **engine_kw)
    plain = LLM(str(path), **kw)
    first, second = a_twice(plain)
    assert second.num_cached_tokens == 0
    llm = LLM(str(path), kv_offloading_size=0.001, **kw)
    tier = llm.engine.core.kv_offload.connector
    units = {u for u, p in tier.pools.items() if p.num_slots}
    state_groups = {m.group_id for m in llm.engine.core.kv.managers if m.tier_unit != ROWS}
    assert units == {ROWS} | state_groups and bool(state_groups) == (name == "kimi")
    assert tier.num_bytes <= 0.001 * 2**30  # the units' shares stay within the bound
    t1, t2 = a_twice(llm)
    assert t1.num_cached_tokens == 0 and t2.num_cached_tokens == 32  # all of A's full blocks
    assert t1.outputs[0].token_ids == t2.outputs[0].token_ids == first.outputs[0].token_ids
    # A's 2 full blocks; a window of 8 tokens needs only the block before the hit point; Kimi: + the snapshot
    assert tier.loaded_blocks == {"mla": 2, "dsa": 2, "window": 2 + 5 * 1, "kimi": 2 + 1}[name]
    stats = llm.engine.core.get_stats()
    assert stats["host_kv_loaded_bytes"] == tier.loaded_bytes > 0 and stats["host_kv_saved_bytes"] > 0
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
