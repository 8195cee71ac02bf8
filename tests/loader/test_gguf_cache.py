"""The embedded SmolLM2 GGUF: the first load keeps a dequantised copy on disk, later loads read it (faster, with a
progress bar) and give the same weights and tokenizer."""
from __future__ import annotations

import logging
import time

import pytest
import torch

from kestrel.config import ModelConfig
from kestrel.loader import default_model_path, load_model


@pytest.mark.slow
def test_gguf_dequantised_copy(tmp_path, caplog, capfd):
    caplog.set_level(logging.INFO, logger="kestrel.loader")
    cfg = ModelConfig(model=default_model_path(), gguf_cache_dir=str(tmp_path / "cache"))
    t0 = time.perf_counter()
    first = load_model(cfg, torch.device("cpu"), progress=False)
    t_first = time.perf_counter() - t0
    assert "dequantised copy written" in caplog.text
    (folder,) = (tmp_path / "cache").iterdir()
    assert (folder / "float32" / "config.json").exists() and (folder / "tokenizer").is_dir()
    capfd.readouterr()
    t0 = time.perf_counter()
    second = load_model(cfg, torch.device("cpu"), progress=True)
    t_second = time.perf_counter() - t0
    assert "reading the dequantised copy" in caplog.text
    assert "Loading weights" in capfd.readouterr().err  # the progress bar
    assert t_second < t_first / 3, (t_first, t_second)
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    assert first.tokenizer.encode(text) == second.tokenizer.encode(text)
    assert first.tokenizer.chat_template == second.tokenizer.chat_template
