"""Tensor parallelism on the CPU (gloo): TP = 2 through the mp executor gives the greedy tokens of TP = 1 (the
in-process runner; the references are shared with the Ray test, tests/conftest.py) for Llama, Qwen3 and Qwen3-MoE;
each rank reads about half of the checkpoint; a worker killed mid-generation fails the step within 5 s naming its
rank, and every worker process is gone afterwards; a request that comes just after a worker died fails at once (its
step message is never waited on: issue 55 item 12). One TP = 2 engine per model (process start-up dominates); the
kill test reuses the Qwen3 engine last."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from kestrel.config import EngineConfig
from kestrel.distributed import ParallelInfo
from kestrel.core.sampling_params import SamplingParams
from kestrel.errors import ConfigError
from kestrel.executor import WorkerError
from kestrel.loader import load_model
from kestrel.loader.safetensors import iter_safetensors
from tests.tp import engine, greedy, prompts

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def qwen3_path(tp_checkpoint):
    return tp_checkpoint("qwen3")


@pytest.fixture(scope="module")
def qwen3_tp2(qwen3_path):
    eng = engine(qwen3_path, 2, async_scheduling="on")  # pipelined: step N+1 is sent before N's reply is read
    yield eng
    eng.core.shutdown()


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "minimax_m2", "minimax_m2_mqa", "gemma4_moe",
                                  "gemma4_kv_shared", "glm4"])
def test_tp2_matches_tp1(name, tp_checkpoint, tp1_tokens):
    eng = engine(tp_checkpoint(name), 2)
    try:
        assert not hasattr(eng.core, "runner") and type(eng.core.executor).__name__ == "MPExecutor"
        assert greedy(eng, prompts()) == tp1_tokens(name)
    finally:
        eng.core.shutdown()


def test_qwen3_tp2_matches_tp1(qwen3_path, qwen3_tp2, tp1_tokens):
    assert qwen3_tp2.core.pipelined
    assert qwen3_tp2.core.executor.dist_backend == "gloo" and qwen3_tp2.core.executor.cuda_graph_sizes == [[], []]
    assert greedy(qwen3_tp2, prompts()) == tp1_tokens("qwen3")
    total = sum(t.numel() * t.element_size() for _, t in iter_safetensors(qwen3_path, progress=False))
    for rank, n in enumerate(qwen3_tp2.core.executor.bytes_read):
        assert 0.45 * total < n < 0.55 * total, (rank, n, total)


def test_grammar_bitmask_reaches_every_rank(qwen3_path, qwen3_tp2):
    """Constrained sampling: the step waits for the host's bitmask and goes to the workers with it."""
    import re

    from kestrel.core.sampling_params import StructuredOutputsParams

    regex = r"[0-9]{2}-(fox|dog)"

    def run(eng):
        rid = eng.add_request("The quick brown fox", SamplingParams(
            temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=regex)))
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished and o.request_id == rid:
                    return o.outputs[0].text

    text = run(qwen3_tp2)
    assert re.fullmatch(regex, text), text
    assert text == run(engine(qwen3_path, 1))


def test_each_rank_reads_its_shard(tiny_models):
    """Loading rank r of N materialises only its rows/columns of each tensor (norms are replicated)."""
    path = tiny_models["llama"]
    cfg = EngineConfig.create(model=str(path), dtype="float32")
    total = sum(t.numel() * t.element_size() for _, t in iter_safetensors(path, progress=False))
    full = load_model(cfg.model, torch.device("cpu"), progress=False)
    assert full.bytes_read == total
    for size in (2, 4):
        per_rank = [load_model(cfg.model, torch.device("cpu"), progress=False, parallel=ParallelInfo(r, size))
                    for r in range(size)]
        for r, m in enumerate(per_rank):
            assert m.bytes_read < 1.1 * total / size, (size, r, m.bytes_read, total)
        # the ranks' shards tile the full weights: o_proj columns of rank 1 are the full o_proj's second half
        o_full = full.model.layers[0].self_attn.o_proj.weight
        cols = o_full.shape[1] // size
        for r, m in enumerate(per_rank):
            assert torch.equal(m.model.layers[0].self_attn.o_proj.weight, o_full[:, r * cols:(r + 1) * cols])


def test_worker_death_fails_the_step_naming_the_rank(qwen3_tp2):
    eng, ex = qwen3_tp2, qwen3_tp2.core.executor
    for p in prompts():
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    eng.step()
    eng.step()
    os.kill(ex.worker_pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1"):
        for _ in range(100):
            eng.step()
    assert time.monotonic() - t0 < 5
    for p in ex._procs:  # the surviving rank was stopped too
        assert p.poll() is not None
    with pytest.raises(WorkerError, match="rank 1"):  # the engine stays dead
        eng.core.executor.check_health()


def test_unsplittable_model_is_refused_before_workers_start(tiny_models):
    with pytest.raises(ConfigError, match="num_attention_heads = 4 is not divisible by --tensor-parallel-size 3"):
        engine(tiny_models["llama"], 3)
    with pytest.raises(ConfigError, match="uni runs one process"):
        engine(tiny_models["llama"], 2, distributed_executor_backend="uni")


@pytest.mark.parametrize("pipelined", ["on", "off"])
def test_a_request_just_after_a_worker_died_fails_at_once(qwen3_path, pipelined):
    """Issue 55 item 12: an idle engine whose worker has just died took the next request's step to the workers:
    the step message to the dead rank blocked (its socket has no peer left), so the request waited for the 30 s
    hang timeout. Now the step fails at once naming the rank."""
    eng = engine(qwen3_path, 2, async_scheduling=pipelined)
    ex = eng.core.executor

    def hung(*_):
        raise TimeoutError("the step hung")

    old = signal.signal(signal.SIGALRM, hung)
    try:
        greedy(eng, prompts()[:1], 2)
        os.kill(ex.worker_pids[1], signal.SIGKILL)
        time.sleep(0.5)  # the worker is gone before the next request comes
        signal.alarm(20)
        t0 = time.monotonic()
        eng.add_request(prompts()[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        with pytest.raises(WorkerError, match="rank 1"):
            for _ in range(100):
                eng.step()
        assert time.monotonic() - t0 < 5
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        eng.core.shutdown()
    for p in ex._procs:
        assert p.poll() is not None
