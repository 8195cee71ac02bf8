"""Acceptance on the embedded SmolLM2-135M-Instruct (CPU): n-gram speculation on copy-heavy prompts gives the
tokens of the same engine without it, greedy and seeded, in a mixed batch with chunked prefill and with
preemption forced, and its drafts are accepted."""
import pytest

from kestrel import LLM, SamplingParams
from tests.models.test_smollm2_gguf import gguf_path  # noqa: F401  (the fixture)

TEXT = ("The quick brown fox jumps over the lazy dog. Alice sent Bob the report on Monday, and Bob forwarded "
        "it to Carol on Tuesday. ")
PROMPTS = [f"Repeat this text exactly, twice: {TEXT}", f"Copy the following sentence word for word: {TEXT}",
           "List the days of the week, then list them again in the same order.",
           f"Summarise in one sentence: {TEXT * 2}"]


def chat(llm):
    tok = llm.engine.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in PROMPTS]


def params():
    return [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
            SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=48, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=48),
            SamplingParams(temperature=0.7, seed=99, max_tokens=40, ignore_eos=True)]


@pytest.mark.slow
@pytest.mark.parametrize("opts", [dict(max_num_batched_tokens=64), dict(num_kv_blocks=14, block_size=16)],
                         ids=["chunked-prefill", "preemption"])
def test_ngram_same_tokens_as_without_speculation(gguf_path, opts):
    plain = LLM(str(gguf_path), progress=False, **opts)
    prompts = chat(plain)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params())]
    spec = LLM(str(gguf_path), progress=False, speculative_config={"method": "ngram", "num_speculative_tokens": 4},
               **opts)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params())]
    assert got == ref
    sp = spec.engine.core.speculation
    assert sp.num_accepted_tokens > 0.2 * sp.num_draft_tokens  # copying: many drafts are right
    if "num_kv_blocks" in opts:
        assert spec.engine.core.scheduler.num_preemptions > 0
        assert plain.engine.core.scheduler.num_preemptions > 0
