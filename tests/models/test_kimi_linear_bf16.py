"""Kimi Linear in bf16 on the CPU, teacher-forced against transformers in float32 on weights that bf16 holds
exactly (so every difference is arithmetic), on the GPU test's checkpoints (tests/tiny.py
kimi_linear_bf16_checkpoint, KDA heads of 128) over 8 seeds.

Between its bf16 projections a KDA layer keeps everything float32: the short convolution's output, the L2 norms,
the gates, the chunked delta rule and its state (the bf16 output is rounded once). Transformers' own bf16 run
rounds the convolution's output to bf16, as this engine did before: its typical (median) logprob error was then
level with transformers' bf16 (0.95x over these 8 checkpoints' 1024 positions) and is now 0.74x. One rounding
flip of a near-tied MoE route moves a position by a whole expert's share in either run, hence medians over many
positions."""
import statistics

import pytest
import torch

from kestrel import LLM
from tests.agreement import MIXED_PROMPTS, same_dtype_reference_errors, teacher_forced_errors
from tests.tiny import kimi_linear_bf16_checkpoint

SEEDS = range(8)
N = 32


@pytest.fixture(scope="module")
def kimi_errors(tmp_path_factory, tiny_tokenizer):
    """Over the checkpoint seeds: (our errors, transformers-bf16 errors, per-prompt agreements) on the exact
    model's greedy continuations of MIXED_PROMPTS."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("kimi_bf16")
    ours, theirs, agreements = [], [], []
    for seed in SEEDS:
        path = kimi_linear_bf16_checkpoint(root, seed, tiny_tokenizer, name=f"seed{seed}")
        llm = LLM(str(path), dtype="bfloat16", progress=False, max_model_len=256)
        exact = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        for p in MIXED_PROMPTS:
            agree, errors, _, _ = teacher_forced_errors(llm, exact, p, N, "cpu")
            ours += errors
            theirs += same_dtype_reference_errors(exact, hf_bf16, p, N, "cpu")
            agreements.append(agree)
        llm.engine.core.shutdown()
    return ours, theirs, agreements


def test_bf16_more_precise_than_transformers_bf16(kimi_errors):
    ours, theirs, agreements = kimi_errors
    ratio = statistics.median(ours) / statistics.median(theirs)
    assert ratio < 0.88, (statistics.median(ours), statistics.median(theirs))
    assert sum(agreements) >= 0.93 * N * len(agreements), agreements  # 965 of 1024 measured (958 before)
