"""vLLM's sampling extras over the server (issue 36): logit_bias, allowed_token_ids and bad_words equal the offline
engine with the same parameters; chat echo and continue_final_message (an assistant prefill) continue the given
text, compared with a completion of the same rendered prompt."""
from __future__ import annotations

import openai
import pytest

from conftest import http
from kestrel.core.sampling_params import SamplingParams

PROMPT = "The quick brown fox"
GREEDY = dict(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def _offline(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**GREEDY, ignore_eos=True, **kw))[0].outputs[0]


def test_logit_bias_equals_offline(client, offline_llm):
    base = _offline(offline_llm, PROMPT)
    target = base.token_ids[1]
    r = client.completions.create(model="llama", prompt=PROMPT, **GREEDY, logit_bias={str(target): 100},
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ref = _offline(offline_llm, PROMPT, logit_bias={target: 100.0})
    assert ref.token_ids == [target] * 8
    assert r.choices[0].text == ref.text
    # the plain request is unchanged (nothing left over from the biased one)
    plain = client.completions.create(model="llama", prompt=PROMPT, **GREEDY, extra_body={"ignore_eos": True})
    assert plain.choices[0].text == base.text


def test_allowed_token_ids_and_bad_words_equal_offline(client, offline_llm, tiny_tokenizer):
    base = _offline(offline_llm, PROMPT)
    allowed = sorted(set(base.token_ids[2:5])) + [7]
    msgs = [{"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(model="llama", messages=msgs, **GREEDY,
                                       extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    chat_prompt = http("POST", client.base_url.join("/tokenize").__str__(), {"messages": msgs})[1]["tokens"]
    ref = _offline(offline_llm, chat_prompt, allowed_token_ids=allowed)
    assert set(ref.token_ids) <= set(allowed)
    assert r.choices[0].message.content == ref.text

    word = next(w for w in (tiny_tokenizer.decode([t]) for t in base.token_ids)  # a word that is one token here
                if w.strip() and tiny_tokenizer.encode(w.lstrip(), add_special_tokens=False)[0] in base.token_ids)
    r = client.completions.create(model="llama", prompt=PROMPT, **GREEDY,
                                  extra_body={"ignore_eos": True, "bad_words": [word]})
    ref = _offline(offline_llm, PROMPT, bad_words=[word])
    assert r.choices[0].text == ref.text
    assert ref.text != base.text
    banned = offline_llm.engine.input_processor.bad_words_token_ids([word])
    assert not any(len(b) == 1 and b[0] in ref.token_ids for b in banned)


RENDERED = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nThe colour is"


@pytest.mark.parametrize("stream", [False, True])
def test_assistant_prefill_continues_the_final_message(client, offline_llm, tiny_tokenizer, stream):
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    ref = _offline(offline_llm, tiny_tokenizer.encode(RENDERED, add_special_tokens=False))
    for echo in (False, True):
        body = dict(model="llama", messages=msgs, **GREEDY, stream=stream,
                    extra_body={"ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True,
                                "echo": echo})
        if stream:
            chunks = list(client.chat.completions.create(**body))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[0].choices[0].delta.role == "assistant"
        else:
            r = client.chat.completions.create(**body)
            text = r.choices[0].message.content
            assert r.choices[0].message.role == "assistant"
            assert r.usage.prompt_tokens == len(tiny_tokenizer.encode(RENDERED, add_special_tokens=False))
        assert text == ("The colour is" if echo else "") + ref.text
    # /tokenize renders the same prefill
    toks = http("POST", client.base_url.join("/tokenize").__str__(),
                {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True})[1]["tokens"]
    assert toks == tiny_tokenizer.encode(RENDERED, add_special_tokens=False)


def test_echo_after_a_generation_prompt_adds_nothing_for_a_user_turn(client):
    msgs = [{"role": "user", "content": "Hello there"}]
    plain = client.chat.completions.create(model="llama", messages=msgs, **GREEDY)
    echoed = client.chat.completions.create(model="llama", messages=msgs, **GREEDY, extra_body={"echo": True})
    assert echoed.choices[0].message.content == plain.choices[0].message.content  # the user turn is not echoed


def test_beam_search_equals_offline(client, offline_llm, server):
    from kestrel import BeamSearchParams

    ids = [10, 20, 30, 40, 50]
    ref = offline_llm.beam_search([ids], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))[0]
    r = client.completions.create(model="llama", prompt=ids, n=3, max_tokens=5, logprobs=1,
                                  extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.logprobs.tokens.__len__() for c in r.choices] == [5, 5, 5]
    want = [offline_llm.tokenizer.decode(s.tokens[len(ids):], skip_special_tokens=True) for s in ref.sequences]
    assert [c.text for c in r.choices] == want
    assert r.usage.completion_tokens == 15
    chat = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, extra_body={"use_beam_search": True, "ignore_eos": True})
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content
    s, body = http("POST", server.url + "/v1/completions", {"prompt": ids, "n": 2, "use_beam_search": True,
                                                            "stream": True})
    assert s == 400 and body["error"]["param"] == "use_beam_search" and "stream" in body["error"]["message"]
    s, body = http("POST", server.url + "/v1/completions", {"prompt": ids, "n": 11, "use_beam_search": True})
    assert s == 400 and "beam width" in body["error"]["message"]
