"""The KV tiers over the server (--kv-offloading-size, --kv-offloading-disk-path): a prompt whose blocks the device
evicted reports the tier's hits in usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details, as
vLLM) with the same greedy tokens, /metrics counts them under vLLM's names, /reset_prefix_cache clears the host
tier too, and a restarted server serves the prefix from the disk tier."""
import re
import time

import pytest

from kestrel.engine.kv.pool import hash_block
from kestrel.worker.kv_disk_tier import entry_name
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
    metrics = scrape(tier_server)
    assert metrics['vllm:external_prefix_cache_hits_total'] == 32
    assert metrics['vllm:kv_offload_total_bytes_total{transfer_type="GPU_to_CPU"}'] > 0
    assert (metrics['vllm:kv_offload_total_bytes_total{transfer_type="CPU_to_GPU"}']
            == metrics["vllm:kv_offload_load_bytes_total"] > 0)
    for p in OTHERS:
        complete(tier_server, p)
    assert http("POST", tier_server.url + "/reset_prefix_cache") == (200, {"ok": True})
    assert cached(complete(tier_server, A)) == 0  # neither the device nor the host holds A now


def scrape(server) -> dict[str, float]:
    """/metrics as {name{labels other than model and engine}: value}."""
    status, text = http("GET", server.url + "/metrics")
    assert status == 200, text
    out = {}
    for line in text.splitlines():
        m = re.match(r'^([\w:]+)(?:\{(.*)\})? ([\d.e+-]+)$', line)
        if m:
            labels = [lv for lv in (m.group(2) or "").split(",") if lv and not lv.startswith(("model_name", "engine"))]
            out[m.group(1) + ("{" + ",".join(labels) + "}" if labels else "")] = float(m.group(3))
    return out


def test_a_restarted_server_serves_the_prefix_from_disk(server_model, tmp_path):
    args = ["--num-kv-blocks", "8", "--max-model-len", "128", "--kv-offloading-size", "0.001",
            "--kv-offloading-disk-path", str(tmp_path / "kv"), "--kv-offloading-disk-size", "0.01",
            "--enable-prompt-tokens-details"]
    s = Server(server_model, tmp_path / "disk1.log", args).wait_ready()
    try:
        first = complete(s, A)
        for p in OTHERS:
            complete(s, p)
        parent, names = None, []
        for i in range(2):
            parent = hash_block(parent, A[16 * i:16 * (i + 1)])
            names.append(entry_name((0, parent)))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(list((tmp_path / "kv").glob("*/" + n)) for n in names):
            time.sleep(0.1)  # written in the background
        assert all(list((tmp_path / "kv").glob("*/" + n)) for n in names)
    finally:
        s.stop()
    s = Server(server_model, tmp_path / "disk2.log", args).wait_ready()
    try:
        second = complete(s, A)
        assert cached(second) == 32
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        metrics = scrape(s)
        assert metrics['vllm:kv_offload_total_bytes_total{transfer_type="DISK_to_GPU"}'] > 0
        assert metrics["vllm:external_prefix_cache_hits_total"] == 32
    finally:
        s.stop()
