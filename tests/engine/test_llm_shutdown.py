"""LLM.shutdown gives the engine's memory back at once, even where the runner sits in a reference cycle (on CUDA
the graph sets and the runner refer to each other): a second engine must fit in the same process."""
from __future__ import annotations

import gc
import weakref

import pytest

from kestrel import LLM, SamplingParams
from tests.tiny import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_checkpoint("qwen3", tmp_path_factory.mktemp("shutdown")))


def _model_ref(llm: LLM) -> weakref.ref:
    runner = llm.engine.core.executor.runner
    runner.cycle = runner  # as a captured graph set holds its runner
    return weakref.ref(runner.model)


def test_shutdown_frees_the_model_despite_a_cycle(checkpoint):
    llm = LLM(checkpoint, progress=False)
    assert len(llm.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3
    model = _model_ref(llm)
    gc.collect()
    gc.disable()  # no automatic collection may do shutdown's work
    try:
        llm.shutdown()
        assert model() is None
        llm.shutdown()  # idempotent
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["hello"], SamplingParams(max_tokens=2))


def test_context_manager_shuts_down(checkpoint):
    gc.collect()
    gc.disable()
    try:
        with LLM(checkpoint, progress=False) as llm:
            model = _model_ref(llm)
        assert model() is None
    finally:
        gc.enable()
    with pytest.raises(AttributeError, match="no_such_thing"):
        llm.no_such_thing
