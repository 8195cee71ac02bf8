"""Speculative decoding end to end on a tiny Llama (CPU, float32): outputs token-identical to the same engine
without speculation (greedy, seeded sampling, penalties, min_tokens, stop strings and ids, logprobs, n) across
chunked prefill, preemption, small batches and the switch between pipelined and speculative steps; the counters;
a perfect drafter; the start-up refusals."""
import math
import random

import pytest

from kestrel import LLM, SamplingParams
from kestrel.errors import ConfigError

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def outputs(llm, prompts, params):
    outs = llm.generate(prompts, params)
    core = llm.engine.core
    assert core.kv.num_free_blocks == core.kv.num_blocks  # no block leaked by rolled-back drafts
    return [[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]


def same(a, b):
    """Equal tokens, texts and finish reasons; logprobs equal up to float32 rounding (a verify step computes
    them in a multi-token forward)."""
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for (ta, xa, fa, la), (tb, xb, fb, lb) in zip(ra, rb, strict=True):
            assert (ta, xa, fa) == (tb, xb, fb)
            assert (la is None) == (lb is None)
            for da, db in zip(la or [], lb or [], strict=True):
                assert da.keys() == db.keys()
                for t in da:
                    assert math.isclose(da[t].logprob, db[t].logprob, abs_tol=1e-4)


def workload(seed=1):
    rng = random.Random(seed)
    prompts = []
    for i in range(12):
        unit = [rng.randrange(3, 380) for _ in range(rng.randint(2, 6))]
        prompts.append((unit * 8)[:rng.randint(4, 50)] + [rng.randrange(3, 380) for _ in range(i % 3)])
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True)
    params[2] = SamplingParams(temperature=1.0, seed=5, max_tokens=25, ignore_eos=True, repetition_penalty=1.3,
                               presence_penalty=0.5)
    params[3] = SamplingParams(temperature=0, max_tokens=30)  # may stop at EOS
    params[4] = SamplingParams(temperature=0, max_tokens=20, logprobs=2, ignore_eos=True)
    params[5] = SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=20, ignore_eos=True)
    params[6] = SamplingParams(temperature=0, max_tokens=30, min_tokens=10, ignore_eos=False)
    params[7] = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    return prompts, params


@pytest.fixture(scope="module")
def plain_llama(tiny_llama):
    return LLM(str(tiny_llama), progress=False)


@pytest.mark.parametrize("opts", [dict(), dict(max_num_batched_tokens=32), dict(num_kv_blocks=12),
                                  dict(max_num_seqs=3)], ids=["plain", "chunked", "preempt", "seqs3"])
