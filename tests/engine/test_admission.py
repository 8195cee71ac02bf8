"""One admission rule: the scheduler admits a prompt iff it is at most `max_prompt_tokens`, the number the engine
announces in its hand-shake and the frontends compare against. Randomised over full-attention, sliding-window,
MLA and mixed (Gemma 3) models without a model; then a tiny Gemma 3 offline with a KV pool too small for a
long prompt."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from kestrel.config import SchedulerConfig
from kestrel.core.kv_spec import FullAttentionSpec, MLASpec, SlidingWindowSpec, group_layers
from kestrel.core.sampling_params import SamplingParams
from kestrel.engine.kv import KVCacheManager
from kestrel.engine.request import Request, RequestStatus
from kestrel.engine.scheduler import Scheduler
from kestrel.errors import InvalidRequest

MAX_MODEL_LEN = 400


def model_specs(kind: str, bs: int, window: int) -> dict:
    full = FullAttentionSpec(torch.float32, 2, 8, block_size=bs)
    sliding = SlidingWindowSpec(torch.float32, 2, 8, sliding_window=window, block_size=bs)
    if kind == "full":
        return {f"l{i}": full for i in range(2)}
    if kind == "sliding":
        return {f"l{i}": sliding for i in range(2)}
    if kind == "mla":
        return {f"l{i}": MLASpec(torch.float32, 16, 8, block_size=bs) for i in range(2)}
    return {f"l{i}": (full if i == 5 else sliding) for i in range(6)}  # Gemma 3's pattern: 6 groups


def scheduler(kind, bs, window, num_blocks, budget, chunked, caching=True):
    kv = KVCacheManager(num_blocks, enable_prefix_caching=caching, groups=group_layers(model_specs(kind, bs, window)))
    return Scheduler(SchedulerConfig(budget, 4, chunked), kv, MAX_MODEL_LEN)


def request(rid: str, n: int) -> Request:
    return Request(rid, [(7 * i + len(rid)) % 97 for i in range(n)], SamplingParams(max_tokens=2), eos_token_id=None,
                   max_tokens=2)


def run_alone(s: Scheduler, r: Request, steps: int = 1000) -> list[str]:
    """Steps until `r` finishes (two tokens, the one after the prompt and one decode, or one where the prompt
    leaves room for one); never preempted."""
    s.add_request(r)
    tokens = []
    for _ in range(steps):
        out = s.schedule()
        assert not out.preempted, "a lone request within the limit was preempted"
        assert r in [x.request for x in out.scheduled], "a lone request within the limit was not scheduled"
        sampled = {x.request.request_id: 5 for x in out.scheduled if x.samples}
        tokens += list(sampled)
        if s.update_from_output(out, sampled):
            return tokens
    raise AssertionError("the request did not finish")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["full", "sliding", "mla", "gemma3"]), bs=st.sampled_from([1, 2, 4, 8, 16]),
       window=st.integers(1, 40), num_blocks=st.integers(2, 60), budget=st.integers(1, 64), chunked=st.booleans(),
       caching=st.booleans())
def test_announced_limit_is_what_the_scheduler_admits(kind, bs, window, num_blocks, budget, chunked, caching):
    limit = scheduler(kind, bs, window, num_blocks, budget, chunked).max_prompt_tokens
    assert 0 <= limit < MAX_MODEL_LEN
    if limit > 0:  # the limit is admitted and runs, alone in the pool, to its tokens
        s = scheduler(kind, bs, window, num_blocks, budget, chunked, caching)
        r = request("at-limit", limit)
        assert run_alone(s, r) == ["at-limit"] * min(2, MAX_MODEL_LEN - limit)
        assert r.status == RequestStatus.FINISHED_LENGTH and r.num_preemptions == 0
        assert s.kv.num_free_blocks == s.kv.num_blocks  # everything it held came back
    if limit + 1 < MAX_MODEL_LEN:  # one token more is refused, and the scheduler serves the next request
        s = scheduler(kind, bs, window, num_blocks, budget, chunked, caching)
        with pytest.raises(ValueError, match=f"at most {limit} tokens"):
            s.add_request(request("over", limit + 1))
        assert not s.has_unfinished()
        if limit > 0:
            assert run_alone(s, request("next", 1)) == ["next", "next"]
    if limit + 1 < MAX_MODEL_LEN and kind in ("full", "mla"):
        # where blocks_needed is exact (every block is kept), the limit is tight: forced past the check, a prompt
        # one token longer does not run alone (sliding windows' bound is safe but not tight: blocks freed during
        # the request may make room for a longer one)
        s = scheduler(kind, bs, window, num_blocks, budget, chunked, caching)
        s.max_prompt_tokens = MAX_MODEL_LEN
        with pytest.raises(AssertionError, match="was preempted|was not scheduled|did not finish"):
            run_alone(s, request("forced", limit + 1))


def test_limit_counts_every_group():
    """Gemma 3's 6 groups of one layer, 20 blocks of 16: 6 x 3 blocks fit, so prompts of 47 tokens (48 with the
    token after them); a single-group count would have said 19 x 16 - 1."""
    s = scheduler("gemma3", 16, 8, 20, 2048, True)
    assert s.max_prompt_tokens == 47
    s = scheduler("gemma3", 16, 8, 20, 16, True)  # chunks of 16: a window group holds at most 3 blocks at once
    assert s.kv.blocks_needed(300, 16) == 19 + 5 * 3
    assert scheduler("full", 16, 8, 20, 64, False).max_prompt_tokens == 64  # unchunked: one step's budget


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tiny_tokenizer):
    from tests.tiny import make_checkpoint

    return make_checkpoint("gemma3", tmp_path_factory.mktemp("admission"), tokenizer=tiny_tokenizer)


def test_gemma3_offline_too_long_prompt_is_a_clear_error_and_the_engine_serves_on(gemma3):
    from kestrel import LLM

    llm = LLM(str(gemma3), progress=False, num_kv_blocks=20, max_model_len=512)
    limit = llm.engine.core.scheduler.max_prompt_tokens
    assert limit == 47  # 6 groups x 3 blocks of 16 tokens <= 20 blocks (see test_limit_counts_every_group)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with pytest.raises(InvalidRequest, match="the KV cache admits prompts of at most 47 tokens"):
        llm.generate([[5] * 10, [5] * (limit + 1)], params)
    assert not llm.engine.has_unfinished_requests()  # the prompt before the bad one was withdrawn
    outs = llm.generate([[5] * limit, [6] * 10], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]


@pytest.mark.parametrize("drafts", [False, True])
def test_a_generation_that_outgrows_the_pool_finishes_length_and_the_next_one_runs(drafts):
    """Issue 55 (a request may not freeze the engine): a short prompt is admitted, but its generation outgrows
    the 20-block pool (max_model_len is larger). Before, alone in the pool it preempted itself, could not be
    resumed and stayed at the head of the queue: every later request waited behind it for good. Now it finishes
    "length" where the pool ends (scheduler.cut) and the next request is scheduled. With drafts (speculation), a
    step's drafts that do not fit are dropped before anything else."""
    s = scheduler("gemma3", 16, 8, 20, 2048, True)
    r = Request("long", [3] * 5, SamplingParams(max_tokens=MAX_MODEL_LEN), eos_token_id=None,
                max_tokens=MAX_MODEL_LEN)
    s.add_request(r)
    cut = []
    for _ in range(MAX_MODEL_LEN):
        proposed = {"long": [4, 4, 4]} if drafts and r.num_computed_tokens == r.num_tokens - 1 else None
        out = s.schedule(proposed)
        assert not out.preempted
        cut += out.cut
        if r.is_finished:
            break
        assert [x.request for x in out.scheduled] == [r]
        s.update_from_output(out, {"long": 5}, {"long": [4] * len(out.scheduled[0].proposed_token_ids)})
    assert cut == [r] and r.status == RequestStatus.FINISHED_LENGTH
    assert s.max_prompt_tokens + 1 < r.num_tokens < MAX_MODEL_LEN  # past the admission limit, short of the length
    assert s.kv.num_free_blocks == s.kv.num_blocks and not s.has_unfinished()
    assert run_alone(s, request("next", 3)) == ["next", "next"]
