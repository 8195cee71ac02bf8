"""/v1/responses with the real openai client (client.responses.create, streamed and not) on the shared tiny
server: the reply equals /v1/chat/completions' for the same conversation (greedy), the response.* events come in
order and their deltas make the final text; what is not implemented is a 400 naming it."""
from __future__ import annotations

import openai
import pytest

from tests.server.conftest import http


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _chat_text(client, messages, max_tokens):
    res = client.chat.completions.create(model="llama", messages=messages, max_tokens=max_tokens, temperature=0)
    return res.choices[0].message.content, res.choices[0].finish_reason


def test_response_equals_chat_completion(client):
    res = client.responses.create(model="llama", input="Tell me a story", instructions="Be brief",
                                  max_output_tokens=8, temperature=0)
    text, finish = _chat_text(client, [{"role": "system", "content": "Be brief"},
                                       {"role": "user", "content": "Tell me a story"}], 8)
    assert res.object == "response" and res.output[0].type == "message" and res.output[0].role == "assistant"
    assert res.output_text == text
    assert res.status == ("incomplete" if finish == "length" else "completed")
    assert res.usage.output_tokens <= 8 and res.usage.input_tokens > 0


def test_message_list_input(client):
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "input_text", "text": "more"}]}]
    res = client.responses.create(model="llama", input=conv, max_output_tokens=6, temperature=0)
    text, _ = _chat_text(client, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                  {"role": "user", "content": "more"}], 6)
    assert res.output_text == text


def test_streamed_events(client):
    events = list(client.responses.create(model="llama", input="Count", max_output_tokens=10, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == events[-4].text
    whole = client.responses.create(model="llama", input="Count", max_output_tokens=10, temperature=0)
    assert whole.output_text == deltas


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": []}, "input"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_tokens"),
])
def test_refusals(server, body, param):
    status, res = http("POST", server.url + "/v1/responses", body)
    assert status == 400, res
    assert res["error"]["param"] == param and res["error"]["type"] == "invalid_request_error"
