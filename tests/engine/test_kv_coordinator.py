"""The coordinator drives cache kinds it does not know: a test-only state-slot kind (a fixed-size state per
request from a slot pool of its own, as a recurrent-state layer keeps) registered with one table line, beside
full attention, through the coordinator and the scheduler."""
from dataclasses import dataclass

import pytest
import torch

from kestrel.config import SchedulerConfig
from kestrel.core.kv_spec import FullAttentionSpec, KVCacheGroup, KVCacheSpec
from kestrel.core.sampling_params import SamplingParams
from kestrel.engine.kv import MANAGERS, KVCacheManager, KVManager, manager_class
from kestrel.engine.kv.managers import FullAttentionManager
from kestrel.engine.request import Request, RequestStatus
from kestrel.engine.scheduler import Scheduler


@dataclass(frozen=True)
class StateSpec(KVCacheSpec):
    """No per-block data: one state of `state_dim` floats per request."""
    state_dim: int = 4
    num_slots: int = 2

    def page_parts(self):
        return []


class StateSlotManager(KVManager):
    """One slot per request from its own pool; no prefix hits (no state snapshots)."""
    uniform_table = False

    def __init__(self, group_id, spec, pool):
        super().__init__(group_id, spec, pool)
        self.free_slots = list(range(spec.num_slots))

    def blocks_needed(self, num_tokens, max_chunk):
        return 0

    def max_hit(self, hashes, limit):
        return 0

    def hit_blocks(self, hashes, n):
        return []

    def num_new_blocks(self, rid, total_tokens, hits):
        return 0

    def can_add(self, rid):
        return rid in self.req_block_ids or bool(self.free_slots)

    def add(self, rid, hits, new):
        assert not hits and not new
        if rid not in self.req_block_ids:
            self.req_block_ids[rid] = [self.free_slots.pop()]

    def free(self, rid):
        slots = self.req_block_ids.pop(rid, None)
        if slots:
            self.free_slots.extend(slots)


@pytest.fixture
def state_kind(monkeypatch):
    monkeypatch.setitem(MANAGERS, StateSpec, StateSlotManager)  # the one table line


BS = 4
FULL = FullAttentionSpec(torch.float32, 1, 8, block_size=BS)


def hybrid(num_blocks, num_slots=2):
    groups = [KVCacheGroup(0, FULL, ["attn"]), KVCacheGroup(1, StateSpec(torch.float32, num_slots=num_slots,
                                                                         block_size=BS), ["state"])]
    return KVCacheManager(num_blocks, groups=groups)


def req(rid, n, max_tokens=3):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), eos_token_id=None,
                   max_tokens=max_tokens)


def test_table_lookup_follows_the_mro(state_kind):
    @dataclass(frozen=True)
    class WiderState(StateSpec):
        pass

    assert manager_class(WiderState(torch.float32)) is StateSlotManager
    assert manager_class(FULL) is FullAttentionManager
    with pytest.raises(NotImplementedError, match="no KV manager for KVCacheSpec"):
        manager_class(KVCacheSpec(torch.float32))


def test_state_slots_beside_blocks(state_kind):
    kv = hybrid(num_blocks=10)
    a, b, c = req("a", 5), req("b", 3), req("c", 2)
    assert kv.allocate_slots(a, 5) and kv.allocate_slots(b, 3)
    assert kv.block_ids(a)[0] == [0, 1] and kv.block_ids(b)[0] == [2]  # blocks for attention
    assert len(kv.block_ids(a)[1]) == 1 and kv.block_ids(a)[1] != kv.block_ids(b)[1]  # a slot each
    assert kv.num_free_blocks == 7  # the slots took nothing from the block pool
    assert not kv.allocate_slots(c, 2)  # blocks to spare, but no free slot: nothing changes
    assert kv.num_free_blocks == 7 and kv.block_ids(c) == [[], []]
    a.num_computed_tokens = 5
    assert kv.allocate_slots(a, 4)  # the slot stays; the blocks grow
    assert len(kv.block_ids(a)[0]) == 3 and len(kv.block_ids(a)[1]) == 1
    kv.free(a)
    assert kv.allocate_slots(c, 2) and kv.num_free_blocks == 8
    # admission counts only pool blocks: 10 blocks of 4 tokens, less the token after the prompt
    assert kv.blocks_needed(9, 4) == 3 and kv.max_prompt_tokens(4, 100) == 39


def test_scheduler_runs_a_kind_it_does_not_know(state_kind):
    """Three requests, two state slots: the third waits for a slot, then every request finishes."""
    kv = hybrid(num_blocks=30)
    s = Scheduler(SchedulerConfig(16, 8, True), kv, max_model_len=64)
    reqs = [req(f"r{i}", 6) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"]  # r2 has no slot yet
    assert [len(ids) for ids in out.step.new_requests[0].block_ids] == [2, 1]  # the slot is its table entry
    for _ in range(20):
        s.update_from_output(out, {x.request.request_id: 7 for x in out.scheduled if x.samples})
        if not s.has_unfinished():
            break
        out = s.schedule()
    assert all(r.status == RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 3 for r in reqs)
    assert kv.num_free_blocks == kv.num_blocks and sorted(kv.managers[1].free_slots) == [0, 1]
