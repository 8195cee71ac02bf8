"""A request's greedy output does not depend on its batch, chunking, prefix-cache hits or preemption."""
import random

import pytest

from kestrel import LLM, SamplingParams

TARGET = list(range(3, 3 + 45))  # 45-token prompt: spans several blocks and chunks
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(str(tiny_llama), progress=False, enable_prefix_caching=False)
    return llm.generate([TARGET], GREEDY)[0].outputs[0].token_ids


def test_in_a_mixed_batch_of_16(tiny_llama, reference):
    rng = random.Random(0)
    others = [[rng.randrange(3, 380) for _ in range(rng.randint(1, 70))] for _ in range(15)]
    llm = LLM(str(tiny_llama), progress=False)
    outs = llm.generate(others[:7] + [TARGET] + others[7:], GREEDY)
    assert outs[7].outputs[0].token_ids == reference


def test_with_chunked_prefill_at_budget_32(tiny_llama, reference):
    llm = LLM(str(tiny_llama), progress=False, max_num_batched_tokens=32)
    chunks = []
    orig = llm.engine.core.scheduler.schedule

    def spy():
        out = orig()
        chunks.extend(s.num_new_tokens for s in out.scheduled if s.request.num_prompt_tokens == len(TARGET)
                      and s.num_computed_tokens < len(TARGET))
        return out

    llm.engine.core.scheduler.schedule = spy
    assert llm.generate([TARGET], GREEDY)[0].outputs[0].token_ids == reference
    assert chunks[:2] == [32, 13]  # the prompt really was split


def test_with_prefix_cache_hit(tiny_llama, reference):
    llm = LLM(str(tiny_llama), progress=False)
    llm.generate([TARGET[:40] + [7, 7, 7]], GREEDY)  # warms the cache with the first 32 tokens (2 blocks)
    out = llm.generate([TARGET], GREEDY)[0]
    assert out.num_cached_tokens == 32
    assert out.outputs[0].token_ids == reference


def test_after_preemption(tiny_llama, reference):
    # 12 blocks of 16 tokens: four long requests cannot all fit, so the scheduler must preempt
    # the target has the lowest priority, so it is the one preempted
    llm = LLM(str(tiny_llama), progress=False, num_kv_blocks=12, enable_prefix_caching=False,
              scheduling_policy="priority")
    sched = llm.engine.core.scheduler
    preempted = []
    orig = sched._preempt
    sched._preempt = lambda r, out: (preempted.append(r.prompt_token_ids == TARGET), orig(r, out))
    prompts = [TARGET] + [[5 + i] * 40 for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    outs = llm.generate(prompts, params, priority=[10, 0, 0, 0])
    assert any(preempted), "the target request was never preempted"
    alone = LLM(str(tiny_llama), progress=False, enable_prefix_caching=False).generate([TARGET], params)[0]
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert alone.outputs[0].token_ids[:24] == reference
    assert llm.engine.core.kv.num_free_blocks == 12  # nothing leaked
