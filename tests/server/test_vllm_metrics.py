"""vLLM's Prometheus families on /metrics (issue 36): every family vLLM exports for a text model is there with the
model_name label, and after known requests the counters and histograms moved by exactly what those requests did.
The periodic stats line appears while busy and not with --disable-log-stats."""
from __future__ import annotations

import re
import time

import pytest

from conftest import Server, http

# the families vLLM exports for a text model (without LoRA or speculative decoding), as /metrics names them
VLLM_FAMILIES = {
    "counter": ["vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions",
                "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"],
    "gauge": ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:cache_config_info"],
    "histogram": ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                  "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
                  "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                  "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
                  "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
                  "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
                  "vllm:request_params_n", "vllm:request_params_max_tokens", "vllm:iteration_tokens_total"],
}


def scrape(url: str) -> dict[str, float]:
    """Every sample of the vllm: families summed over its labels (finished_reason kept), by sample name."""
    _, text = http("GET", url + "/metrics")
    out: dict[str, float] = {}
    for m in re.finditer(r'^(vllm:\w+)\{([^}]*)\} (\S+)$', text, re.M):
        name, labels, value = m.groups()
        assert 'model_name="metrics-model"' in labels, m.group(0)
        reason = re.search(r'finished_reason="(\w+)"', labels)
        key = f"{name}[{reason.group(1)}]" if reason else name
        if 'le="' in labels:
            le = re.search(r'le="([^"]+)"', labels).group(1)
            key = f"{name}[le={le}]"
        out[key] = out.get(key, 0.0) + float(value)
    return out


@pytest.fixture(scope="module")
def metrics_server(server_model, tmp_path_factory):
    s = Server(server_model, tmp_path_factory.mktemp("metrics") / "server.log",
               ["--served-model-name", "metrics-model", "--log-stats-interval", "0.5"]).wait_ready()
    yield s
    s.stop()


def test_every_vllm_family_is_exported(metrics_server):
    http("POST", metrics_server.url + "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    _, text = http("GET", metrics_server.url + "/metrics")
    for kind, names in VLLM_FAMILIES.items():
        for name in names:
            family = name + "_total" if kind == "counter" else name  # the text format's counter name
            assert f"# TYPE {family} {kind}" in text, name
            assert re.search(rf'^{name}(_total|_bucket|_count|_sum)?\{{[^}}]*model_name="metrics-model"', text,
                             re.M), name


def test_counters_move_by_what_the_requests_did(metrics_server):
    url = metrics_server.url
    prompt_ids = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 52))]  # 7 and 32 prompt tokens
    before = scrape(url)
    for ids, max_tokens in zip(prompt_ids, (4, 6)):
        s, r = http("POST", url + "/v1/completions", {"prompt": ids, "max_tokens": max_tokens, "ignore_eos": True})
        assert s == 200 and r["usage"]["completion_tokens"] == max_tokens
    s, r = http("POST", url + "/v1/completions", {"prompt": [40, 41, 42], "max_tokens": 3, "n": 2,
                                                  "ignore_eos": True, "stop_token_ids": [1]})
    assert s == 200
    after = scrape(url)

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("vllm:prompt_tokens_total") == 7 + 32 + 3
    assert delta("vllm:generation_tokens_total") == 4 + 6 + 2 * 3
    assert delta("vllm:request_success_total[length]") == 3
    assert delta("vllm:request_prompt_tokens_sum") == 7 + 32 + 3
    assert delta("vllm:request_generation_tokens_sum") == 4 + 6 + 6
    assert delta("vllm:request_max_num_generation_tokens_sum") == 4 + 6 + 3
    assert delta("vllm:request_params_max_tokens_sum") == 4 + 6 + 3
    assert delta("vllm:request_params_n_sum") == 1 + 1 + 2
    assert delta("vllm:request_prompt_tokens_bucket[le=10.0]") == 2  # 7 and 3 tokens; 32 is above
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds", "time_to_first_token_seconds",
                 "request_time_per_output_token_seconds"):
        assert delta(f"vllm:{name}_count") == 3, name
    # every generated token after a request's first is an inter-token sample (and its deprecated twin's); the n=2
    # request's two sequences count as one request: one first token, then 5
    assert delta("vllm:inter_token_latency_seconds_count") == delta("vllm:time_per_output_token_seconds_count")
    assert delta("vllm:inter_token_latency_seconds_count") == 3 + 5 + 5
    # engine steps: every prompt token computed once (nothing cached: fresh prompts) and every token sampled
    assert delta("vllm:iteration_tokens_total_sum") == (7 + 32 + 3 + 3) + (4 + 6 + 2 * 3)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    # phases add up: queue + inference <= e2e, prefill + decode == inference (same clock, per request)
    q, inf, e2e = (delta("vllm:request_queue_time_seconds_sum"), delta("vllm:request_inference_time_seconds_sum"),
                   delta("vllm:e2e_request_latency_seconds_sum"))
    assert 0 <= q and 0 < inf <= e2e + 1e-6 and q + inf <= e2e + 1e-3
    pre, dec = delta("vllm:request_prefill_time_seconds_sum"), delta("vllm:request_decode_time_seconds_sum")
    assert abs(pre + dec - inf) < 1e-3


def test_prefix_cache_counters(metrics_server):
    url = metrics_server.url
    ids = list(range(100, 164))  # 64 tokens: 4 full blocks of 16
    http("POST", url + "/v1/completions", {"prompt": ids, "max_tokens": 1})
    before = scrape(url)
    http("POST", url + "/v1/completions", {"prompt": ids, "max_tokens": 1})
    after = scrape(url)
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    assert queries > 0 and 0 < hits <= queries


def test_periodic_stats_line_while_busy(metrics_server):
    http("POST", metrics_server.url + "/v1/completions", {"prompt": [3, 4, 5], "max_tokens": 8, "ignore_eos": True})
    time.sleep(1.2)
    metrics_server.log.flush()
    lines = re.findall(r"Engine 000: Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) "
                       r"tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, GPU KV cache usage: ([\d.]+)%, "
                       r"Prefix cache hit rate: ([\d.]+)%", metrics_server.log_path.read_text())
    assert lines, metrics_server.log_path.read_text()[-2000:]
    assert any(float(p) > 0 or float(g) > 0 for p, g, *_ in lines)


def test_disable_log_stats_silences_the_line(server_model, tmp_path):
    s = Server(server_model, tmp_path / "quiet.log", ["--disable-log-stats", "--log-stats-interval", "0.3"])
    try:
        s.wait_ready()
        http("POST", s.url + "/v1/completions", {"prompt": [3, 4, 5], "max_tokens": 8, "ignore_eos": True})
        time.sleep(1.0)
        s.log.flush()
        text = s.log_path.read_text()
        assert "finished" in text and "Avg prompt throughput" not in text
    finally:
        s.stop()
