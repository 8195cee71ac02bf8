"""A function-tool round trip over /v1/responses with the real openai client, streamed and not, on a tiny random
model with a Hermes-style chat template (tests/server/test_tools.py's server). A random model does not call tools by
itself, so the call is forced: a named tool_choice (or "required") constrains the output to the function's
parameters (structured outputs), and the call comes back as a function_call output item whose arguments fit the
schema. The client then sends a function_call_output item with previous_response_id; the final message equals
chat completions' (greedy) on the conversation it stands for (user, assistant tool call, tool result), token
for token, so the stored input + output were the history."""
from __future__ import annotations

import json

import jsonschema

# the Hermes-template server and its openai client (fixtures)
from tests.server.test_tools import WEATHER, client, tool_server  # noqa: F401

SCHEMA = WEATHER["function"]["parameters"]
TOOL = {"type": "function", "name": "get_weather", "description": WEATHER["function"]["description"],
        "parameters": SCHEMA, "strict": True}  # the Responses API's flat function tool
QUESTION = "What is the weather in Paris?"
RESULT = '{"temperature": 21, "sky": "clear"}'


def _final_answer_by_chat(client, call_id: str, arguments: str) -> tuple[str, int]:
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": call_id, "content": RESULT}]
    res = client.chat.completions.create(model="hermes-tiny", messages=messages, tools=[WEATHER], tool_choice="none",
                                         max_tokens=8, temperature=0)
    return res.choices[0].message.content, res.usage.prompt_tokens


def _check_call(item):
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id and item.status == "completed"
    jsonschema.validate(json.loads(item.arguments), SCHEMA)


def test_function_tool_round_trip(client):
    first = client.responses.create(model="hermes-tiny", input=QUESTION, tools=[TOOL], max_output_tokens=120,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    assert first.status == "completed"
    (call,) = first.output  # a named call: no text, one function_call item
    _check_call(call)
    final = client.responses.create(model="hermes-tiny", previous_response_id=first.id, tools=[TOOL],
                                    tool_choice="none", max_output_tokens=8, temperature=0,
                                    input=[{"type": "function_call_output", "call_id": call.call_id,
                                            "output": RESULT}])
    assert [item.type for item in final.output] == ["message"]
    text, prompt_tokens = _final_answer_by_chat(client, call.call_id, call.arguments)
    assert final.output_text == text and final.usage.input_tokens == prompt_tokens


def test_function_tool_round_trip_streamed(client):
    events = list(client.responses.create(model="hermes-tiny", input=QUESTION, tools=[TOOL], max_output_tokens=120,
                                          tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    (call,) = events[-1].response.output
    _check_call(call)
    assert events[3].delta == events[4].arguments == call.arguments and events[2].item.call_id == call.call_id
    whole = client.responses.create(model="hermes-tiny", input=QUESTION, tools=[TOOL], max_output_tokens=120,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    assert whole.output[0].arguments == call.arguments  # greedy: the same call either way
    final = list(client.responses.create(model="hermes-tiny", previous_response_id=events[-1].response.id,
                                         tools=[TOOL], tool_choice="none", max_output_tokens=8, temperature=0,
                                         stream=True, input=[{"type": "function_call_output",
                                                              "call_id": call.call_id, "output": RESULT}]))
    deltas = "".join(e.delta for e in final if e.type == "response.output_text.delta")
    text, _ = _final_answer_by_chat(client, call.call_id, call.arguments)
    assert deltas == final[-1].response.output_text == text


def test_required_tool_choice_makes_a_call(client):
    res = client.responses.create(model="hermes-tiny", input=QUESTION, tools=[TOOL], tool_choice="required",
                                  parallel_tool_calls=False, max_output_tokens=250, temperature=0)
    (call,) = res.output
    _check_call(call)
