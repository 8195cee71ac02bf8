"""The Ray executor on a local one-node cluster: one Ray head on 127.0.0.1 for the whole module (two CPUs: one
placement-group bundle per worker; Ray start-up is the slow part), joined with --distributed-executor-backend ray
and TP = 2; the greedy tokens of every family equal TP = 1's; the head is stopped at the end."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kestrel.distributed import free_port
from tests.tp import engine, greedy, prompts

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]


def ray_cli() -> str:
    return shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """`ray start --head --block` as our child: stopping it (SIGTERM) stops this head's processes only, in about
    2 s (`ray stop` waits ~7 s here, and would stop every Ray cluster on the machine)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    temp = tmp_path_factory.mktemp("ray")
    log = temp / "head.log"
    with open(log, "wb") as out:
        head = subprocess.Popen([ray_cli(), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                                 f"--port={port}", "--num-cpus=2", "--num-gpus=0", "--include-dashboard=false",
                                 "--disable-usage-stats", f"--temp-dir={temp}"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while b"Ray runtime started" not in log.read_bytes():
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Ray head did not start (exit code {head.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()


# Llama (a replicated KV head), Qwen3 (odd vocab), Qwen3-MoE (experts split), Qwen2-MoE (shared experts, tied
# embeddings): tests/tp.py says what each one exercises
@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_ray_tp2_matches_tp1(name, ray_head, tp_checkpoint, tp1_tokens):
    eng = engine(tp_checkpoint(name), 2, distributed_executor_backend="ray", ray_address=ray_head)
    try:
        assert type(eng.core.executor).__name__ == "RayExecutor"
        assert greedy(eng, prompts()) == tp1_tokens(name)
    finally:
        eng.core.shutdown()
    assert not eng.core.executor._actors  # actors killed, placement group removed
