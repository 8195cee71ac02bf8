"""The one admission rule over the server: a tiny Gemma 3 (6 KV-cache groups: 5 sliding-window, 1 full) with a
pool of 20 blocks admits prompts of at most 47 tokens (the engine's announced limit, 6 groups x 3 blocks of 16).
A longer prompt is a 400 context_length_exceeded, never a 200 with finish_reason "abort", and the engine serves
the next request.

The server speculates (n-gram drafts, issue 55: the hostile cases with speculation on); the same rule without
speculation: tests/engine/test_admission.py (the scheduler, and a tiny Gemma 3 offline with a small pool)."""
import json
import threading
import time

import pytest

from tests.server.conftest import NGRAM_SPEC, Server, http
from tests.tiny import make_checkpoint

C = "/v1/completions"


@pytest.fixture(scope="module")
def gemma3_server(tmp_path_factory, tiny_tokenizer):
    model = make_checkpoint("gemma3", tmp_path_factory.mktemp("admission_model"), tokenizer=tiny_tokenizer)
    s = Server(model, tmp_path_factory.mktemp("logs") / "admission.log",
               ["--num-kv-blocks", "20", "--speculative-config", json.dumps(NGRAM_SPEC)]).wait_ready()
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


def test_a_generation_that_outgrows_the_pool_ends_length_and_the_queue_moves(gemma3_server):
    """A 5-token prompt with max_tokens 400 is admitted (its prompt fits), but the 20-block pool holds about 145
    tokens of one request. Before, at that point the request preempted itself, could not be resumed and waited at
    the head of the queue for good, and every later request waited behind it (the server frozen by one request).
    Now it finishes "length" where the pool ends, and the next request is served. With n-gram drafts (this server
    speculates) a verify step's drafts are dropped first where they do not fit."""
    url = gemma3_server.url + C
    (pid,) = gemma3_server.engine_pids()
    results = {}
    big = threading.Thread(target=lambda: results.setdefault("big", http(
        "POST", url, {"prompt": [6] * 5, "max_tokens": 400, "ignore_eos": True, "temperature": 0}, timeout=60)))
    big.start()
    time.sleep(0.5)  # it runs
    status, body = http("POST", url, {"prompt": [7] * 5, "max_tokens": 2}, timeout=60)
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    big.join(70)
    status, body = results["big"]
    assert status == 200, body
    total = body["usage"]["total_tokens"]
    assert body["choices"][0]["finish_reason"] == "length" and 48 < total < 405, body["usage"]
    _, metrics = http("GET", gemma3_server.url + "/metrics")
    drafts = sum(float(ln.split()[-1]) for ln in metrics.splitlines()
                 if ln.startswith("vllm:spec_decode_num_draft_tokens_total"))
    assert drafts > 0  # speculation was on
    assert gemma3_server.engine_pids() == [pid] and gemma3_server.health()[0] == 200
