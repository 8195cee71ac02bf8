"""vLLM's offline API beyond generate / embed / classify / score: LLM.encode and LLM.reward on a tiny random
Qwen3ForSequenceClassification (equal to transformers' on the same weights, CPU float32), LLM.get_tokenizer,
LLM.sleep / wake_up, and `truncate_prompt_tokens` (keep the prompt's last k tokens; -1: max_model_len) on
generation and pooling requests."""
from __future__ import annotations

import pytest
import torch

from kestrel.errors import InvalidRequest
from tests.pooling_tiny import hf_class_logits, make_classifier
from tests.tiny import make_checkpoint

ATOL = 1e-5
PROMPT = "the cat sat on the mat and looked at the door"


def _llm(path, **kw):
    from kestrel import LLM

    return LLM(str(path), progress=False, device="cpu", num_kv_blocks=32, max_model_len=64, **kw)


@pytest.fixture(scope="module")
def classifier_llm(tmp_path_factory, tiny_tokenizer):
    path = make_classifier(tmp_path_factory.mktemp("reward"), tiny_tokenizer, num_labels=2, seed=5)
    return path, _llm(path)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, tiny_tokenizer):
    return _llm(make_checkpoint("llama", tmp_path_factory.mktemp("offline_llama"), tokenizer=tiny_tokenizer))


def test_encode_and_reward_equal_transformers(classifier_llm):
    from kestrel import PoolingParams

    path, llm = classifier_llm
    out = llm.encode([PROMPT, "hello"])
    assert len(out) == 2
    for o in out:
        assert isinstance(o.outputs.data, torch.Tensor) and o.outputs.data.dtype == torch.float32
        torch.testing.assert_close(o.outputs.data, hf_class_logits(path, o.prompt_token_ids).softmax(-1),
                                   atol=ATOL, rtol=0)
    raw = llm.encode(PROMPT, PoolingParams(task="classify", activation=False), pooling_task="classify")[0]
    torch.testing.assert_close(raw.outputs.data, hf_class_logits(path, raw.prompt_token_ids), atol=ATOL, rtol=0)
    reward = llm.reward(PROMPT)[0]  # a sequence reward: the head's raw outputs at the last token
    torch.testing.assert_close(reward.outputs.data, raw.outputs.data, atol=0, rtol=0)
    with pytest.raises(ValueError, match="'token_classify': per-token pooling is not implemented"):
        llm.encode(PROMPT, pooling_task="token_classify")
    with pytest.raises(ValueError, match="'embed': this model's pooling task is classify"):
        llm.encode(PROMPT, pooling_task="embed")


def test_pooling_truncate_prompt_tokens(classifier_llm, tiny_tokenizer):
    path, llm = classifier_llm
    full = list(tiny_tokenizer(PROMPT)["input_ids"])
    cut = llm.classify(PROMPT, truncate_prompt_tokens=3)[0]
    assert cut.prompt_token_ids == full[-3:]
    torch.testing.assert_close(torch.tensor(cut.outputs.probs), hf_class_logits(path, full[-3:]).softmax(-1),
                               atol=ATOL, rtol=0)
    assert llm.encode(PROMPT, truncate_prompt_tokens=-1)[0].prompt_token_ids == full  # -1: up to max_model_len
    with pytest.raises(InvalidRequest, match="truncate_prompt_tokens must be a positive integer, or -1"):
        llm.classify(PROMPT, truncate_prompt_tokens=0)
    with pytest.raises(InvalidRequest, match=r"truncate_prompt_tokens \(65\) is greater than max_model_len \(64\)"):
        llm.classify(PROMPT, truncate_prompt_tokens=65)


def test_generate_truncate_prompt_tokens(llm, tiny_tokenizer):
    from kestrel import SamplingParams

    full = list(tiny_tokenizer(PROMPT)["input_ids"])
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    cut = llm.generate(PROMPT, greedy.clone(truncate_prompt_tokens=4))[0]
    assert cut.prompt_token_ids == full[-4:]
    assert cut.outputs[0].token_ids == llm.generate([full[-4:]], greedy)[0].outputs[0].token_ids
    assert llm.generate(PROMPT, greedy.clone(truncate_prompt_tokens=-1))[0].prompt_token_ids == full


def test_get_tokenizer_sleep_and_wake_up(llm):
    from kestrel import SamplingParams

    assert llm.get_tokenizer() is llm.tokenizer and llm.get_tokenizer().encode("hi")
    params = SamplingParams(max_tokens=3, temperature=0.0)
    before = llm.generate("hello there", params)[0].outputs[0].token_ids
    llm.sleep(level=1)
    assert llm.is_sleeping()
    with pytest.raises(RuntimeError, match="asleep .*call wake_up"):
        llm.generate("hello there", params)
    assert not llm.engine.has_unfinished_requests()  # the refused prompts did not stay queued
    llm.wake_up(tags=["weights", "kv_cache"])
    assert not llm.is_sleeping()
    assert llm.generate("hello there", params)[0].outputs[0].token_ids == before
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
        llm.sleep(level=3)
