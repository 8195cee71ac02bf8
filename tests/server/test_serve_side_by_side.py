"""benchmarks/serve_side_by_side.py on the CPU: its table, ratios and verdicts on synthetic results of both servers,
its rate plan, the PNG (or the line saying why there is none), and one whole run against a tiny `kestrel serve`
(the vLLM half needs the GPU machine)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace

import pytest

from benchmarks.serve_side_by_side import auto_rates, markdown, plot, rate_runs
from conftest import ROOT


def run(server: str, rate, **metrics) -> dict:
    base = dict(request_throughput=10.0, output_throughput=1000.0, median_ttft_ms=50.0, p99_ttft_ms=100.0,
                median_itl_ms=10.0, p99_itl_ms=20.0, median_tpot_ms=11.0, median_e2el_ms=1500.0)
    return base | metrics | {"server": server, "request_rate": rate}


def two_servers() -> dict:
    return {"shape": "llama-8b", "commit": "abc1234", "input_len": 1024, "output_len": 128, "range_ratio": 0.5,
            "notes": ["vllm: rate 12 (180 prompts) skipped: over the 525 s budget"], "servers": {
                "kestrel": {"runs": [run("kestrel", "inf", request_throughput=24.0), run("kestrel", 6.0),
                                     run("kestrel", 12.0, p99_ttft_ms=300.0)]},
                "vllm": {"runs": [run("vllm", "inf", request_throughput=30.0, client_cpu_share=0.9),
                                  run("vllm", 6.0, median_itl_ms=12.5),
                                  run("vllm", 12.0, p99_ttft_ms=200.0)]}}}


def test_markdown_rows_ratios_and_verdicts():
    md = markdown(two_servers())
    lines = md.splitlines()
    rows = [ln for ln in lines if ln.startswith("| ")][1:]  # without the header
    assert [r.split(" | ")[:2] for r in rows] == [
        ["| 6 req/s", "Kestrel"], ["| 6 req/s", "vLLM"], ["| 6 req/s", "Kestrel / vLLM"],
        ["| 12 req/s", "Kestrel"], ["| 12 req/s", "vLLM"], ["| 12 req/s", "Kestrel / vLLM"],
        ["| saturation (all at once)", "Kestrel"], ["| saturation (all at once)", "vLLM"],
        ["| saturation (all at once)", "Kestrel / vLLM"]]
    ratio_6 = rows[2].strip("| ").split(" | ")[2:]
    assert ratio_6[4] == "0.80x" and ratio_6[0] == "1.00x"  # ITL p50 10 / 12.5; req/s equal
    assert rows[5].strip("| ").split(" | ")[2 + 3] == "1.50x"  # TTFT p99 300 / 200 at 12 req/s
    assert "- 6 req/s: TTFT and ITL p50/p99 at or below vLLM's: yes" in lines
    assert "- 12 req/s: TTFT and ITL p50/p99 at or below vLLM's: no (p99_ttft_ms)" in lines
    assert "- saturation throughput at least vLLM's: no (24.00 vs 30.00 req/s)" in lines
    assert "- vllm: rate 12 (180 prompts) skipped: over the 525 s budget" in lines
    assert "- the client used over 70% of a core in: vLLM at inf (its timestamps lag there; latencies overstated)" \
        in lines


def test_markdown_one_server_has_no_ratio_rows():
    result = two_servers()
    del result["servers"]["vllm"]
    md = markdown(result)
    assert "Kestrel / vLLM" not in md and "at or below" not in md and md.count("| Kestrel |") == 3


def test_rate_plan():
    args = Namespace(min_prompts=50, run_seconds=15)
    assert rate_runs([20.0, 5.0], args) == [(5.0, 75), (20.0, 300)]
    assert rate_runs([1.0], args) == [(1.0, 50)]
    assert auto_rates({"request_throughput": 31.7}, [0.25, 0.5, 0.75]) == [7.9, 15.8, 23.8]
    assert auto_rates({"request_throughput": 0.0}, [0.25, 0.5]) == [0.1]  # never a zero rate


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    line = plot(two_servers(), tmp_path / "p.png")
    assert line.startswith("no PNG: matplotlib is not installed") and not (tmp_path / "p.png").exists()


def test_plot_png(tmp_path):
    pytest.importorskip("matplotlib")
    assert plot(two_servers(), tmp_path / "p.png") == f"wrote {tmp_path / 'p.png'}"
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


FAKE_VLLM = """import os, sys
# stands in for vLLM's OpenAI server on the CPU: `kestrel serve` with the flags the driver gives vLLM
args = sys.argv[1:]
model = args.pop(args.index("--model") + 1)
args.remove("--model")
seed = args.index("--seed")
del args[seed:seed + 2]
os.execv(sys.executable, [sys.executable, "-m", "kestrel.cli", "serve", model, *args])
"""


def fake_vllm(root):
    pkg = root / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(FAKE_VLLM)
    return root


def test_whole_run_both_servers_on_cpu(tmp_path):
    """Both halves end to end, the vLLM one played by `kestrel serve` behind a fake vllm package on the vLLM
    server's own PYTHONPATH (--vllm-pythonpath): same folder, same rates, ratios and verdicts in the table."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "benchmarks.serve_side_by_side", "--shape", "smoke", "--rate-fractions",
                        "0.1,0.2", "--saturation-prompts", "8", "--run-seconds", "2", "--min-prompts", "4",
                        "--input-len", "16", "--output-len", "8", "--max-model-len", "256", "--warmups", "2",
                        "--client-processes", "2", "--out", str(out), "--vllm-pythonpath", str(fake_vllm(tmp_path)),
                        "--kestrel-args", "--cpu-threads 1 --num-kv-blocks 96",
                        "--vllm-args", "--cpu-threads 1 --num-kv-blocks 96"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((out / "serve_side_by_side.json").read_text())
    sat = result["servers"]["kestrel"]["runs"][0]["request_throughput"]
    rates = [max(0.1, round(f * sat, 1)) for f in (0.1, 0.2)]
    assert result["rates"] == result["servers"]["kestrel"]["auto_rates"] == sorted(set(rates))
    for name in ("kestrel", "vllm"):
        runs = result["servers"][name]["runs"]
        assert [x["request_rate"] for x in runs] == ["inf", *result["rates"]]  # the same rates for both
        assert [x["num_prompts"] for x in runs] == [8] + [max(4, round(2 * x)) for x in result["rates"]]
        assert all(x["completed"] == x["num_prompts"] and x["exit_status"] == 0 for x in runs)
        assert all(0 < x["client_cpu_share"] < 2 and x["client_processes"] == 2 for x in runs)
        assert result["servers"][name]["startup_s"] > 0 and (out / f"{name}_serve.log").exists()
    # both served the same requests: the same token totals, run by run
    assert [x["total_output_tokens"] for x in result["servers"]["kestrel"]["runs"]] == \
        [x["total_output_tokens"] for x in result["servers"]["vllm"]["runs"]]
    md = (out / "serve_side_by_side.md").read_text()
    assert md.count("| Kestrel / vLLM |") == 1 + len(result["rates"]) and "saturation throughput at least" in md
    assert result["notes"] == []


def test_nothing_starts_past_the_budget(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "benchmarks.serve_side_by_side", "--shape", "smoke", "--budget-s", "1",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "serve_side_by_side.json").read_text())
    assert [n.split(":")[0] for n in result["notes"]] == ["kestrel", "vllm"]
    assert all("not started" in n for n in result["notes"]) and result["servers"]["kestrel"]["runs"] == []
    assert "incomplete: kestrel: not started" in r.stdout
