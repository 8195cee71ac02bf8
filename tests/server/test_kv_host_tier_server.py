"""The host KV tier over the server (--kv-offloading-size): a prompt whose blocks the device evicted reports the
host's hits in usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details, as vLLM) with the same
greedy tokens, and /reset_prefix_cache clears the host tier too."""
import pytest

from tests.server.conftest import Server, http

A = [(7 * i + 3) % 90 + 5 for i in range(40)]  # 2 full blocks of 16 before the last token
OTHERS = [[(11 * i + 13 * j + 1) % 90 + 5 for i in range(60)] for j in range(1, 4)]


@pytest.fixture(scope="module")
def tier_server(server_model, tmp_path_factory):
    s = Server(server_model, tmp_path_factory.mktemp("logs") / "kv_tier.log",
               ["--num-kv-blocks", "8", "--max-model-len", "128", "--kv-offloading-size", "0.001",
                "--kv-offloading-backend", "native", "--enable-prompt-tokens-details", "--enable-admin-api"]
               ).wait_ready()
    yield s
    s.stop()


def complete(server, prompt):
    s, r = http("POST", server.url + "/v1/completions",
                {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert s == 200, r
    return r


def cached(r):
    return (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_an_evicted_prompt_is_served_from_the_host_tier(tier_server):
    first = complete(tier_server, A)
    assert cached(first) == 0
    for p in OTHERS:  # A's device blocks are reallocated
        complete(tier_server, p)
    second = complete(tier_server, A)
    assert cached(second) == 32
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    for p in OTHERS:
        complete(tier_server, p)
    assert http("POST", tier_server.url + "/reset_prefix_cache") == (200, {"ok": True})
    assert cached(complete(tier_server, A)) == 0  # neither the device nor the host holds A now
