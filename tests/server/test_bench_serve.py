"""`kestrel bench serve` against a real tiny `kestrel serve` on CPU, seeded: the requests it sends are the ones the
dataset code draws, every completed request generates exactly its output length (ignore_eos), the result file
has vLLM's keys and its percentiles are those of its own per-request timings. Disconnects included: the command
itself asserts through /metrics that nothing is left running and the KV pool is full again."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from transformers import AutoTokenizer

from conftest import ROOT, http
from kestrel.bench.serve_data import arrival_times, random_requests
from test_bench_serve_stats import VLLM_KEYS

RUN_KEYS = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
            "burstiness", "max_concurrency"}


def bench(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "kestrel.cli", "bench", "serve", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_bench_serve_counts_keys_and_percentiles(server, server_model, tmp_path):
    out_file = tmp_path / "result.json"
    r = bench("--base-url", server.url, "--num-prompts", "12", "--max-concurrency", "4", "--random-input-len", "16",
              "--random-output-len", "24", "--random-range-ratio", "0.5", "--disconnect-fraction", "0.34",
              "--seed", "1", "--num-warmups", "2", "--result-file", str(out_file), "--save-detailed")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for row in ("Serving Benchmark Result", "Request throughput (req/s):", "P99 TTFT (ms):", "P90 ITL (ms):",
                "Median TPOT (ms):", "P50 E2EL (ms):", "OK: engine idle, KV pool full"):
        assert row in out, out
    res = json.loads(out_file.read_text())
    assert VLLM_KEYS | RUN_KEYS <= set(res), sorted(VLLM_KEYS | RUN_KEYS - set(res))
    assert (res["num_prompts"], res["request_rate"], res["max_concurrency"]) == (12, "inf", 4)
    assert res["completed"] + res["disconnected"] == 12 and res["disconnected"] >= 1 and res["failed"] == 0

    # the same seed draws the same requests here: the server saw exactly these lengths
    expected = random_requests(AutoTokenizer.from_pretrained(server_model), 12, 16, 24, 0.5, seed=1)
    assert res["input_lens"] == [q.prompt_len for q in expected]
    assert not any(res["errors"]) and all(t > 0 for t in res["ttfts"])  # disconnected ones had a first token too
    completed = [i for i in range(12) if res["output_lens"][i]]  # usage arrives only on streams read to the end
    assert len(completed) == res["completed"]
    assert [res["output_lens"][i] for i in completed] == [expected[i].expected_output_len for i in completed]
    assert res["total_output_tokens"] == sum(expected[i].expected_output_len for i in completed)
    assert res["total_input_tokens"] == sum(expected[i].prompt_len for i in completed)
    ttfts = [res["ttfts"][i] for i in completed]
    itls = [x for i in completed for x in res["itls"][i]]
    for p in (50, 90, 99):
        assert res[f"p{p}_ttft_ms"] == pytest.approx(np.percentile(ttfts, p) * 1e3)
        assert res[f"p{p}_itl_ms"] == pytest.approx(np.percentile(itls, p) * 1e3)
    assert res["request_throughput"] == pytest.approx(res["completed"] / res["duration"])
    assert 0 < res["client_cpu_share"] and "client CPU:" in out
    assert res["output_throughput"] == pytest.approx(res["total_output_tokens"] / res["duration"])

    _, text = http("GET", server.url + "/metrics")
    assert 'vllm:num_requests_running{engine="0",model_name="llama"} 0.0' in text


def test_bench_serve_request_rate(server, tmp_path):
    out_file = tmp_path / "rate.json"
    r = bench("--base-url", server.url, "--num-prompts", "6", "--request-rate", "20", "--burstiness", "2",
              "--random-input-len", "8", "--random-output-len", "4", "--result-file", str(out_file),
              "--client-processes", "2", "--save-detailed")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out_file.read_text())
    assert (res["request_rate"], res["burstiness"], res["max_concurrency"]) == (20.0, 2.0, None)
    assert res["completed"] == 6 and res["total_output_tokens"] == 24
    assert res["duration"] >= 6 / 20  # the last request leaves at num_prompts / rate
    assert res["client_processes"] == 2 and res["output_lens"] == [4] * 6
    # sent from two processes, each request at its time: the sends (one system-wide clock) spread over the seeded
    # schedule's span, not all at once (half of it: room for a late first send on a busy machine)
    schedule = arrival_times(6, 20, 2, seed=1)
    assert max(res["start_times"]) - min(res["start_times"]) >= 0.5 * (schedule[-1] - schedule[0])
    assert "Request rate configured (RPS):" in r.stdout


@pytest.mark.parametrize("args, message", [
    (("--dataset-name", "sharegpt"), "--dataset-name sharegpt needs --dataset-path"),
    (("--random-range-ratio", "1.5"), r"--random-range-ratio must be in \[0, 1\)"),
    (("--burstiness", "0"), "--burstiness must be > 0"),
    (("--metric-percentiles", "p99"), "--metric-percentiles: comma-separated numbers"),
])
def test_bench_serve_bad_arguments(server, args, message):
    r = bench("--base-url", server.url, "--num-prompts", "2", *args, timeout=60)
    assert r.returncode != 0
    assert re.search(message, r.stdout + r.stderr), r.stdout + r.stderr


def test_bench_serve_unreachable_server_is_one_line():
    from conftest import free_port

    r = bench("--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert re.fullmatch(r"kestrel bench serve: <urlopen error .*Connection refused.*>\n", r.stderr), r.stderr
