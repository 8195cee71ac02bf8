"""gpt-oss's harmony output through /v1/responses with the real openai client, whole and streamed: the analysis
channel comes back as a reasoning item, final as the message, commentary to=functions.NAME as function_call items
(--reasoning-parser openai_gptoss, --tool-call-parser openai). As in test_parsers_server.py, an EBNF grammar
(vLLM's structured_outputs extension) makes the tiny random model write one hand-written harmony output. The
server's chat template shows reasoning_effort and each assistant turn's thinking in the prompt, so that the
prompt's token count tells whether they reached it."""
from __future__ import annotations

import json

import openai
import pytest
from pydantic import ValidationError

from conftest import Server
from kestrel.errors import InvalidRequest
from kestrel.server.response_items import input_messages
from kestrel.server.responses import ResponsesRequest, _chat_request
from tests.server.test_parsers_server import _grammar, model  # noqa: F401 (the tiny model fixture)

TEMPLATE = ("{% if reasoning_effort %}Reasoning: {{ reasoning_effort }}\n{% endif %}{% for m in messages %}"
            "<|im_start|>{{ m['role'] }}\n{% if m.get('thinking') %}{{ m['thinking'] }}\n{% endif %}"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}},
         {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {
             "tz": {"type": "string"}}}}]
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>')
# (model output, [(item type, its text or (name, arguments))])
CASES = [
    (CALL, [("reasoning", "Need the weather."), ("function_call", ("get_weather", {"city": "Paris", "days": 2}))]),
    ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.",
     [("reasoning", "Easy."), ("message", "It is sunny.")]),
    ("<|channel|>final<|message|>It is sunny.", [("message", "It is sunny.")]),
    ("<|channel|>analysis<|message|>Two.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking both."
     '<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '
     '"Paris", "days": 2}<|call|><|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json'
     '<|message|>{"tz": "CET"}<|call|>',  # a preamble (commentary without a recipient) is the message's text
     [("reasoning", "Two."), ("message", "Checking both."), ("function_call", ("get_weather", {"city": "Paris",
                                                                                             "days": 2})),
      ("function_call", ("get_time", {"tz": "CET"}))]),
]


