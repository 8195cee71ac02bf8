"""Fair share between request groups (engine/scheduler.py): while another group has work, a group runs at most
`contended_seqs_per_request` sequences a step; its excess pauses (keeping its KV) and is preempted only where a
newcomer needs the slot or the blocks. Nothing is lost: every sequence finishes with the tokens it gets without
the rule."""
import pytest

from kestrel import LLM, SamplingParams
from kestrel.config import SchedulerConfig
from kestrel.engine.kv import KVCacheManager
from kestrel.engine.request import Request, RequestStatus
from kestrel.engine.scheduler import Scheduler
from tests.engine.test_scheduler import fake_token

CAP = 8


def make(max_seqs=80, num_blocks=512, cap=CAP, policy="fcfs", budget=512):
    cfg = SchedulerConfig(budget, max_seqs, True, policy, contended_seqs_per_request=cap)
    return Scheduler(cfg, KVCacheManager(num_blocks, 4), max_model_len=1024)


def seq(rid, group, n_prompt=6, max_tokens=12, t=0.0):
    return Request(rid, [(len(rid) * 7 + i) % 50 + 1 for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens),
                   eos_token_id=None, max_tokens=max_tokens, arrival_time=t, group_id=group)


def big_group(n=64, max_tokens=12, prompt_len=lambda i: 6):
    return [seq(f"big#{i}", "big", prompt_len(i), max_tokens) for i in range(n)]


def step(s, log):
    out = s.schedule()
    log.append(out)
    s.update_from_output(out, {x.request.request_id: fake_token(x.request) for x in out.scheduled if x.samples})
    return out


def run(s, log, limit=500):
    for _ in range(limit):
        if not s.has_unfinished():
            return
        step(s, log)
    raise AssertionError("did not finish")


def tokens(reqs):
    return {r.request_id: list(r.output_token_ids) for r in reqs}


def reference(reqs_factory):
    """The same sequences, each group run on its own, without the rule."""
    s, log = make(cap=-1), []
    reqs = reqs_factory()
    for r in reqs:
        s.add_request(r)
    run(s, log)
    return tokens(reqs)


def rows(out, group):
    return [x for x in out.scheduled if x.request.group == group]


def test_a_group_alone_is_never_capped():
    s, log = make(), []
    for r in big_group():
        s.add_request(r)
    run(s, log)
    assert s.num_preemptions == 0
    assert all(len(out.scheduled) == 64 for out in log)  # one prefill step, then 11 full decode steps
    assert len(log) == 12


def test_a_newcomer_trims_the_group_to_its_share_and_nothing_is_lost():
    big = big_group()
    s, log = make(), []
    for r in big:
        s.add_request(r)
    step(s, log)
    step(s, log)  # prefilled and one decode: all 64 running
    assert s.num_running == 64
    newcomer = seq("small", "small", 5, max_tokens=6)
    s.add_request(newcomer)
    run(s, log)
    with_newcomer = [out for out in log if any(x.request is newcomer for x in out.scheduled)]
    assert len(with_newcomer) == 6  # its prefill, then 5 decodes
    for out in with_newcomer:  # the newcomer's steps run beside the big group's share, not the whole group
        assert len(rows(out, "big")) == CAP and len(out.scheduled) == CAP + 1
    assert s.num_preemptions == 0  # slots and blocks were free: the excess paused, keeping its KV
    after = log[log.index(with_newcomer[-1]) + 1]
    assert len(after.scheduled) == 64  # alone again: the whole group runs
    assert all(r.status == RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 12 for r in big)
    assert tokens(big) == reference(big_group)