def test_same_outputs_as_without_speculation(tiny_llama, plain_llama, opts):
    prompts, params = workload()
    ref = outputs(LLM(str(tiny_llama), progress=False, **opts), prompts, params) if opts else \
        outputs(plain_llama, prompts, params)
    llm = LLM(str(tiny_llama), progress=False, speculative_config=NGRAM, **opts)
    same(outputs(llm, prompts, params), ref)
    sp = llm.engine.core.speculation
    assert sp.num_draft_tokens > 0 and 0 < sp.num_accepted_tokens < sp.num_draft_tokens
    assert sp.accepted_per_pos[0] >= sp.accepted_per_pos[1] >= sp.accepted_per_pos[2] > 0
    if "num_kv_blocks" in opts:
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_switch_between_pipelined_and_speculative_steps(tiny_llama):
    """Above disable_by_batch_size the engine pipelines its steps without drafts; as requests finish it drafts
    again (synchronous steps): the outputs do not change."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 9) for _ in range(rng.randint(3, 20))] for _ in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 4 * i, ignore_eos=True) for i in range(10)]
    params[2] = SamplingParams(temperature=0.9, seed=7, max_tokens=30, ignore_eos=True)
    ref = outputs(LLM(str(tiny_llama), progress=False, async_scheduling="on"), prompts, params)
    llm = LLM(str(tiny_llama), progress=False, async_scheduling="on",
              speculative_config={**NGRAM, "disable_by_batch_size": 4})
    eng, pipelined_steps = llm.engine, 0
    for p, sp in zip(prompts, params):
        eng.add_request(p, sp)
    while eng.has_unfinished_requests():
        eng.step()
        pipelined_steps += eng.core._inflight is not None
    assert pipelined_steps > 3
    same(outputs(llm, prompts, params), ref)
    assert llm.engine.core.speculation.num_accepted_tokens > 0


def test_stop_strings_and_stop_ids_inside_accepted_drafts(tiny_llama, plain_llama):
    prompt = [[7, 8, 9, 7, 8, 9, 7, 8]]
    free = outputs(plain_llama, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0][0]
    toks, text = free[0], free[1]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[text[5:8]]),
              SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[toks[6]], ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]
    llm = LLM(str(tiny_llama), progress=False, speculative_config=NGRAM)
    same(outputs(llm, prompt * 3, params), outputs(plain_llama, prompt * 3, params))
    assert llm.engine.core.speculation.num_accepted_tokens > 0


def test_perfect_drafter_accepts_every_draft(tiny_llama, plain_llama):
    """The replay proposer at alpha 1 proposes the reference output itself: every draft is accepted, so a request
    of n tokens takes ceil(n / (k + 1)) steps."""
    prompts = [[3, 4, 5, 6], [10, 11], [40, 41, 42, 43, 44, 45]]
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    ref = outputs(plain_llama, prompts, params)
    refs = [[p, r[0][0]] for p, r in zip(prompts, ref)]
    k = 4
    llm = LLM(str(tiny_llama), progress=False,
              speculative_config={"method": "replay", "num_speculative_tokens": k, "alpha": 1.0,
                                  "replay_references": refs})
    eng = llm.engine
    for p in prompts:
        eng.add_request(p, params)
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    sp = eng.core.speculation
    assert sp.num_accepted_tokens == sp.num_draft_tokens > 0
    assert steps == 1 + math.ceil((17 - 1) / (k + 1))  # the prefill samples the first token
    same(outputs(llm, prompts, params), ref)


def test_stats_carry_the_counters(tiny_llama):
    llm = LLM(str(tiny_llama), progress=False, speculative_config=NGRAM)
    llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    s = llm.engine.core.stats()
    sp = llm.engine.core.speculation
    assert (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens) == (
        sp.num_drafts, sp.num_draft_tokens, sp.num_accepted_tokens)
    assert s.spec_accepted_per_pos == sp.accepted_per_pos and sum(s.spec_accepted_per_pos) == s.spec_num_accepted_tokens
    assert s.spec_num_drafts > 0


@pytest.mark.parametrize("spec,match", [
    ({"method": "eagle9", "num_speculative_tokens": 2}, "method 'eagle9' is not supported"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, r"unknown keys \['lookahead'\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
])
def test_bad_config_is_refused(tiny_llama, spec, match):
    with pytest.raises(ConfigError, match=match):
        LLM(str(tiny_llama), progress=False, speculative_config=spec)


def test_unsupported_combinations_are_refused_by_name(tiny_llama):
    with pytest.raises(ConfigError, match=r"does not support LoRA \(--enable-lora\)"):
        LLM(str(tiny_llama), progress=False, speculative_config=NGRAM, enable_lora=True)


def test_image_models_are_refused_by_name(tiny_mm_models):
    with pytest.raises(ConfigError, match=r"does not support image inputs \(a multimodal model\)"):
        LLM(str(tiny_mm_models["paligemma"]), progress=False, speculative_config=NGRAM)


def test_recurrent_state_caches_are_refused_by_name():
    """A cache kind with per-request state cannot roll back past rejected drafts."""
    from dataclasses import dataclass

    import torch

    from kestrel.core.kv_spec import FullAttentionSpec, KVCacheGroup, KVCacheSpec
    from kestrel.spec_decode.config import model_refusals

    @dataclass(frozen=True)
    class ToyStateSpec(KVCacheSpec):
        def state_parts(self):
            return [(torch.float32, (4, 4))]

    groups = [KVCacheGroup(0, FullAttentionSpec(torch.float32, num_kv_heads=1, head_dim=8), ["a"]),
              KVCacheGroup(1, ToyStateSpec(torch.float32), ["b"])]
    assert model_refusals(torch.nn.Linear(1, 1), groups) == ["recurrent-state caches (ToyStateSpec)"]
    assert model_refusals(torch.nn.Linear(1, 1), groups[:1]) == []


@pytest.mark.parametrize("kind", ["gemma3", "qwen3", "deepseek_v3"])
def test_other_cache_kinds_same_outputs(tiny_models, kind):
    """Sliding-window groups (gemma3: window 8, shorter than the outputs) free blocks behind the window while
    drafts roll back; MLA (deepseek_v3) verifies through its latent cache."""
    path = str(tiny_models[kind])
    prompts, params = workload(seed=7)
    ref = outputs(LLM(path, progress=False, num_kv_blocks=40), prompts, params)
    llm = LLM(path, progress=False, num_kv_blocks=40, speculative_config=NGRAM)
    same(outputs(llm, prompts, params), ref)
    assert llm.engine.core.speculation.num_accepted_tokens > 0


def test_structured_output_rows_decode_beside_drafted_rows(tiny_llama, plain_llama):
    """A request with structured outputs gets no drafts; its grammar bitmask still masks its own logits row while
    other rows of the step verify drafts (their rows follow the per-request ones)."""
    from kestrel.core.sampling_params import StructuredOutputsParams as SO

    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 9, 10, 9], [5, 6, 7, 5, 6, 7, 5], [30, 31, 30, 31]]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=4, max_tokens=12, structured_outputs=SO(regex="(fox|dog)+")),
              SamplingParams(temperature=0.9, seed=8, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(choice=["stop", "end", "fox"]))]
    llm = LLM(str(tiny_llama), progress=False, speculative_config=NGRAM)
    got = outputs(llm, prompts, params)
    same(got, outputs(plain_llama, prompts, params))
    assert got[3][0][1] in ("stop", "end", "fox")
    assert llm.engine.core.speculation.num_accepted_tokens > 0


def test_worker_process_executor_carries_drafts_and_results(tiny_llama, plain_llama):
    """--distributed-executor-backend mp: the drafts and the emitted tokens cross the wire (msgpack)."""
    prompts, params = workload(seed=5)
    llm = LLM(str(tiny_llama), progress=False, distributed_executor_backend="mp", speculative_config=NGRAM)
    try:
        same(outputs(llm, prompts, params), outputs(plain_llama, prompts, params))
        assert llm.engine.core.speculation.num_accepted_tokens > 0
    finally:
        llm.engine.core.shutdown()


def test_verify_graph_padding_gives_the_eager_outputs(tiny_llama, plain_llama):
    """The verify-graph path (kestrel/spec_decode/verify_graphs.py) without a captured graph on the CPU: uniform
    verify steps run the padded batch (dummy requests up to the next size) and give plain decoding's tokens;
    with n-gram drafts the draft count varies by step (a graph per count)."""
    from kestrel.spec_decode.verify_graphs import VerifyGraphs, VerifyGraphSet, verify_graphs_supported

    prompts = [[3, 4, 5, 6], [10, 11], [40, 41, 42, 43, 44, 45]]
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    ref = outputs(plain_llama, prompts, params)
    replay = {"method": "replay", "num_speculative_tokens": 3, "alpha": 0.6,
              "replay_references": [[p, r[0][0]] for p, r in zip(prompts, ref)]}
    for spec, batch in [(replay, prompts), (NGRAM, prompts[2:]), (NGRAM, [[7, 8, 9, 7, 8, 9, 7, 8]] * 2)]:
        llm = LLM(str(tiny_llama), progress=False, speculative_config=spec)
        runner = llm.engine.core.executor.runner
        assert verify_graphs_supported(runner)
        runner.graph_sets = [vg := VerifyGraphSet({d: VerifyGraphs(runner, [1, 4, 8], d) for d in (1, 2, 3)})]
        same(outputs(llm, batch, params), outputs(plain_llama, batch, params))
        assert vg.replays > 1