@pytest.fixture(scope="module")
def client(model, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("harmony_server")
    (d / "template.jinja").write_text(TEMPLATE)
    server = Server(model, d / "server.log", ["--enable-auto-tool-choice", "--tool-call-parser", "openai",
                                              "--reasoning-parser", "openai_gptoss", "--max-model-len", "2048",
                                              "--num-kv-blocks", "200", "--chat-template",
                                              str(d / "template.jinja")]).wait_ready()
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()
    server.stop()


def _ask(client, text: str, extra: dict | None = None, **kw):
    return client.responses.create(model="parsers-tiny", input="Weather in Paris?", tools=TOOLS, temperature=0,
                                   max_output_tokens=600, extra_body={**_grammar(text), **(extra or {})}, **kw)


def _items(output) -> list[tuple]:
    out = []
    for item in output:
        if item.type == "reasoning":
            assert item.summary == [] and item.status == "completed"
            out.append(("reasoning", "".join(c.text for c in item.content)))
        elif item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        else:
            assert item.type == "function_call" and item.call_id and item.status == "completed"
            out.append(("function_call", (item.name, json.loads(item.arguments))))
    return out


@pytest.mark.parametrize("text, items", CASES, ids=["call", "reasoning+final", "final", "preamble+calls"])
def test_harmony_output_items(client, text, items):
    r = _ask(client, text)
    assert r.status == "completed" and _items(r.output) == items, r.output
    assert r.output_text == "".join(t for kind, t in items if kind == "message")
    assert [i.type for i in _ask(client, text, {"include_reasoning": False}).output] \
        == [kind for kind, _ in items if kind != "reasoning"]


@pytest.mark.parametrize("text, items", CASES, ids=["call", "reasoning+final", "final", "preamble+calls"])
def test_harmony_output_items_streamed(client, text, items):
    events = list(_ask(client, text, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1]
    assert final.type == "response.completed" and _items(final.response.output) == items
    for index, item in enumerate(final.response.output):  # each item: added, its deltas, done
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        assert mine[0].type == "response.output_item.added" and mine[-1].type == "response.output_item.done"
        assert mine[-1].item.id == mine[0].item.id == item.id
        if item.type == "function_call":
            continue
        kind = "reasoning_text" if item.type == "reasoning" else "output_text"
        assert [e.type for e in mine[:2]] == ["response.output_item.added", "response.content_part.added"]
        assert [e.type for e in mine[-3:]] == [f"response.{kind}.done", "response.content_part.done",
                                               "response.output_item.done"]
        deltas = [e.delta for e in mine if e.type == f"response.{kind}.delta"]
        assert deltas and "".join(deltas) == mine[-3].text == item.content[0].text


def test_reasoning_items_round_trip(client):
    """The output items sent back as input (reasoning, function_call) with the tool's result: the reasoning is the
    calling turn's thinking in the next prompt; reasoning.effort reaches the template as reasoning_effort."""
    first = _ask(client, CALL)
    reasoning, call = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}
    answer = "<|channel|>final<|message|>It is 21 C."
    history = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True), result]
    without = client.responses.create(model="parsers-tiny", input=history, tools=TOOLS, temperature=0,
                                      max_output_tokens=100, extra_body=_grammar(answer))
    history.insert(1, reasoning.model_dump(exclude_none=True))
    with_it = client.responses.create(model="parsers-tiny", input=history, tools=TOOLS, temperature=0,
                                      max_output_tokens=100, extra_body=_grammar(answer))
    assert with_it.output_text == without.output_text == "It is 21 C."
    assert with_it.usage.input_tokens > without.usage.input_tokens
    # the stored response (whole or streamed; its reasoning item left out or not) is that same history
    streamed = list(_ask(client, CALL, {"include_reasoning": False}, stream=True))[-1].response
    for stored in (first, streamed):
        cont = client.responses.create(model="parsers-tiny", previous_response_id=stored.id, tools=TOOLS,
                                       temperature=0, max_output_tokens=100, extra_body=_grammar(answer),
                                       input=[{**result, "call_id": stored.output[-1].call_id}])
        assert cont.usage.input_tokens == with_it.usage.input_tokens
    effort = client.responses.create(model="parsers-tiny", input=history, tools=TOOLS, temperature=0,
                                     max_output_tokens=100, extra_body=_grammar(answer), reasoning={"effort": "high"})
    assert effort.usage.input_tokens > with_it.usage.input_tokens
    with pytest.raises(openai.BadRequestError, match="summary"):
        client.responses.create(model="parsers-tiny", input="Hi", reasoning={"effort": "low", "summary": "detailed"})


def test_reasoning_input_items_become_the_turns_reasoning():
    items = [{"type": "message", "role": "user", "content": "Hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                             "text": "Greet."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]}]
    assert input_messages(items)[1] == {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet."}
    with pytest.raises(InvalidRequest, match="must be followed"):
        input_messages(items[:2])
    with pytest.raises(InvalidRequest, match="encrypted"):
        input_messages([items[0], {**items[1], "encrypted_content": "xyz"}, items[2]])


def test_reasoning_effort_is_the_templates():
    req = ResponsesRequest.model_validate({"input": "Hi", "reasoning": {"effort": "low", "summary": "auto"},
                                           "chat_template_kwargs": {"x": 1}})
    assert _chat_request(req, input_messages(req.input)).chat_template_kwargs == {"x": 1, "reasoning_effort": "low"}
    with pytest.raises(ValidationError, match="effort"):
        ResponsesRequest.model_validate({"input": "Hi", "reasoning": {"effort": "max"}})


def test_chat_reasoning_effort_reaches_the_template(client):
    """Chat completions' reasoning_effort (OpenAI's parameter) is the template's reasoning_effort too."""
    kw = dict(model="parsers-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1, temperature=0)
    plain = client.chat.completions.create(**kw)
    high = client.chat.completions.create(reasoning_effort="high", **kw)
    assert high.usage.prompt_tokens > plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        client.chat.completions.create(reasoning_effort="extreme", **kw)
