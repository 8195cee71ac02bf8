"""kestrel bench serve's arithmetic on synthetic timings: percentiles as numpy computes them, vLLM's result keys and
definitions (TTFT, TPOT, ITL, E2E, throughputs), the arrival process and the datasets. No server, no clock."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kestrel.bench.serve_client import split_concurrency
from kestrel.bench.serve_data import arrival_times, length_bounds, random_requests, sharegpt_requests
from kestrel.bench.serve_metrics import RequestResult, peak_concurrency, percentile, summarize, table_lines

# the keys vLLM's `bench serve` result file carries for a generation run (with --metric-percentiles 50,90,99)
VLLM_KEYS = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput", "max_concurrent_requests"} | {
    f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p50", "p90", "p99")}


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentile_matches_numpy(n):
    xs = np.random.default_rng(n).exponential(size=n).tolist()
    for p in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)), rel=1e-12)


def test_percentile_hand_values_and_empty():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # between the 2nd and 3rd of 1, 2, 3, 4
    assert percentile([0.0, 10.0], 90) == 9.0
    assert percentile([], 99) == 0.0  # vLLM reports 0 for a metric without samples


def results_fixture() -> list[RequestResult]:
    ok = [  # prompt_len, expected, start, ttft, itls, latency, usage tokens
        RequestResult(10, 4, start_time=0.0, success=True, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2,
                      output_tokens=4),
        RequestResult(20, 3, start_time=0.5, success=True, ttft=0.3, itl=[0.1, 0.1], latency=0.5, output_tokens=3),
        RequestResult(30, 1, start_time=0.6, success=True, ttft=0.2, itl=[], latency=0.2, output_tokens=1),
    ]
    failed = RequestResult(40, 5, start_time=0.1, error="HTTP 500")
    gone = RequestResult(50, 5, start_time=0.2, disconnected=True, ttft=0.4)
    return ok + [failed, gone]


def test_summarize_keys_and_values():
    s = summarize(results_fixture(), duration=2.0)
    assert set(s) == VLLM_KEYS
    assert (s["completed"], s["failed"]) == (3, 1)  # the disconnected request is neither
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 8)
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 4.0 and s["total_token_throughput"] == 34.0
    ttft = [0.1, 0.3, 0.2]
    tpot = [(0.2 - 0.1) / 3, (0.5 - 0.3) / 2]  # the 1-token request has no TPOT
    itl = [0.02, 0.03, 0.05, 0.1, 0.1]
    e2el = [0.2, 0.5, 0.2]
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        assert s[f"mean_{name}_ms"] == pytest.approx(np.mean(xs) * 1e3)
        assert s[f"median_{name}_ms"] == pytest.approx(np.median(xs) * 1e3)
        assert s[f"std_{name}_ms"] == pytest.approx(np.std(xs) * 1e3)
        for p in (50, 90, 99):
            assert s[f"p{p}_{name}_ms"] == pytest.approx(np.percentile(xs, p) * 1e3)
    # intervals [0, .2), [.5, 1.0), [.6, .8): at most two at once
    assert s["max_concurrent_requests"] == 2


def test_output_tokens_fall_back_to_text_chunks_without_usage():
    r = RequestResult(5, 9, success=True, ttft=0.1, itl=[0.01] * 6, latency=0.16)  # 7 chunks, no usage
    s = summarize([r], duration=1.0)
    assert s["total_output_tokens"] == 7
    assert s["mean_tpot_ms"] == pytest.approx((0.16 - 0.1) / 6 * 1e3)


def test_custom_percentiles_spelling():
    s = summarize(results_fixture(), 1.0, percentiles=(25.0, 99.9))
    assert "p25_ttft_ms" in s and "p99.9_itl_ms" in s and "p99_ttft_ms" not in s


def test_all_failed_reports_zeros():
    s = summarize([RequestResult(3, 3, error="boom")], duration=1.0)
    assert s["completed"] == 0 and s["failed"] == 1 and s["p99_ttft_ms"] == 0.0 and s["mean_e2el_ms"] == 0.0


def test_peak_concurrency_touching_intervals_do_not_overlap():
    rs = [RequestResult(1, 1, start_time=t, latency=1.0) for t in (0.0, 1.0, 2.0)]
    assert peak_concurrency(rs) == 1
    rs.append(RequestResult(1, 1, start_time=0.5, latency=2.0))
    assert peak_concurrency(rs) == 2


def test_table_has_vllm_rows():
    s = summarize(results_fixture(), 2.0) | {"request_rate": 4.0, "max_concurrency": 8}
    text = "\n".join(table_lines(s))
    for row in ("Successful requests:", "Failed requests:", "Request rate configured (RPS):", "Maximum request "
                "concurrency:", "Output token throughput (tok/s):", "P99 TTFT (ms):", "P90 ITL (ms):",
                "Median TPOT (ms):", "Mean E2EL (ms):"):
        assert row in text, text


def test_arrivals_all_at_once_for_inf():
    assert arrival_times(5, float("inf"), 1.0, seed=0) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [1.0, 4.0, 0.25])
def test_arrivals_poisson_and_gamma(burstiness):
    n, rate = 20000, 10.0
    t = np.array(arrival_times(n, rate, burstiness, seed=3))
    assert t[-1] == pytest.approx(n / rate)  # scaled so that every seed offers the same load
    gaps = np.diff(t)
    assert (gaps >= 0).all()
    # gamma(shape k) gaps have a coefficient of variation 1/sqrt(k): 1 for a Poisson process
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)
    assert arrival_times(50, rate, burstiness, seed=3) == arrival_times(50, rate, burstiness, seed=3)
    assert arrival_times(50, rate, burstiness, seed=3) != arrival_times(50, rate, burstiness, seed=4)


def test_arrivals_refuse_bad_arguments():
    with pytest.raises(ValueError, match="--burstiness must be > 0"):
        arrival_times(3, 1.0, 0.0, seed=0)
    with pytest.raises(ValueError, match="--request-rate must be > 0"):
        arrival_times(3, 0.0, 1.0, seed=0)


def test_random_dataset_lengths_ids_and_seed(tiny_tokenizer):
    reqs = random_requests(tiny_tokenizer, 400, input_len=20, output_len=10, range_ratio=0.5, seed=7)
    assert length_bounds(20, 0.5) == (10, 30) and length_bounds(10, 0.5) == (5, 15)
    ins, outs = [r.prompt_len for r in reqs], [r.expected_output_len for r in reqs]
    assert (min(ins), max(ins), min(outs), max(outs)) == (10, 30, 5, 15)  # uniform over the whole range
    special = set(tiny_tokenizer.all_special_ids)
    for r in reqs:
        assert len(r.prompt) == r.prompt_len
        assert all(0 <= t < tiny_tokenizer.vocab_size and t not in special for t in r.prompt)
    again = random_requests(tiny_tokenizer, 400, 20, 10, 0.5, seed=7)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    fixed = random_requests(tiny_tokenizer, 20, 16, 8, 0.0, seed=7)
    assert {(r.prompt_len, r.expected_output_len) for r in fixed} == {(16, 8)}
    with pytest.raises(ValueError, match=r"range-ratio must be in \[0, 1\)"):
        random_requests(tiny_tokenizer, 2, 16, 8, 1.0, seed=0)


def test_sharegpt_dataset(tmp_path, tiny_tokenizer):
    long_text = "the quick brown fox jumps over the lazy dog " * 3
    data = [{"conversations": [{"from": "human", "value": f"{long_text} question {i}"},
                               {"from": "gpt", "value": f"{long_text} answer {i}"}]} for i in range(6)]
    data += [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long_text}]},  # too short
             {"conversations": [{"from": "human", "value": long_text}]}]  # one turn
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(tiny_tokenizer, str(path), 6, None, seed=0)
    assert sorted(r.prompt.rsplit(" ", 1)[1] for r in reqs) == [str(i) for i in range(6)]
    for r in reqs:
        assert r.prompt_len == len(tiny_tokenizer(r.prompt).input_ids)
        assert r.expected_output_len == len(tiny_tokenizer(f"{long_text} answer {r.prompt.rsplit(' ', 1)[1]}").input_ids)
    assert {r.expected_output_len for r in sharegpt_requests(tiny_tokenizer, str(path), 3, 50, seed=0)} == {50}
    with pytest.raises(ValueError, match="only 6 usable conversations"):
        sharegpt_requests(tiny_tokenizer, str(path), 7, None, seed=0)


def test_concurrency_split_between_client_processes():
    assert split_concurrency(10, 4) == [3, 3, 2, 2] and split_concurrency(4, 4) == [1, 1, 1, 1]
    assert split_concurrency(None, 3) == [None, None, None]
