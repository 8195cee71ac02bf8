"""Preemption by offload (--kv-offloading-size with --kv-offloading-preempt-min-tokens): a preempted request's
computed full blocks, decode-generated ones included, go to the host tier at once and are held there until it
resumes, which loads them instead of computing them again; below the threshold the host saves none of them and the
request is recomputed. The decision is the KV offload add-on's (kestrel/engine/addons/kv_offload.py)."""
from types import SimpleNamespace

import pytest

from kestrel import LLM, SamplingParams
from kestrel.config import EngineConfig
from kestrel.core.kv_connector import ROWS
from kestrel.core.sampling_params import SamplingParams as SP
from kestrel.engine.addons.kv_offload import KVOffload
from kestrel.engine.kv import KVCacheManager
from kestrel.engine.kv.host_tier import HostTierConnector
from kestrel.engine.request import Request


# ---- the coordinator, the host tier's connector and the add-on's decision (pure Python)
def offload(num_blocks=8, host_slots=8, min_tokens=8):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4)
    tier = HostTierConnector.single(host_slots * 64, 64)
    kv.set_connector(tier)
    config = EngineConfig()
    config.cache.kv_offloading_preempt_min_tokens = min_tokens
    addon = KVOffload(tier, SimpleNamespace(config=config, kv=kv, scheduler=SimpleNamespace(requests={})))
    return kv, tier, addon


def decoded(kv, rid, prompt, outputs):
    """A running request whose prompt and `outputs` (decode-generated tokens) are computed."""
    r = Request(rid, list(prompt), SP(max_tokens=20), max_tokens=20)
    computed, hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - hit, computed)
    r.num_computed_tokens = r.num_tokens
    for t in outputs:
        r.output_token_ids.append(t)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    kv.cache_full_blocks(r)
    return r


def fill(kv, rid, n):
    """Another request taking `n` blocks (evicting the oldest free ones), then finishing."""
    r = Request(rid, [1000 + 7 * i + len(rid) for i in range(4 * n)], SP(max_tokens=1), max_tokens=1)
    computed, hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - hit, computed)
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)
    kv.free(r)


def test_a_preempted_request_offloads_its_decoded_blocks_and_holds_them_until_it_runs():
    kv, tier, addon = offload()
    r = decoded(kv, "r", range(100, 109), [7, 8, 9, 10])  # 9 + 3 computed (the 4th is the next input): 3 blocks
    r.output_token_ids.append(11)  # sampled, not yet computed
    ids = list(kv.block_ids(r)[0][:3])
    kv.preempt(r)
    meta = kv.build_connector_meta()
    assert sorted(b for _, b, _ in meta.saves) == sorted(ids)  # the third block holds decode-generated tokens
    assert addon.preempt_offloads == 1 and "r" in addon.preempted_ids
    keys = tier.holds["r"]
    assert len(keys) == 3 and all(tier.pools[ROWS].held[k] == 1 for k in keys)
    # the device reallocates everything, twice over: the host keeps r's blocks, evicting only other entries
    fill(kv, "x", 8)
    kv.build_connector_meta()
    fill(kv, "yy", 8)
    kv.build_connector_meta()
    assert all(k in tier.pools[ROWS] for k in keys)
    # resumed: the prefix lookup takes the 3 blocks from the host (loaded) rather than computing them
    r.num_computed_tokens, r.num_preemptions = 0, 1
    computed, hit = kv.get_computed_blocks(r)
    assert hit == 12
    assert kv.allocate_slots(r, r.num_tokens - hit, computed)
    assert sorted(b for _, b, _ in kv.build_connector_meta().loads) == sorted(kv.block_ids(r)[0][:3])
    assert kv.preempted_queries == 14 and kv.preempted_hits == 12
    addon.after_collect(SimpleNamespace(scheduled=[SimpleNamespace(request=r)], step=SimpleNamespace(
        kv_connector_meta=None)), SimpleNamespace(kv_failures=None), None)
    assert not addon.preempted_ids and not tier.holds and not tier.pools[ROWS].held


