"""Qwen3.5 vision-language checkpoints (Qwen3_5ForConditionalGeneration and its MoE form) on text prompts given as
token ids: loaded through our loader with the MTP head skipped (one log line), greedy tokens identical to
transformers' vision-language model (CPU, float32; its M-RoPE with t = h = w is plain RoPE). Images:
tests/models/test_qwen3_5_vl.py."""
import logging

import pytest
import torch

from kestrel import LLM, SamplingParams
from tests.tiny import qwen3_5_vl_checkpoint

NUM_TOKENS = 24
PROMPTS = [[5, 17, 99, 3], list(range(10, 40)), [77]]


@pytest.fixture(scope="module", params=["dense", "moe"])
def checkpoint(request, tmp_path_factory, tiny_tokenizer):
    return qwen3_5_vl_checkpoint(tmp_path_factory.mktemp("qwen3_5_vl"), moe=request.param == "moe",
                                 tokenizer=tiny_tokenizer)


def hf_text_greedy(path) -> list[list[int]]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        seq = model.generate(torch.tensor([p]), max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        out.append(seq[0, len(p):].tolist())
    return out


def test_text_matches_transformers(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="kestrel.models.gated_deltanet"):
        llm = LLM(str(checkpoint), progress=False, max_model_len=256)
    logged = [r.getMessage() for r in caplog.records if r.name == "kestrel.models.gated_deltanet"]
    assert len([m for m in logged if "Skipped 2 mtp.* tensors" in m]) == 1
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_text_greedy(checkpoint)
