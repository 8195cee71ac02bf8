"""Acceptance 3: benchmarks/serve.py (through `kestrel bench serve`) with a small N, disconnects included; the
script itself asserts through /metrics that nothing is left running and the KV pool is full again."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT, http


def test_bench_serve_small(server):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "kestrel.cli", "bench", "serve", "--url", server.url,
                        "--num-requests", "12", "--concurrency", "4", "--disconnect-fraction", "0.34",
                        "--output-len", "16:48", "--seed", "1"],
                       capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for row in ("requests/s", "TTFT p50 / p90 / p99 (ms)", "ITL p50 / p90 / p99 (ms)", "OK: engine idle, KV pool full"):
        assert row in out, out
    line = next(ln for ln in out.splitlines() if ln.startswith("completed / disconnected / errors"))
    completed, disconnected, errors = (int(x) for x in line.split()[-5::2])
    assert completed + disconnected == 12 and disconnected >= 1 and errors == 0, line
    _, text = http("GET", server.url + "/metrics")
    assert 'vllm:num_requests_running{engine="0",model_name="llama"} 0.0' in text