def test_below_the_threshold_the_host_saves_none_of_its_blocks():
    kv, tier, addon = offload(min_tokens=100)
    r = decoded(kv, "r", range(100, 109), [7, 8, 9, 10])
    kv.preempt(r)
    assert kv.build_connector_meta() is None and addon.preempt_recomputes == 1
    fill(kv, "x", 8)  # every block reallocated: r's are not saved, the others are not evicted yet
    assert kv.build_connector_meta() is None and len(tier) == 0
    r.num_computed_tokens = 0
    assert kv.get_computed_blocks(r)[1] == 0  # recomputed
    # once it ran, its blocks are saved on eviction like any others
    addon.connector.release("r")
    r2 = decoded(kv, "r2", range(100, 109), [7, 8, 9, 10])
    keys = [b.block_hash for b in kv.managers[0].req_blocks["r2"][:3]]
    kv.free(r2)
    kv.build_connector_meta()  # a step: the saves of r2's allocation are made (their slots unpinned)
    fill(kv, "yy", 8)
    kv.build_connector_meta()
    assert all(k in tier.pools[ROWS] for k in keys)


def test_the_host_holds_at_most_half_its_slots_for_preempted_requests():
    kv, tier, addon = offload(num_blocks=12, host_slots=5)  # half: 2 entries
    r = decoded(kv, "r", range(100, 109), [7, 8, 9, 10])  # 3 full blocks: more than 2
    kv.preempt(r)
    assert addon.preempt_recomputes == 1 and not tier.pools[ROWS].held
    s = decoded(kv, "s", range(200, 208), [])  # 2 full blocks, 8 tokens: held
    kv.preempt(s)
    assert addon.preempt_offloads == 1 and len(tier.pools[ROWS].held) == 2
    # a request preempted again before it ran holds anew (its old holds released first)
    kv.preempt(decoded(kv, "s", range(200, 208), []))
    assert tier.pools[ROWS].held and all(n == 1 for n in tier.pools[ROWS].held.values())
    tier.reset()
    assert not tier.pools[ROWS].held and not tier.holds


# ---- the engine: forced preemption on the CPU (tiny Llama, a pool of 12 blocks of 16 tokens)
TARGET = list(range(3, 3 + 45))
PROMPTS = [TARGET] + [[5 + i] * 40 for i in range(3)]
PARAMS = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


def run(path, **kw):
    llm = LLM(str(path), progress=False, num_kv_blocks=12, scheduling_policy="priority", **kw)
    sched = llm.engine.core.scheduler
    preempted, orig = [], sched._preempt
    sched._preempt = lambda r, out: (preempted.append(r.num_prompt_tokens), orig(r, out))
    outs = llm.generate(PROMPTS, PARAMS, priority=[10, 0, 0, 0])
    core = llm.engine.core
    assert core.kv.num_free_blocks == 12 and preempted  # nothing leaked; the pool really was short
    return [o.outputs[0].token_ids for o in outs], core.get_stats(), core, preempted


@pytest.fixture(scope="module")
def without_preemption(tiny_llama):
    outs = LLM(str(tiny_llama), progress=False).generate(PROMPTS, PARAMS, priority=[10, 0, 0, 0])
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def without_tier(tiny_llama, without_preemption):
    toks, stats, _, _ = run(tiny_llama)
    assert toks == without_preemption
    return stats


