"""Faults in the KV tiers (--kv-offloading-size): the host tier full, a copy failing (injected into the worker's
row copies, loads and saves), a request aborted while its blocks load. In each: no leaked blocks (the device pool
and the host pool back to full, nothing pinned), and every request, the others in the same step included, gives
the tokens of an engine without the tier."""
import pytest

from kestrel import LLM, SamplingParams
from kestrel.core.kv_connector import ROWS
from kestrel.engine.kv.pool import hash_block
from kestrel.worker import kv_host_tier
from kestrel.worker.kv_allocation import bytes_per_block

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
A = [(7 * i + 3) % 90 + 5 for i in range(40)]  # 2 full blocks of 16 before the last token
B = [(5 * i + 1) % 90 + 5 for i in range(20)]
OTHERS = [[(11 * i + 13 * j + 1) % 90 + 5 for i in range(60)] for j in range(1, 4)]
KW = dict(progress=False, num_kv_blocks=12, max_model_len=128)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(str(tiny_llama), **KW)
    return {tuple(p): o.outputs[0].token_ids for p, o in zip([A, B, *OTHERS], llm.generate([A, B, *OTHERS], GREEDY))}


def a_hashes():
    hashes, parent = [], None
    for i in range(2):
        parent = hash_block(parent, A[16 * i:16 * (i + 1)])
        hashes.append(parent)
    return hashes


def tokens(out):
    return out.outputs[0].token_ids


def evict_a(llm, reference):
    assert tokens(llm.generate([A], GREEDY)[0]) == reference[tuple(A)]
    for p in OTHERS:
        assert tokens(llm.generate([p], GREEDY)[0]) == reference[tuple(p)]


def assert_nothing_leaked(llm):
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    assert core.kv.num_free_blocks == core.kv.num_blocks
    for pool in core.kv_offload.connector.pools.values():
        assert len(pool) + len(pool.free_slots) == pool.num_slots and not pool.pinned
    assert core.kv_offload.connector.steps_loading == 0


def test_a_full_host_tier_evicts_and_serves_what_it_holds(tiny_llama, reference):
    probe = LLM(str(tiny_llama), kv_offloading_size=0.001, **KW)
    block = bytes_per_block(probe.engine.core.executor.kv_cache_groups)
    llm = LLM(str(tiny_llama), kv_offloading_size=2.5 * block / 2**30, **KW)  # 2 host blocks
    tier = llm.engine.core.kv_offload.connector
    assert tier.pools[ROWS].num_slots == 2
    for _ in range(2):
        evict_a(llm, reference)
        outs = llm.generate([A, B], GREEDY)
        assert [tokens(o) for o in outs] == [reference[tuple(A)], reference[tuple(B)]]
        assert len(tier) == 2 and tier.saved_blocks > 2  # full: older entries evicted
    assert tier.num_bytes <= 2.5 * block
    assert_nothing_leaked(llm)


@pytest.fixture
def failing(monkeypatch):
    """Make the worker's row copies of one kind ("load" or "save") fail, `times` times."""
    state = {"what": None, "times": 0, "failed": 0, "hook": None}
    original = kv_host_tier.copy_rows

    def copy_rows(dst, dst_ids, src, src_ids):
        kind = "load" if dst is state.get("device") else "save"  # a load writes the device's tensors
        if state["hook"] is not None and kind == "load":
            state["hook"]()
        if kind == state["what"] and state["failed"] < state["times"]:
            state["failed"] += 1
            raise RuntimeError("injected copy failure")
        return original(dst, dst_ids, src, src_ids)

    monkeypatch.setattr(kv_host_tier, "copy_rows", copy_rows)
    return state


def arm(state, llm, what, times=1, hook=None):
    state.update(what=what, times=times, failed=0, hook=hook, device=llm.engine.core.executor.runner.kv_connector
                 .units[ROWS])


