"""/v1/responses with the real openai client (client.responses.create, streamed and not) on the shared tiny
server: the reply equals /v1/chat/completions' for the same conversation (greedy), the response.* events come in
order and their deltas make the final text; previous_response_id continues a stored conversation (404 for an
unknown one, as vLLM answers); what is not implemented is a 400 naming it. Function tools: test_responses_tools.py.
The hostile cases (refusals, another user's stored response, metadata limits) run with n-gram speculation off and
on (any_server)."""
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
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tool_choice"),  # auto: off
    ({"input": "hi", "tools": [{"type": "web_search"}], "tool_choice": "none"}, "tools"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),  # no call_id
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "messages[0].content[0].image_url"),  # a bad image (the chat path names the part)
    ({"input": []}, "input"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_tokens"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),  # no schema
])
def test_refusals(any_server, body, param):
    status, res = http("POST", any_server.url + "/v1/responses", body)
    assert status == 400, res
    assert res["error"]["param"] == param and res["error"]["type"] == "invalid_request_error"


def test_sampling_fields_reach_the_sampler(server, client):
    """top_k / penalties / logit_bias are used, as on the chat route: a bias of +100 on one token makes it every
    output token; "auto" tool choice without tools (vLLM's default) is no tool plan."""
    chat = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          temperature=0, logprobs=True)
    forced = chat.choices[0].logprobs.content[0].token
    status, tokenized = http("POST", server.url + "/tokenize", {"model": "llama", "prompt": forced,
                                                                 "add_special_tokens": False})
    assert status == 200
    tok = tokenized["tokens"][0]
    res = client.responses.create(model="llama", input="Tell me a story", max_output_tokens=4, temperature=0,
                                  extra_body={"top_k": 5, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                                              "logit_bias": {str(tok): 100}}, tool_choice="auto")
    assert res.usage.output_tokens == 4 and res.output_text == forced * 4


def test_previous_response_id_continues_the_conversation(client):
    """A stored response's input and output are the next request's history: its reply equals chat completions'
    on the whole conversation; instructions are the request's own."""
    first = client.responses.create(model="llama", input="Tell me a story", instructions="Be brief",
                                    max_output_tokens=6, temperature=0)
    second = client.responses.create(model="llama", input="And then?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    conv = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"}]
    res = client.chat.completions.create(model="llama", messages=conv, max_tokens=6, temperature=0)
    assert second.output_text == res.choices[0].message.content
    assert second.usage.input_tokens == res.usage.prompt_tokens and second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text  # GET /v1/responses/{id}
    streamed = list(client.responses.create(model="llama", input="And then?", previous_response_id=first.id,
                                            max_output_tokens=6, temperature=0, stream=True))
    assert streamed[-1].response.output_text == second.output_text


def test_unknown_or_unstored_previous_response_is_404(client):
    with pytest.raises(openai.NotFoundError, match="Response with id 'resp_nope' not found"):
        client.responses.create(model="llama", input="hi", previous_response_id="resp_nope", max_output_tokens=2)
    unstored = client.responses.create(model="llama", input="hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="llama", input="hi", previous_response_id=unstored.id, max_output_tokens=2)
    body = e.value.body
    assert e.value.status_code == 404 and body["type"] == "invalid_request_error"
    assert body["param"] == "previous_response_id"


def test_stored_responses_are_their_creators_only(any_server):
    """Issue 55: a client-chosen request_id (body or X-Request-Id) named the stored response resp-<id>, which
    anyone could read, continue or overwrite. Now the id is the server's and the response is bound to its creator
    (its `user` here, the API key with --api-key): anyone else gets 404 and nothing is overwritten."""
    url = any_server.url + "/v1/responses"
    s, first = http("POST", url, {"input": "hi", "max_output_tokens": 2, "user": "alice", "request_id": "shared"})
    assert s == 200 and first["id"] != "resp-shared" and first["id"].startswith("resp-"), first
    s, other = http("POST", url, {"input": "bye", "max_output_tokens": 2, "user": "bob"},
                    headers={"X-Request-Id": "shared"})
    assert s == 200 and other["id"] not in (first["id"], "resp-shared")
    rid = first["id"]
    for query in ("?user=bob", ""):  # another user, or none
        s, r = http("GET", f"{url}/{rid}{query}")
        assert s == 404 and r["error"]["type"] == "invalid_request_error", r
    s, r = http("POST", url, {"input": "more", "max_output_tokens": 2, "user": "bob", "previous_response_id": rid})
    assert s == 404 and r["error"]["param"] == "previous_response_id"
    s, r = http("GET", f"{url}/{rid}?user=alice")
    assert s == 200 and r == first  # unchanged by bob's request with the same client id
    s, r = http("POST", url, {"input": "more", "max_output_tokens": 2, "user": "alice", "previous_response_id": rid})
    assert s == 200 and r["previous_response_id"] == rid


@pytest.mark.parametrize("metadata", [{f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513},
                                      {"k": {"nested": 1}}])
def test_metadata_within_openai_limits(any_server, metadata):
    s, r = http("POST", any_server.url + "/v1/responses", {"input": "hi", "max_output_tokens": 1, "metadata": metadata})
    assert s == 400 and r["error"]["param"] == "metadata", r


def test_text_format_json_schema(client):
    """Responses structured output (text.format), as chat's response_format: the reply is the schema's JSON, and
    the response echoes the format."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "score"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}
    res = client.responses.create(model="llama", input="Verdict?", max_output_tokens=120, temperature=0,
                                  text={"format": fmt})
    jsonschema.validate(json.loads(res.output_text), schema)
    assert res.text.format.type == "json_schema" and res.text.format.name == "verdict"
    plain = client.responses.create(model="llama", input="Verdict?", max_output_tokens=8, temperature=0,
                                    text={"format": {"type": "text"}})
    assert plain.text.format.type == "text"
