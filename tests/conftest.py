import logging
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)
logging.getLogger("kestrel").setLevel(logging.WARNING)

from tests.tiny import CONFIGS, make_checkpoint, make_tokenizer  # noqa: E402


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
