import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.frontend.detokenizer import IncrementalDetokenizer
from kestrel.errors import InvalidRequest
from kestrel.worker.sampler import Sampler, SamplingRow

PROMPT = [10, 20, 30, 40, 50]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), progress=False)


def row(**kw):
    return SamplingRow(SamplingParams(**kw), [1, 2], [], [])


def test_seeded_sampling_is_reproducible_across_batches(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate([PROMPT], sp)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=9, max_tokens=10, ignore_eos=True)]
    batch = llm.generate([[3, 4], PROMPT, list(range(50, 90))], [others[0], sp, others[1]])
    assert batch[1].outputs[0].token_ids == alone
    different = llm.generate([PROMPT], sp.clone(seed=4321))[0].outputs[0].token_ids
    assert different != alone


def _sample_many(logits_row, n=4000, **kw):
    sampler = Sampler(seed=0)
    logits = logits_row.repeat(n, 1)
    return torch.tensor(sampler(logits, [row(**kw) for _ in range(n)]).token_ids)


LOGITS = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0])


def test_top_k_stays_in_set():
    s = _sample_many(LOGITS, top_k=3)
    assert set(s.tolist()) == {0, 1, 2}


def test_top_p_stays_in_nucleus():
    probs = LOGITS.softmax(-1)  # 0.43, 0.26, 0.16, 0.06, ...
    s = _sample_many(LOGITS, top_p=0.8)
    assert set(s.tolist()) == {0, 1, 2}
    freq0 = (s == 0).float().mean().item()
    expected = (probs[0] / probs[:3].sum()).item()
    assert abs(freq0 - expected) < 0.03


def test_min_p_stays_above_threshold():
    s = _sample_many(LOGITS, min_p=0.3)  # keeps p >= 0.3 * p_max: tokens 0, 1, 2
    assert set(s.tolist()) == {0, 1, 2}


def test_greedy_and_temperature_zero():
    s = _sample_many(LOGITS, n=10, temperature=0)
    assert set(s.tolist()) == {0}


def test_penalties_change_distribution():
    sampler = Sampler()
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    r = SamplingRow(SamplingParams(temperature=0, frequency_penalty=1.0), [], [0, 0], [])
    assert sampler(logits.clone(), [r]).token_ids == [1]
    r = SamplingRow(SamplingParams(temperature=0, repetition_penalty=2.0), [0], [], [])
    assert sampler(logits.clone(), [r]).token_ids == [1]


def test_stop_string_split_across_tokens(llm, tiny_tokenizer):
    text = "Hello world! How are you today?"
    ids = tiny_tokenizer.encode(text)
    pieces = [tiny_tokenizer.decode([i]) for i in ids]
    assert len(ids) > 3
    stop = pieces[1][-1:] + pieces[2][:2]  # spans the boundary of tokens 1 and 2
    d = IncrementalDetokenizer(tiny_tokenizer, [], [stop], include_stop=False)
    found = None
    for t in ids:
        found = d.add_token(t)
        if found:
            break
    assert found == stop
    assert d.text == text[: text.index(stop)]
    d2 = IncrementalDetokenizer(tiny_tokenizer, [], [stop], include_stop=True)
    for t in ids:
        if d2.add_token(t):
            break
    assert d2.text == text[: text.index(stop) + len(stop)]


def test_stop_string_end_to_end(llm):
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    stopped = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert stopped.outputs[0].text == text[: text.index(stop)]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
    assert not llm.engine.core.scheduler.requests  # the frontend's stop reached the core (as an abort)


def test_stop_token_ids_min_tokens_and_length(llm):
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    t = free.token_ids[4]
    first = free.token_ids.index(t)
    o = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[t]))[0].outputs[0]
    assert o.token_ids == free.token_ids[: first + 1] and o.finish_reason == "stop" and o.stop_reason == t
    o = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, min_tokens=10, stop_token_ids=[t],
                                              ignore_eos=True))[0].outputs[0]
    assert len(o.token_ids) >= 10 and t not in o.token_ids[:9]
    o = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0].outputs[0]
    assert len(o.token_ids) == 7 and o.finish_reason == "length"


def test_n_logprobs_and_prompt_logprobs(llm):
    out = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, logprobs=2,
                                                prompt_logprobs=1, ignore_eos=True))[0]
    assert len(out.outputs) == 3 and [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == 8
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert tok in entry and len(entry) <= 3
            assert all(v.logprob <= 0 for v in entry.values())
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for tok, entry in zip(PROMPT[1:], out.prompt_logprobs[1:]):
        assert tok in entry


def test_prompt_logprobs_match_greedy_logprobs(llm):
    """Prompt logprobs (teacher forcing, chunked) equal the logprobs the same tokens got while generating."""
    gen = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True))[0]
    full = PROMPT + gen.outputs[0].token_ids
    small = LLM(llm.config.model.model, progress=False, max_num_batched_tokens=4)
    pl = small.generate([full], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    for i, tok in enumerate(gen.outputs[0].token_ids):
        assert abs(pl[len(PROMPT) + i][tok].logprob - gen.outputs[0].logprobs[i][tok].logprob) < 1e-4


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -3), ("min_p", 2.0), ("n", 0),
    ("max_tokens", 0), ("max_tokens", -4), ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("logprobs", 50), ("prompt_logprobs", -1), ("min_tokens", -1),
    ("stop", ["s"] * 17), ("stop_token_ids", [10**9]),
])
def test_invalid_parameters_name_the_field(llm, field, value):
    with pytest.raises(InvalidRequest) as e:
        llm.generate([PROMPT], SamplingParams(**{field: value}))
    assert e.value.param == field and field in str(e.value)


def test_prompt_too_long_and_max_tokens_too_large(llm):
    with pytest.raises(InvalidRequest) as e:
        llm.generate([[5] * 600], SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequest) as e:
        llm.generate([PROMPT], SamplingParams(max_tokens=10_000))
    assert e.value.param == "max_tokens"
    assert not llm.engine.has_unfinished_requests()


def test_offline_chat_continues_the_final_message(llm, tiny_tokenizer):
    """LLM.chat's assistant prefill (the server's continue_final_message) equals a completion of the rendered text."""
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = llm.chat(msgs, sp, add_generation_prompt=False, continue_final_message=True)[0]
    rendered = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nThe colour is"
    ref = llm.generate([tiny_tokenizer.encode(rendered, add_special_tokens=False)], sp)[0]
    assert got.prompt_token_ids == ref.prompt_token_ids and got.outputs[0].token_ids == ref.outputs[0].token_ids
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(msgs, sp, continue_final_message=True)
