"""The text part of Qwen3.5 vision-language checkpoints (Qwen3_5ForConditionalGeneration and its MoE form):
loaded through our loader with the vision tower and the MTP head skipped (one log line each), greedy tokens
identical to transformers' vision-language model on text prompts (CPU, float32; its M-RoPE with t = h = w is
plain RoPE), and an image request refused with a 400 (InvalidRequest) that names the reason."""
import logging

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.errors import InvalidRequest
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


def test_text_part_matches_transformers_and_refuses_images(checkpoint, caplog):
    from PIL import Image

    with caplog.at_level(logging.INFO, logger="kestrel.models.gated_deltanet"):
        llm = LLM(str(checkpoint), progress=False, max_model_len=256)
    logged = [r.getMessage() for r in caplog.records if r.name == "kestrel.models.gated_deltanet"]
    assert len([m for m in logged if "model.visual" in m]) == 1
    assert len([m for m in logged if "Skipped 2 mtp.* tensors" in m]) == 1
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_text_greedy(checkpoint)
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    with pytest.raises(InvalidRequest, match="vision tower of Qwen3.5 checkpoints is not supported yet") as e:
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": image}}, SamplingParams(max_tokens=2))
    assert e.value.param == "multi_modal_data"
    chat = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "hi"}]}]
    with pytest.raises(InvalidRequest, match="does not take images: the vision tower"):
        llm.chat(chat, SamplingParams(max_tokens=2))
