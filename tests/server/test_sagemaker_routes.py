"""Issue 36: /ping (GET and POST) answers as /health does, and /invocations routes a body to the API whose
request it is (chat completion or completion), as vLLM serves them for SageMaker; with the real openai client."""
from __future__ import annotations

import openai
import pytest
from openai import Stream
from openai.types import Completion
from openai.types.chat import ChatCompletion

from conftest import http


def test_ping_is_health(server):
    for method in ("GET", "POST"):
        status, body = http(method, server.url + "/ping")
        assert status == 200 and body == server.health()[1], (method, body)


def test_invocations_routes_chat_and_completion_bodies(server):
    """The real openai client posts the bodies to /invocations and parses the answers as the API's own."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    chat_body = {"model": "llama", "messages": [{"role": "user", "content": "Say something"}], "max_tokens": 5,
                 "temperature": 0}
    chat = client.post(server.url + "/invocations", cast_to=ChatCompletion, body=chat_body)
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.content == client.chat.completions.create(**chat_body).choices[0].message.content
    comp_body = {"model": "llama", "prompt": "The capital", "max_tokens": 5, "temperature": 0}
    comp = client.post(server.url + "/invocations", cast_to=Completion, body=comp_body)
    assert comp.object == "text_completion"
    assert comp.choices[0].text == client.completions.create(**comp_body).choices[0].text
    stream = client.post(server.url + "/invocations", cast_to=Completion, stream=True, stream_cls=Stream[Completion],
                         body={**comp_body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 5
    assert "".join(c.choices[0].text for c in chunks if c.choices) == comp.choices[0].text


@pytest.mark.parametrize("body,status,words", [
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"input": "embed me"}, 400, "embeddings need a pooling model"),
    ({"nothing": 1}, 400, "chat completion body (messages) or a completion body (prompt)"),
    ([1, 2], 400, "must be a JSON object"),
])
def test_invocations_refuses_what_it_cannot_route(server, body, status, words):
    got, err = http("POST", server.url + "/invocations", body)
    assert got == status and words in err["error"]["message"], err


def test_invocations_malformed_json(server):
    got, err = http("POST", server.url + "/invocations", raw=b"{nope")
    assert got == 400 and err["error"]["message"].startswith("malformed JSON body"), err