@pytest.mark.parametrize("pipelined", ["off", "on"])
def test_a_failed_load_is_recomputed_and_harms_no_other_request(tiny_llama, reference, failing, pipelined):
    """Pipelined (step N + 1 launched before step N is read), a step with loads is still read before the next
    is scheduled, so its readers are recomputed before anything builds on them."""
    llm = LLM(str(tiny_llama), kv_offloading_size=0.001, async_scheduling=pipelined, **KW)
    assert llm.engine.core.pipelined == (pipelined == "on")
    evict_a(llm, reference)
    tier = llm.engine.core.kv_offload.connector
    a_keys = [(0, h) for h in a_hashes()]
    assert all(k in tier.pools[ROWS] for k in a_keys)
    arm(failing, llm, "load")
    outs = llm.generate([A, B], GREEDY)  # A hits the host tier; its load fails; B shares the step
    assert failing["failed"] == 1
    assert [tokens(o) for o in outs] == [reference[tuple(A)], reference[tuple(B)]]
    assert outs[0].num_cached_tokens == 0  # recomputed: the failed entries left the host tier
    stats = llm.engine.core.get_stats()
    assert stats["kv_transfer_failures"] == 2 and stats["host_kv_loaded_blocks"] == 2
    assert not any(k in tier.pools[ROWS] for k in a_keys)  # dropped from the tier
    assert_nothing_leaked(llm)
    again = llm.generate([A], GREEDY)[0]  # computed again, registered on the device: a device hit now
    assert again.num_cached_tokens == 32 and tokens(again) == reference[tuple(A)]


def test_a_failed_save_is_dropped_from_the_tier(tiny_llama, reference, failing):
    llm = LLM(str(tiny_llama), kv_offloading_size=0.001, **KW)
    arm(failing, llm, "save", times=100)
    evict_a(llm, reference)
    tier = llm.engine.core.kv_offload.connector
    assert failing["failed"] > 0 and len(tier) == 0  # every save failed: nothing held
    out = llm.generate([A], GREEDY)[0]
    assert out.num_cached_tokens == 0 and tokens(out) == reference[tuple(A)]
    assert llm.engine.core.get_stats()["kv_transfer_failures"] >= 2
    assert_nothing_leaked(llm)


def test_a_request_aborted_while_its_blocks_load(tiny_llama, reference, failing):
    llm = LLM(str(tiny_llama), kv_offloading_size=0.001, **KW)
    evict_a(llm, reference)
    eng = llm.engine
    aborted = []

    def abort_once():
        if not aborted:
            aborted.append(eng.abort_request("a"))

    arm(failing, llm, None, hook=abort_once)
    eng.add_request(A, GREEDY, request_id="a")
    eng.add_request(B, GREEDY, request_id="b")
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    assert aborted  # during the step that loads its blocks
    assert tokens(outs["b"]) == reference[tuple(B)]
    assert "a" not in outs or outs["a"].outputs[0].finish_reason == "abort"
    assert llm.engine.core.kv_offload.connector.loaded_blocks == 2
    assert_nothing_leaked(llm)
    again = llm.generate([A], GREEDY)[0]  # the loaded blocks completed: registered and right
    assert again.num_cached_tokens == 32 and tokens(again) == reference[tuple(A)]


def test_the_failures_cross_the_worker_boundary():
    from kestrel.core.kv_connector import KVTransferFailures
    from kestrel.core.step import RunnerOutput
    from kestrel.executor.messages import encoder, output_decoder
    out = RunnerOutput(kv_failures=KVTransferFailures(loads=[(ROWS, 3), (1, 9)], saves=[(ROWS, 0)], requests=["a"]))
    assert output_decoder.decode(encoder.encode(out)).kv_failures == out.kv_failures
    assert output_decoder.decode(encoder.encode(RunnerOutput())).kv_failures is None


def test_tiers_too_small_for_one_entry_are_refused(tiny_llama, tmp_path):
    from kestrel.errors import ConfigError
    with pytest.raises(ConfigError, match="--kv-offloading-size 1e-09 GiB holds no KV-cache entry"):
        LLM(str(tiny_llama), kv_offloading_size=1e-9, **KW)
    with pytest.raises(ConfigError, match="--kv-offloading-disk-size 1e-09 GiB holds no KV-cache file"):
        LLM(str(tiny_llama), kv_offloading_size=0.001, kv_offloading_disk_path=str(tmp_path),
            kv_offloading_disk_size=1e-9, **KW)
