"""Pipelined decode (step N+1 scheduled and launched before step N's tokens are read) gives exactly the
tokens of synchronous stepping, across batching, chunked prefill, preemption, stop strings and aborts."""
import random

import pytest

from kestrel import LLM, SamplingParams


def run(path, pipelined, prompts, params, **kw):
    llm = LLM(str(path), progress=False, async_scheduling="on" if pipelined else "off", **kw)
    outs = llm.generate(prompts, params)
    core = llm.engine.core
    assert core._inflight is None and core.kv.num_free_blocks == core.kv.num_blocks
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs], core


@pytest.mark.parametrize("opts", [dict(), dict(max_num_batched_tokens=32), dict(num_kv_blocks=12),
                                  dict(max_num_seqs=3)])
def test_same_tokens_as_synchronous(tiny_llama, opts):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(1, 60))] for _ in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True) for _ in prompts]
    params[3] = SamplingParams(temperature=0.9, seed=11, max_tokens=25, ignore_eos=True)
    params[4] = SamplingParams(temperature=0, max_tokens=30)  # may stop at EOS
    sync, _ = run(tiny_llama, False, prompts, params, **opts)
    piped, core = run(tiny_llama, True, prompts, params, **opts)
    assert piped == sync
    if "num_kv_blocks" in opts:
        assert core.scheduler.num_preemptions > 0


def test_stop_strings_and_token_ids(tiny_llama):
    free, _ = run(tiny_llama, False, [[10, 20, 30]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    text, toks = free[0][1], free[0][0]
    p = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[text[4:7]]),
         SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[toks[5]])]
    assert run(tiny_llama, True, [[10, 20, 30]] * 2, p)[0] == run(tiny_llama, False, [[10, 20, 30]] * 2, p)[0]


def test_abort_while_in_flight(tiny_llama):
    llm = LLM(str(tiny_llama), progress=False, async_scheduling="on")
    eng = llm.engine
    ids = [eng.add_request([5, 6, 7, i], SamplingParams(max_tokens=50, ignore_eos=True)) for i in range(4)]
    for _ in range(3):
        eng.step()
    assert eng.core._inflight is not None
    eng.abort_request(ids[1])
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.core.kv.num_free_blocks == eng.core.kv.num_blocks


def test_logprobs_fall_back_to_synchronous(tiny_llama):
    llm = LLM(str(tiny_llama), progress=False, async_scheduling="on")
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, logprobs=2))[0]
    assert len(out.outputs[0].logprobs) == 5
