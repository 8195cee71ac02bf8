"""Random weights from a config.json alone (no tokenizer): the async engine serves token-id prompts and refuses text
with a 400-type error naming the prompt; the server refuses to start; benchmarks/dp_throughput.py runs one engine
core, then two, each getting half of the requests."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kestrel.config import EngineConfig
from kestrel.frontend.async_engine import AsyncEngine
from kestrel.ipc.core_client import InprocClient
from kestrel.core.sampling_params import SamplingParams
from kestrel.errors import InvalidRequest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def config_only(tiny_llama, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("config_only")
    shutil.copy(tiny_llama / "config.json", d / "config.json")
    return d


async def test_async_engine_without_tokenizer_takes_token_ids(config_only):
    cfg = EngineConfig.create(model=str(config_only), load_format="dummy", num_kv_blocks=32, max_model_len=128,
                              cpu_threads=1)
    engine = await AsyncEngine(cfg, InprocClient(cfg)).start()
    try:
        assert engine.tokenizer is None
        params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0, detokenize=False)
        outs = [o async for o in engine.generate([5, 17, 99, 3], params)]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
        with pytest.raises(InvalidRequest, match="no tokenizer.*send token ids") as e:
            engine.generate("Hello", params)
        assert e.value.param == "prompt"
    finally:
        await engine.shutdown()


async def test_server_without_tokenizer_refuses_to_start(config_only):
    from kestrel.errors import ConfigError
    from kestrel.server.app import build_app

    cfg = EngineConfig.create(model=str(config_only), load_format="dummy", num_kv_blocks=32, max_model_len=128,
                              cpu_threads=1)
    app = build_app(cfg, client="inproc")
    with pytest.raises(ConfigError, match="needs a tokenizer.*pass --tokenizer"):
        async with app.router.lifespan_context(app):
            pass
    assert app.state.kestrel.engine.client._closed  # the engine shut down before the error


def test_dp_throughput_two_engines_share_the_requests(config_only, tmp_path):
    out = tmp_path / "dp.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.dp_throughput", "--model", str(config_only),
                          "--num-requests", "8", "--input-len", "4:16", "--output-len", "4:12", "--json", str(out)],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    res = json.loads(out.read_text())
    assert [r["data_parallel_size"] for r in res["runs"]] == [1, 2]
    assert res["runs"][0]["requests_per_engine"] == "8"
    assert sorted(map(int, res["runs"][1]["requests_per_engine"].split("/"))) == [4, 4]  # least-loaded routing
    assert "data parallel 2 / one engine core" in run.stdout
