"""A server started from a hub id (`kestrel serve Org/Name`, found in a local Hugging Face cache with
HF_HUB_OFFLINE) is served under that id, as vLLM serves it: /v1/models lists it and a client that sends
`model: "Org/Name"` is answered (it was the cache snapshot's folder name, and a 404). --served-model-name still
wins. The same server takes vLLM's `truncate_prompt_tokens` on completions and chat completions (the prompt's
last k tokens; -1: max_model_len) instead of a 400."""
from __future__ import annotations

import openai
import pytest

from tests.server.conftest import Server, http
from tests.server.test_startup_errors import _fake_hub_cache

HUB_ID = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def hub_server(server_model, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub_cache")
    _fake_hub_cache(cache, HUB_ID, server_model)
    s = Server(HUB_ID, cache / "server.log", env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(hub_server):
    c = openai.OpenAI(base_url=hub_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def test_served_under_the_hub_id(client):
    assert [m.id for m in client.models.list().data] == [HUB_ID]
    out = client.completions.create(model=HUB_ID, prompt="hello", max_tokens=2, temperature=0)
    assert out.model == HUB_ID and out.choices[0].text is not None
    with pytest.raises(openai.NotFoundError):  # the snapshot's folder name is not a served name
        client.completions.create(model="0123456789abcdef0123456789abcdef01234567", prompt="hi", max_tokens=1)


def test_served_model_name_still_wins():
    from kestrel.cli import build_parser, keep_hub_id_as_served_name

    args = build_parser().parse_args(["serve", "--model", HUB_ID, "--served-model-name", "mine"])
    keep_hub_id_as_served_name(args)
    assert args.served_model_name == ["mine"]
    args = build_parser().parse_args(["serve", "--model", HUB_ID])
    keep_hub_id_as_served_name(args)
    assert args.served_model_name == [HUB_ID]


def test_truncate_prompt_tokens(client, hub_server, tiny_tokenizer):
    prompt = "the cat sat on the mat and looked at the door for a while"
    full = list(tiny_tokenizer(prompt)["input_ids"])
    cut = client.completions.create(model=HUB_ID, prompt=prompt, max_tokens=3, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 5})
    assert cut.usage.prompt_tokens == 5
    same = client.completions.create(model=HUB_ID, prompt=full[-5:], max_tokens=3, temperature=0)
    assert cut.choices[0].text == same.choices[0].text
    whole = client.completions.create(model=HUB_ID, prompt=prompt, max_tokens=1, extra_body={
        "truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(full)
    chat = client.chat.completions.create(model=HUB_ID, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=1, extra_body={"truncate_prompt_tokens": 4})
    assert chat.usage.prompt_tokens == 4
    for bad, message in ((0, "must be a positive integer, or -1"), (513, "greater than max_model_len (512)")):
        status, body = http("POST", hub_server.url + "/v1/completions", {
            "prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": bad})
        assert status == 400 and body["error"]["param"] == "truncate_prompt_tokens", body
        assert message in body["error"]["message"]
