"""Acceptance 1: the real openai client against a real server (engine core in its own process)."""
from __future__ import annotations

import re

import openai
import pytest

from conftest import http
from kestrel.core.sampling_params import SamplingParams

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def n_tokens(server, text: str) -> int:
    return http("POST", server.url + "/tokenize", {"prompt": text})[1]["count"]


def test_models_version_health(server, client, model):
    assert model == "llama"
    assert http("GET", server.url + "/version")[1]["version"]
    status, body = server.health()
    assert status == 200 and body["engines"] == [{"index": 0, "state": "ready"}]  # no process ids


def test_completion_matches_offline_greedy(client, model, offline_llm, server):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    ref = offline_llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == n_tokens(server, PROMPT)
    assert r.usage.completion_tokens == len(ref.token_ids) == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_prompt_forms(client, model, server):
    ids = http("POST", server.url + "/tokenize", {"prompt": PROMPT})[1]["tokens"]
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0).choices[0].text
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == base
    multi = client.completions.create(model=model, prompt=[PROMPT, "Hello world"], max_tokens=5, temperature=0)
    assert [c.index for c in multi.choices] == [0, 1] and multi.choices[0].text == base
    multi_ids = client.completions.create(model=model, prompt=[ids, ids], max_tokens=5, temperature=0)
    assert [c.text for c in multi_ids.choices] == [base, base]
    assert multi_ids.usage.prompt_tokens == 2 * len(ids)


def test_completion_streaming_equals_non_streaming(client, model, server):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_n2_and_seed_reproducibility(client, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == sum(8 for _ in a.choices) or a.usage.completion_tokens <= 16
    c = client.completions.create(**{**kw, "seed": 99, "n": 1})
    d = client.completions.create(**{**kw, "seed": 99, "n": 1})
    assert c.choices[0].text == d.choices[0].text


def test_best_of(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, n=1, best_of=3, seed=5)
    assert len(r.choices) == 1 and r.choices[0].logprobs is None
    r2 = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, n=2, best_of=3, seed=5,
                                   logprobs=0)
    sums = [sum(c.logprobs.token_logprobs) for c in r2.choices]
    assert len(sums) == 2 and sums[0] >= sums[1]


def test_completion_logprobs_and_echo(client, model, server):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    # byte-level BPE: a token may hold part of a character, so single tokens can decode to U+FFFD
    assert [lp.text_offset[k + 1] - lp.text_offset[k] for k in range(4)] == [len(t) for t in lp.tokens[:4]]
    for tok, top, val in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs):
        assert 1 <= len(top) <= 4 and top[tok] == pytest.approx(val)  # keys collide when texts do
        assert max(top.values()) <= 0 and val <= max(top.values()) + 1e-6  # greedy: the sampled one is the best
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    e = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, echo=True)
    ch = e.choices[0]
    assert ch.text == PROMPT + r.choices[0].text
    n_prompt = n_tokens(server, PROMPT)
    assert len(ch.logprobs.tokens) == n_prompt + 5
    assert ch.logprobs.token_logprobs[0] is None and all(v is not None for v in ch.logprobs.token_logprobs[1:])
    assert ch.logprobs.text_offset[n_prompt] == len(PROMPT)


def test_stop_strings(client, model):
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) >= 6
    stop = base[3:5]
    cut = base[:base.find(stop)]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16
    s = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                       stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in s) == cut and s[-1].choices[0].finish_reason == "stop"
    inc = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                    extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert inc.choices[0].text == cut + stop


def test_chat_matches_offline(client, model, offline_llm):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Capital of France?"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    ref = offline_llm.chat(msgs, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_logprobs_n_and_max_completion_tokens(client, model):
    msgs = [{"role": "user", "content": "Hello"}]
    r = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens <= 4
    assert all(t.bytes == list(t.token.encode()) for t in content)
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy picks the top one
    r2 = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=1.0, n=2, seed=3)
    assert [c.index for c in r2.choices] == [0, 1]


def test_sampling_extras_accepted(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0.7, top_p=0.9, seed=1,
                                  presence_penalty=0.5, frequency_penalty=0.5,
                                  extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2,
                                              "stop_token_ids": [2], "skip_special_tokens": True,
                                              "some_unknown_field": 1})
    assert r.usage.completion_tokens >= 2


def test_tokenize_detokenize(server):
    s, body = http("POST", server.url + "/tokenize", {"prompt": PROMPT})
    assert s == 200 and body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    s, d = http("POST", server.url + "/detokenize", {"tokens": body["tokens"]})
    assert s == 200 and d["prompt"] == PROMPT
    s, c = http("POST", server.url + "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert s == 200 and c["count"] > 3


def test_metrics_exposed_under_vllm_names(server, client, model):
    """The names vLLM's Grafana dashboards query, each with model_name and engine labels."""
    client.completions.create(model=model, prompt=PROMPT, max_tokens=3)
    s, text = http("GET", server.url + "/metrics")
    assert s == 200
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "kestrel_kv_blocks_free", "kestrel_kv_blocks_total"):
        samples = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
        assert samples, name
        assert all('model_name="llama"' in ln and 'engine="0"' in ln for ln in samples), samples
    gen = float(next(ln for ln in text.splitlines() if ln.startswith("vllm:generation_tokens_total{")).split()[-1])
    assert gen >= 3


def test_frontend_stage_histogram(server, client, model):
    """Each chat request's time before the engine, by stage: the HTTP body and the render thread (wait, run, the
    event loop resuming); every stage counts the new request."""
    def counts() -> dict[str, float]:
        _, text = http("GET", server.url + "/metrics")
        return {m[1]: float(m[2]) for m in re.finditer(
            r'^kestrel_request_frontend_seconds_count\{model_name="llama",stage="(\w+)"\} (\S+)$', text, re.M)}
    before = counts()
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    after = counts()
    for stage in ("receive", "render_wait", "render", "resume"):
        assert after.get(stage, 0) >= before.get(stage, 0) + 1, (stage, before, after)
