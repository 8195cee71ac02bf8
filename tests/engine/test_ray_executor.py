"""The Ray executor on a local one-node cluster: the test starts a Ray head on 127.0.0.1 (two CPUs: one
placement-group bundle per worker), joins it with --distributed-executor-backend ray and TP = 2, checks the greedy
tokens against TP = 1, and stops the head."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kestrel.distributed import free_port
from tests.engine.test_tensor_parallel import engine, greedy, prompts
from tests.tiny import make_checkpoint

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]


def ray_cli() -> str:
    return shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    temp = tmp_path_factory.mktemp("ray")
    subprocess.run([ray_cli(), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                    "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
                   check=True, env=env, capture_output=True, timeout=120)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray_cli(), "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_ray_tp2_matches_tp1(ray_head, tmp_path, tiny_tokenizer):
    # Qwen2-MoE: shared experts (a column/row-parallel MLP under TP) with their sigmoid gate, a dense layer, and
    # tied embeddings (the vocab-parallel LM head shares the embedding's slice)
    path = make_checkpoint("qwen2_moe", tmp_path, tokenizer=tiny_tokenizer, tie_word_embeddings=True)
    ref = greedy(engine(path, 1), prompts())
    eng = engine(path, 2, distributed_executor_backend="ray", ray_address=ray_head)
    try:
        assert type(eng.core.executor).__name__ == "RayExecutor"
        assert greedy(eng, prompts()) == ref
    finally:
        eng.core.shutdown()
    assert not eng.core.executor._actors  # actors killed, placement group removed
