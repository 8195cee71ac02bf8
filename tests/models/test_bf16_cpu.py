"""bf16 on the CPU (reference attention): per-token greedy agreement with transformers in bf16."""
import pytest
import torch

from kestrel import LLM
from tests.agreement import MIXED_PROMPTS, teacher_forced_agreement

PROMPTS = MIXED_PROMPTS


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_bf16_teacher_forced_agreement(tiny_models, kind):
    from transformers import AutoModelForCausalLM

    path = str(tiny_models[kind])
    llm = LLM(path, dtype="bfloat16", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for p in PROMPTS:
        agree, lp_err, tol = teacher_forced_agreement(llm, hf, p, 32, "cpu")
        assert agree >= 30, (kind, p, agree)
        assert lp_err < tol, (kind, p, lp_err, tol)
