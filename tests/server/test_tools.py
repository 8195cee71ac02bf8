"""Tool calling, structured outputs and reasoning content through a real server and the real openai client.

The server's tiny random-weight model has a Hermes-style chat template (tools go into the system turn; calls are
<tool_call>{...}</tool_call>). A random model does not call tools by itself, so the "auto" tests give it an
EBNF grammar that only admits Hermes calls: the parser then reads what the model really generated."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from conftest import Server, http
from kestrel.bench.tiny_tokenizer import make_tokenizer
from tests.tiny import make_checkpoint

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou can call these functions:\n<tools>\n"
    "{%- for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    'Answer with <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{%- if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
                                     "unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL_GRAMMAR = (  # what a Hermes model emits when it calls get_weather (content words before it)
    'root ::= [a-z ]{0,8} "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" '
    '[A-Za-z]{1,8} "\\", \\"unit\\": \\"celsius\\", \\"days\\": " [1-7] "}}\\n</tool_call>"')


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    tok = make_tokenizer()
    tok.chat_template = HERMES_TEMPLATE
    model = make_checkpoint("llama", tmp_path_factory.mktemp("hermes_model"), tokenizer=tok, name="hermes-tiny",
                            max_position_embeddings=2048)
    s = Server(model, tmp_path_factory.mktemp("logs") / "tools.log",
               ["--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--reasoning-parser", "qwen3",
                "--max-model-len", "2048", "--num-kv-blocks", "400"]).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(tool_server):
    c = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def _chat(client, **kw):
    return client.chat.completions.create(model="hermes-tiny", messages=MESSAGES, **kw)


def _streamed_calls(stream):
    calls, finish = {}, None
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name and d.function.arguments == ""
                    calls[d.index] = [d.function.name, ""]
                else:
                    calls[d.index][1] += d.function.arguments
            finish = ch.finish_reason or finish
    return [calls[k] for k in sorted(calls)], finish


def test_named_tool_choice_returns_a_valid_call(client):
    r = _chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
              max_tokens=120, temperature=1.0, seed=1, n=2)
    for ch in r.choices:
        (call,) = ch.message.tool_calls
        assert call.function.name == "get_weather" and call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
        assert ch.finish_reason == "stop" and not ch.message.content
    calls, finish = _streamed_calls(_chat(client, tools=TOOLS, stream=True, max_tokens=120, temperature=1.0, seed=2,
                                          tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert [c[0] for c in calls] == ["get_time"] and finish == "stop"
    jsonschema.validate(json.loads(calls[0][1]), SCHEMAS["get_time"])


def test_required_tool_choice(client):
    r = _chat(client, tools=TOOLS, tool_choice="required", max_tokens=250, temperature=1.0, seed=3,
              parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    assert len(ch.message.tool_calls) == 1  # parallel_tool_calls=False: one call
    for call in ch.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_parses_hermes_calls_whole_and_streamed(client):
    extra = {"structured_outputs": {"grammar": HERMES_CALL_GRAMMAR}}
    r = _chat(client, tools=TOOLS, tool_choice="auto", max_tokens=250, temperature=1.0, seed=4, extra_body=extra)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch.message
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    calls, finish = _streamed_calls(_chat(client, tools=TOOLS, max_tokens=250, temperature=1.0, seed=4,
                                          extra_body=extra, stream=True))
    assert finish == "tool_calls" and calls == [["get_weather", call.function.arguments]]


def test_the_template_receives_the_tools(client):
    with_tools = _chat(client, tools=TOOLS, tool_choice="none", max_tokens=1).usage.prompt_tokens
    without = _chat(client, max_tokens=1).usage.prompt_tokens
    assert with_tools > without + 50


def test_response_format_and_structured_outputs(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "score"], "additionalProperties": False}
    r = _chat(client, max_tokens=120, temperature=1.0, seed=5, n=3, response_format={
        "type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}})
    for ch in r.choices:
        jsonschema.validate(json.loads(ch.message.content), schema)
    stream = _chat(client, max_tokens=120, temperature=1.0, seed=6, stream=True,
                   response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": schema}})
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)), schema)
    r = _chat(client, max_tokens=60, temperature=0, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":  # a random model may run out of tokens inside a string
        assert isinstance(json.loads(text), dict)
    c = client.completions.create(model="hermes-tiny", prompt="Pick:", max_tokens=8, temperature=1.0, seed=8, n=3,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert all(ch.text in ("red", "green", "blue") for ch in c.choices)
    c = client.completions.create(model="hermes-tiny", prompt="Code:", max_tokens=10, temperature=1.0,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert len(c.choices[0].text) == 6 and c.choices[0].text[2] == "-"


def test_reasoning_content_whole_and_streamed(client):
    extra = {"structured_outputs": {"grammar": 'root ::= "<think>" [a-z ]{1,12} "</think>" [a-z]{1,8}'}}
    r = _chat(client, max_tokens=40, temperature=1.0, seed=9, extra_body=extra)
    msg = r.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and msg.content and "<think>" not in msg.content + reasoning
    parts = {"reasoning": "", "content": ""}
    for chunk in _chat(client, max_tokens=40, temperature=1.0, seed=9, extra_body=extra, stream=True):
        for ch in chunk.choices:
            parts["reasoning"] += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            parts["content"] += ch.delta.content or ""
    assert parts == {"reasoning": reasoning, "content": msg.content}


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_requests_are_400_naming_the_field(tool_server, body, param):
    status, r = http("POST", tool_server.url + "/v1/chat/completions",
                     {"model": "hermes-tiny", "messages": MESSAGES, "max_tokens": 4, **body})
    assert status == 400, r
    assert r["error"]["param"] == param and r["error"]["type"] == "invalid_request_error"


def test_auto_needs_the_server_flags(server):
    status, r = http("POST", server.url + "/v1/chat/completions",
                     {"messages": MESSAGES, "max_tokens": 4, "tools": TOOLS, "tool_choice": "auto"})
    assert status == 400 and r["error"]["param"] == "tool_choice" and "enable-auto-tool-choice" in r["error"]["message"]


def test_history_with_tool_calls_renders(client):
    msgs = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    r = client.chat.completions.create(model="hermes-tiny", messages=msgs, tools=TOOLS, tool_choice="none",
                                       max_tokens=3)
    assert r.usage.prompt_tokens > 0 and r.choices[0].message.tool_calls in (None, [])
