"""Greedy tokens and top-5 logprobs agree with transformers on the same weights (CPU, float32)."""
import pytest
import torch

from kestrel import LLM, SamplingParams
from tests.agreement import MIXED_PROMPTS, assert_embedding_contract

PROMPTS = MIXED_PROMPTS
NUM_TOKENS = 32
LOGPROB_TOL = 1e-4


def hf_greedy(path, prompts, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        tokens = out.sequences[0, len(p):].tolist()
        logprobs = [l[0].float().log_softmax(-1) for l in out.logits]
        results.append((tokens, logprobs))
    return results


@pytest.mark.parametrize("kind", ["llama", "llama_gqa_llama3", "llama_linear_rope", "llama_yarn", "qwen2", "qwen3"])
def test_greedy_and_logprobs_match_transformers(tiny_models, kind):
    path = tiny_models[kind]
    llm = LLM(str(path), progress=False)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    ours = llm.generate(PROMPTS, params)
    ref = hf_greedy(path, PROMPTS, NUM_TOKENS)
    for o, (tokens, logprobs) in zip(ours, ref):
        c = o.outputs[0]
        assert c.token_ids == tokens
        for step, (entry, ref_lp) in enumerate(zip(c.logprobs, logprobs)):
            top_vals, top_ids = ref_lp.topk(5)
            for tid, val in zip(top_ids.tolist(), top_vals.tolist()):
                assert tid in entry, f"step {step}: token {tid} missing from our top-5"
                assert abs(entry[tid].logprob - val) < LOGPROB_TOL


def test_embedding_contract(tiny_models):
    """forward(input_ids) == forward(inputs_embeds=embed_input_ids(input_ids)) for every model family."""
    for kind in ["llama", "qwen2", "qwen3", "gemma", "gemma3", "deepseek_v2_lite", "deepseek_v3"]:
        assert_embedding_contract(tiny_models[kind])
