import logging
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# one torch thread per pytest-xdist worker (make test runs two on the 2-core CI machine), else both cores
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
logging.getLogger("kestrel").setLevel(logging.WARNING)

from kestrel.bench.tiny_tokenizer import make_tokenizer  # noqa: E402
from tests.tiny import CONFIGS, make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tiny_tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {k: make_checkpoint(k, root, tokenizer=tiny_tokenizer) for k in CONFIGS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


def pytest_runtest_logreport(report):
    """With KESTREL_FAILURE_LOG set, each failure's traceback is appended to that file as it happens, so a run stopped
    at a time budget (benchmarks/gpu_tests.py on the GPU machine) still shows why its tests failed."""
    path = os.environ.get("KESTREL_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):  # once: in the xdist controller
        with open(path, "a") as log:
            log.write(f"\n===== {report.nodeid} ({report.when}) =====\n{report.longreprtext[-6000:]}\n")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_mm_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random PaliGemma and LLaVA-NeXT checkpoints with their processors (tests/mm_tiny.py)."""
    from tests.mm_tiny import make_llava_next, make_paligemma

    root = tmp_path_factory.mktemp("tiny_mm_models")
    return {"paligemma": make_paligemma(root), "llava_next": make_llava_next(root)}


@pytest.fixture(scope="session")
def tp_checkpoint(tmp_path_factory, tiny_tokenizer):
    """name (tests/tp.py TP_MODELS) -> a checkpoint folder, built once per session on first use."""
    from tests.tp import TP_MODELS

    root, built = tmp_path_factory.mktemp("tp_models"), {}

    def get(name: str):
        if name not in built:
            kind, overrides = TP_MODELS[name]
            built[name] = make_checkpoint(kind, root, tokenizer=tiny_tokenizer, name=name, **overrides)
        return built[name]

    return get


@pytest.fixture(scope="session")
def tp1_tokens(tp_checkpoint):
    """name -> the TP = 1 (in-process runner) greedy tokens on tests/tp.py's prompts: the reference every
    executor's TP = 2 is compared with, computed once per session."""
    from tests.tp import engine, greedy, prompts

    done = {}

    def get(name: str):
        if name not in done:
            eng = engine(tp_checkpoint(name), 1)
            done[name] = greedy(eng, prompts())
            eng.core.shutdown()
        return done[name]

    return get
