"""Issue 36: the offline commands (generate, chat, bench) and LLM(...) apply --cpu-threads; without it a small
machine leaves one core to the rest (torch's default thread count made decode steps ~9x slower under load)."""
from __future__ import annotations

import pytest
import torch

from kestrel.config import EngineConfig
from kestrel.platform import cpu_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _small(model) -> list[str]:
    return ["--model", str(model), "--max-tokens", "2", "--num-kv-blocks", "16", "--max-model-len", "64"]


@pytest.mark.parametrize("threads", [1, 3])
def test_generate_and_chat_apply_cpu_threads(tiny_llama, threads, restore_threads, capsys):
    from kestrel.cli import main

    torch.set_num_threads(2)
    assert main(["generate", *_small(tiny_llama), "--cpu-threads", str(threads), "hello"]) == 0
    assert torch.get_num_threads() == threads
    torch.set_num_threads(2)
    assert main(["chat", *_small(tiny_llama), "--cpu-threads", str(threads), "--message", "hi"]) == 0
    assert torch.get_num_threads() == threads


def test_bench_applies_cpu_threads(tiny_llama, restore_threads, capsys):
    from kestrel.cli import main

    torch.set_num_threads(2)
    assert main(["bench", "latency", "--model", str(tiny_llama), "--input-len", "4", "--output-len", "2",
                 "--num-iters", "1", "--num-kv-blocks", "16", "--max-model-len", "64", "--cpu-threads", "3"]) == 0
    assert torch.get_num_threads() == 3


def test_llm_applies_cpu_threads(tiny_llama, restore_threads):
    from kestrel import LLM

    torch.set_num_threads(2)
    LLM(str(tiny_llama), progress=False, num_kv_blocks=16, max_model_len=64, cpu_threads=3)
    assert torch.get_num_threads() == 3


@pytest.mark.parametrize("cores,torch_default,want", [(1, 1, 1), (2, 2, 1), (4, 4, 3), (16, 8, 8)])
def test_offline_default(cores, torch_default, want, monkeypatch, restore_threads):
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: cores)
    torch.set_num_threads(torch_default)
    assert cpu_threads.offline_threads(EngineConfig()) == want
    assert cpu_threads.offline_threads(EngineConfig.create(cpu_threads=5)) == 5
