"""benchmarks/gpu_fp8.py keeps working: its --cpu-smoke mode runs every section on a fake sm_90 on the CPU."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_fp8_benchmark_cpu_smoke():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_fp8", "--cpu-smoke"],
        cwd=ROOT,  # the benchmarks run as modules from the repository root
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for heading in ("## Correctness", "## GEMM only", "## Layer forward"):
        assert heading in out.stdout
    assert "FAIL" not in out.stdout and "correctness: all ok" in out.stdout
    assert "| torch_scaled_mm | per_channel_token |" in out.stdout