@pytest.mark.parametrize("pipelined", [False, True])
def test_preempted_requests_resume_from_the_host_tier(tiny_llama, without_preemption, without_tier, pipelined):
    toks, stats, core, preempted = run(tiny_llama, kv_offloading_size=0.001, kv_offloading_preempt_min_tokens=16,
                                       async_scheduling="on" if pipelined else "off")
    assert toks == without_preemption  # greedy tokens as without any preemption
    assert stats["num_preemptions"] == without_tier["num_preemptions"] == stats["host_kv_preempt_offloads"]
    assert stats["preempted_prefix_queries"] == without_tier["preempted_prefix_queries"]
    recomputed = stats["preempted_prefix_queries"] - stats["preempted_prefix_hits"]
    recomputed_before = without_tier["preempted_prefix_queries"] - without_tier["preempted_prefix_hits"]
    assert recomputed < recomputed_before / 10
    assert stats["host_kv_loaded_blocks"] > 0
    # decode-generated blocks came back too, not only the prompts' full blocks
    assert stats["preempted_prefix_hits"] > sum(n // 16 * 16 for n in preempted)
    tier = core.kv_offload.connector
    assert not tier.holds and not tier.pools[ROWS].held and not tier.skips and not core.kv_offload.preempted_ids


def test_below_the_threshold_preempted_requests_are_recomputed(tiny_llama, without_preemption, without_tier):
    toks, stats, core, _ = run(tiny_llama, kv_offloading_size=0.001)  # default threshold: 256 tokens
    assert toks == without_preemption
    assert stats["host_kv_preempt_recomputes"] == stats["num_preemptions"] and not stats["host_kv_preempt_offloads"]
    assert stats["preempted_prefix_hits"] == without_tier["preempted_prefix_hits"]
    assert not core.kv_offload.connector.skips


# ---- the worker's copies: a device block a save still reads is not written before the save's event (CPU: fakes)
class FakeEvent:
    def __init__(self):
        self.finished = self.synced = False

    def query(self):
        return self.finished

    def synchronize(self):
        self.synced = self.finished = True


class FakeCopies:
    """A CopyStream whose events finish only when told: the bookkeeping of asynchronous copies, on the CPU."""

    def __init__(self):
        self.events, self.waited = [], []

    def context(self):
        import contextlib
        return contextlib.nullcontext()

    def record(self):
        self.events.append(FakeEvent())
        return self.events[-1]

    def wait(self, event):
        if event is not None:
            self.waited.append(event)


def step_writing(*block_ids):
    from kestrel.core.step import ScheduledChunk, StepInput
    return StepInput(chunks=[ScheduledChunk("r", 1, 0, True, [list(block_ids)])])


def test_a_block_being_saved_is_not_written_before_its_copy_is_done():
    import torch

    from kestrel.core.kv_connector import KVConnectorMeta
    from kestrel.worker.kv_host_tier import HostTierWorker
    caches = [torch.arange(24, dtype=torch.uint8).reshape(4, 6)]
    w = HostTierWorker({ROWS: caches}, {ROWS: 4})
    assert w.copies.stream is None  # the CPU: synchronous copies, no events
    w.start_load_kv(KVConnectorMeta(saves=[(ROWS, 1, 0)]), step_writing())
    assert not w.pending and torch.equal(w.host[ROWS][0][0], caches[0][1])
    w.copies = fake = FakeCopies()
    # block 1 saved (a preempted request's, held): its copy is in flight while steps run
    w.start_load_kv(KVConnectorMeta(saves=[(ROWS, 1, 2), (ROWS, 2, 3)]), step_writing(3))
    save = fake.events[0]
    assert fake.waited == [] and len(w.pending) == 1  # the step writes block 3: nothing in flight reads it
    w.start_load_kv(None, step_writing(0))
    assert fake.waited == [] and w.pending.busy(ROWS, 1)
    # block 1 reallocated to a request this step: its forward waits for the save first, and only for it
    w.start_load_kv(None, step_writing(1))
    assert fake.waited == [save] and not w.pending
    # loads: the forward waits for them (it reads them); a finished save is forgotten without a wait
    w.start_load_kv(KVConnectorMeta(saves=[(ROWS, 2, 1)], loads=[(ROWS, 3, 0)]), step_writing())
    save, load = fake.events[1:3]
    assert fake.waited[1:] == [load] and w.pending.busy(ROWS, 2)
    save.finished = True
    w.start_load_kv(None, step_writing(2))
    assert fake.waited[1:] == [load] and not w.pending
    # an unknown step (None) waits for every save in flight; wait_for_save syncs them on the host
    w.start_load_kv(KVConnectorMeta(saves=[(ROWS, 0, 3)]), None)
    assert fake.waited[-1] is fake.events[-1] and not w.pending
    w.start_load_kv(KVConnectorMeta(saves=[(ROWS, 0, 3)]), step_writing())
    w.wait_for_save()
    assert fake.events[-1].synced and not w.pending


def test_row_copies_run_by_run_between_devices():
    import torch

    from kestrel.worker.kv_host_tier import _runs, copy_rows, copy_runs
    assert list(_runs([4, 5, 6, 9, 10], [0, 1, 3, 4, 5])) == [(0, 2), (2, 3), (3, 5)]
    src = [torch.arange(40, dtype=torch.uint8).reshape(8, 5), torch.arange(16, dtype=torch.uint8).reshape(8, 2)]
    for copy in (copy_rows, copy_runs):  # the CPU's indexed copy, and the device's copies by runs
        dst = [torch.zeros_like(t) for t in src]
        copy(dst, torch.tensor([4, 5, 6, 1]), src, torch.tensor([0, 1, 3, 7]))
        assert all(torch.equal(d[a], s[b]) for d, s in zip(dst, src) for a, b in [(4, 0), (5, 1), (6, 3), (1, 7)])
