"""Scheduler without a model: a fake runner 'samples' deterministic tokens."""
import random

from hypothesis import given, settings, strategies as st

from kestrel.config import SchedulerConfig
from kestrel.engine.kv import KVCacheManager
from kestrel.engine.request import Request, RequestStatus
from kestrel.core.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, policy="fcfs", chunked=True):
    from kestrel.engine.scheduler import Scheduler

    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(budget, max_seqs, chunked, policy), kv, max_model_len=1024)


def req(rid, n_prompt, max_tokens=4, priority=0, t=0.0, base=0):
    return Request(rid, [base + i % 50 for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens),
                   eos_token_id=None, max_tokens=max_tokens, priority=priority, arrival_time=t)


def fake_token(r):  # deterministic in the request's history, like greedy decoding
    return (sum(r.all_token_ids) * 31 + r.num_tokens) % 1000


def step(s):
    out = s.schedule()
    assert out.num_batched_tokens <= s.config.max_num_batched_tokens
    assert len(s.running) <= s.config.max_num_seqs
    sampled = {x.request.request_id: fake_token(x.request) for x in out.scheduled if x.samples}
    s.update_from_output(out, sampled)
    return out


def run_all(s, limit=1000):
    for _ in range(limit):
        if not s.has_unfinished():
            return
        step(s)
    raise AssertionError("did not finish")


def test_chunked_prefill_respects_budget():
    s = make(budget=16)
    r = req("a", 40)
    s.add_request(r)
    chunks = []
    while r.num_computed_tokens < 40:
        out = step(s)
        chunks.append(out.scheduled[0].num_new_tokens)
    assert chunks == [16, 16, 8]
    assert len(r.output_token_ids) == 1  # sampled only at the last chunk


def test_decodes_first_then_prefills():
    s = make(budget=10)
    a = req("a", 4, max_tokens=10)
    s.add_request(a)
    step(s)
    s.add_request(req("b", 30))
    out = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["a", "b"]
    assert out.scheduled[0].num_new_tokens == 1 and out.scheduled[1].num_new_tokens == 9


def test_step_rows_are_decode_first_once():
    """The scheduler orders the runner's rows (one-token chunks first, then the rest); the runner and the TP
    executor read that order as is (executor/multiproc.sampling_order), never re-sorting it."""
    from kestrel.executor.multiproc import sampling_order

    s = make(budget=10)
    s.add_request(req("d", 3, max_tokens=10))
    step(s)
    s.add_request(req("p", 14, max_tokens=10))
    step(s)  # d decodes, p prefills 9 of 14
    s.add_request(req("w", 1, max_tokens=10))
    out = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["d", "p", "w"]
    assert [(c.request_id, c.num_new_tokens) for c in out.step.chunks] == [("d", 1), ("w", 1), ("p", 5)]
    assert sampling_order(out.step) == ["d", "w", "p"]


def test_a_request_that_finishes_at_once_fills_the_prefix_cache():
    """max_tokens=1 (and any request's last step): the blocks its final step computed are registered before its
    blocks are freed, so the same prompt hits the cache next time (issue 36: they never did)."""
    s = make(block_size=4)
    first = req("a", 13, max_tokens=1)
    s.add_request(first)
    run_all(s)
    assert first.status == RequestStatus.FINISHED_LENGTH
    again = req("b", 13, max_tokens=1)
    hits, num_hit_tokens = s.kv.get_computed_blocks(again)
    assert num_hit_tokens == 12  # the 3 full blocks of the 13-token prompt


def test_max_num_seqs():
    s = make(max_seqs=2)
    for i in range(5):
        s.add_request(req(f"r{i}", 3))
    out = step(s)
    assert len(out.scheduled) == 2


def test_preemption_recompute_gives_same_tokens():
    def outputs(num_blocks):
        s = make(num_blocks=num_blocks, block_size=4, budget=64, max_seqs=8)
        reqs = [req(f"r{i}", 6 + i, max_tokens=12, t=i, base=i) for i in range(4)]
        for r in reqs:
            s.add_request(r)
        run_all(s)
        return [r.output_token_ids for r in reqs], s.num_preemptions

    ample, p0 = outputs(64)
    tight, p1 = outputs(10)
    assert p0 == 0 and p1 > 0
    assert tight == ample


def test_priority_policy_orders_and_preempts_lowest():
    s = make(policy="priority", max_seqs=1)
    s.add_request(req("low", 3, priority=5, t=0))
    s.add_request(req("high", 3, priority=1, t=1))
    out = step(s)
    assert out.scheduled[0].request.request_id == "high"


def test_abort_frees_blocks():
    s = make()
    for i in range(3):
        s.add_request(req(f"r{i}", 10, max_tokens=50))
    step(s)
    s.abort_requests(["r0", "r1", "r2"])
    assert s.kv.num_free_blocks == s.kv.num_blocks and not s.has_unfinished()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000))
def test_random_arrivals_aborts_lengths(seed):
    rng = random.Random(seed)
    s = make(num_blocks=rng.randint(12, 40), block_size=4, budget=rng.choice([8, 16, 64]),
             max_seqs=rng.randint(1, 6), policy=rng.choice(["fcfs", "priority"]))
    n = 0
    for t in range(60):
        if rng.random() < 0.3:
            s.add_request(req(f"r{n}", rng.randint(1, 30), rng.randint(1, 10), rng.randint(0, 3), t))
            n += 1
        if rng.random() < 0.1 and s.requests:
            s.abort_requests([rng.choice(list(s.requests))])
        step(s)
        used = sum(len(b) for b in s.kv.req_blocks.values())
        assert used == sum(1 for b in s.kv.pool.blocks if b.ref_cnt > 0) or s.kv.enable_prefix_caching
        assert s.kv.num_free_blocks == s.kv.num_blocks - sum(1 for b in s.kv.pool.blocks if b.ref_cnt > 0)
    run_all(s, 5000)
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert not s.running and len(s.waiting) == 0


def test_step_deltas_rebuild_the_block_ids():
    """A runner that keeps only the step deltas (new requests in full, then appended block ids) holds every
    scheduled request's block ids, through chunked prefill, decodes across block boundaries and preemptions; a
    chunk whose request gained no block carries no ids."""
    s = make(num_blocks=14, block_size=4, budget=8, max_seqs=4)
    for i in range(6):
        s.add_request(req(f"r{i}", 5 + 3 * i, max_tokens=12, t=i))
    held: dict[str, list[int]] = {}
    seen = {"with_ids": 0, "without": 0}
    for _ in range(500):
        if not s.has_unfinished():
            break
        out = step(s)
        for rid in out.step.finished_ids:
            held.pop(rid, None)
        for r in out.step.new_requests:
            held[r.request_id] = list(r.block_ids[0])
        for c in out.step.chunks:
            if c.new_block_ids is not None:
                assert c.new_block_ids[0], "a delta without new ids"
                held[c.request_id] += c.new_block_ids[0]
                seen["with_ids"] += 1
            elif c.request_id not in {r.request_id for r in out.step.new_requests}:
                seen["without"] += 1
        for x in out.scheduled:
            if x.request.status == RequestStatus.RUNNING:
                assert held[x.request.request_id] == s.kv.block_ids(x.request)[0]
    assert not s.has_unfinished()
    assert s.num_preemptions > 0 and seen["with_ids"] > 0 and seen["without"] > 0
