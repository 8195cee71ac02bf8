"""The one admission rule over the server: a tiny Gemma 3 (6 KV-cache groups: 5 sliding-window, 1 full) with a
pool of 20 blocks admits prompts of at most 47 tokens (the engine's announced limit, 6 groups x 3 blocks of 16).
A longer prompt is a 400 context_length_exceeded, never a 200 with finish_reason "abort", and the engine serves
the next request."""
import pytest

from tests.server.conftest import Server, http
from tests.tiny import make_checkpoint

C = "/v1/completions"


@pytest.fixture(scope="module")
def gemma3_server(tmp_path_factory, tiny_tokenizer):
    model = make_checkpoint("gemma3", tmp_path_factory.mktemp("admission_model"), tokenizer=tiny_tokenizer)
    s = Server(model, tmp_path_factory.mktemp("logs") / "admission.log", ["--num-kv-blocks", "20"]).wait_ready()
    yield s
    s.stop()


def test_too_long_prompt_is_a_400_and_the_next_request_is_served(gemma3_server):
    url = gemma3_server.url + C
    status, body = http("POST", url, {"prompt": [5] * 48, "max_tokens": 2})
    assert status == 400, body
    assert body["error"]["code"] == "context_length_exceeded" and body["error"]["param"] == "prompt"
    assert "at most 47 tokens" in body["error"]["message"]
    for prompt in ([5] * 47, [6] * 5):  # the limit itself, then a short one
        status, body = http("POST", url, {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 2