def test_a_full_engine_preempts_the_least_computed_sequence_for_the_newcomer():
    # longer prompts first: the last sequences have computed the least
    big = big_group(prompt_len=lambda i: 12 - i // 8)
    s, log = make(max_seqs=64), []
    for r in big:
        s.add_request(r)
    step(s, log)
    step(s, log)
    assert s.num_running == 64
    newcomer = seq("small", "small", 5, max_tokens=6)
    s.add_request(newcomer)
    out = step(s, log)
    assert [r.request_id for r in out.preempted] == ["big#63"]  # one slot needed: the least computed (56-63), newest
    assert newcomer in [x.request for x in out.scheduled] and len(rows(out, "big")) == CAP
    assert out.step.finished_ids == ["big#63"]  # the runner drops it; it comes back as a new request
    run(s, log)
    assert s.num_preemptions == 1
    assert tokens(big) == reference(lambda: big_group(prompt_len=lambda i: 12 - i // 8))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_waiting_sequences_of_a_capped_group_are_passed_over(policy):
    """The big group's sequences that wait (its share is taken) do not hold back a newcomer queued behind them."""
    s, log = make(max_seqs=96, policy=policy, budget=64), []
    big = big_group(n=200, max_tokens=4)
    for r in big:
        s.add_request(r)
    step(s, log)
    assert s.num_running == 11 and s.num_waiting == 189  # the budget admitted 10 of 6 tokens and a chunk of 4
    newcomer = seq("small", "small", 5, max_tokens=3, t=1.0)
    s.add_request(newcomer)
    out = step(s, log)
    assert newcomer in [x.request for x in out.scheduled]
    assert len(rows(out, "big")) == CAP  # 11 running > 8: three paused, and no waiting one admitted
    assert s.num_running == 12 and not out.preempted
    run(s, log)
    assert tokens(big) == reference(lambda: big_group(n=200, max_tokens=4))


def test_cap_off():
    s, log = make(cap=-1), []
    for r in big_group():
        s.add_request(r)
    step(s, log)
    s.add_request(seq("small", "small", 5, max_tokens=6))
    out = step(s, log)
    assert len(out.scheduled) == 65


def test_default_cap_is_the_servers_contended_window():
    assert SchedulerConfig().contended_running_cap() == 32  # a quarter of half of 256
    assert SchedulerConfig(max_num_seqs=64, max_seqs_per_request=40).contended_running_cap() == 10
    assert SchedulerConfig(contended_seqs_per_request=-1).contended_running_cap() is None
    with pytest.raises(ValueError, match="contended_seqs_per_request must be -1"):
        make(cap=-2)


# ---- the engine: a tiny float32 model, greedy; the rule must not change a token
def _generate(path, newcomer: bool, **kw):
    llm = LLM(str(path), progress=False, contended_seqs_per_request=CAP, **kw)
    eng = llm.engine
    sched = eng.core.scheduler
    log = []
    schedule = sched.schedule
    sched.schedule = lambda *a: log.append(schedule(*a)) or log[-1]
    group = eng.new_group_id()
    big = [eng.add_request([7 + p, 20 + p, 3 * p + 1], SamplingParams(n=16, temperature=0, max_tokens=24,
                                                                      ignore_eos=True), group_id=group)
           for p in range(4)]
    outs = {}
    for _ in range(3):
        for o in eng.step():
            outs[o.request_id] = o
    small = eng.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) \
        if newcomer else None
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    core = eng.core
    assert core._inflight is None and core.kv.num_free_blocks == core.kv.num_blocks
    result = {rid: [c.token_ids for c in outs[rid].outputs] for rid in big}
    return result, (outs[small].outputs[0].token_ids if small else None), log, small


@pytest.mark.parametrize("opts", [dict(async_scheduling="off"), dict(async_scheduling="on"),
                                  dict(async_scheduling="off", max_num_seqs=64),
                                  dict(async_scheduling="on", max_num_seqs=64)])
def test_engine_tokens_unchanged_and_newcomer_runs_in_a_small_batch(tiny_llama, opts):
    alone, _, _, _ = _generate(tiny_llama, False, **opts)
    shared, small_tokens, log, small = _generate(tiny_llama, True, **opts)
    assert shared == alone
    assert len(small_tokens) == 8
    reference = LLM(str(tiny_llama), progress=False).generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    assert small_tokens == reference
    steps = [out for out in log if any(x.request.request_id == small for x in out.scheduled)]
    assert len(steps) == 8  # its prefill and 7 decodes (the 8th token comes from the last one)
    assert all(len(out.scheduled) <= CAP + 1 for out in steps)
    if opts.get("max_num_seqs") == 64:
        assert sum(len(out.preempted) for out in log) == 1  # the one slot the newcomer needed
    else:
        assert not any(out.preempted for out in log)


def test_paused_sequences_give_way_first_when_blocks_run_out():
    """Without the rule the newcomer, latest to arrive, would be the one preempted (FCFS evicts the newest)."""
    def group():
        return big_group(n=16, max_tokens=24, prompt_len=lambda i: 3)

    big = group()
    s, log = make(max_seqs=32, num_blocks=40, cap=4), []
    for r in big:
        s.add_request(r)
    step(s, log)
    newcomer = seq("small", "small", 3, max_tokens=24, t=1.0)
    s.add_request(newcomer)
    run(s, log)
    assert s.num_preemptions > 0 and newcomer.num_preemptions == 0
    assert len(newcomer.output_token_ids) == 24
    assert tokens(big) == reference(group)
