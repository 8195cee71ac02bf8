"""GPU checks of EAGLE-3 speculation (skipped without CUDA), bf16 on the Triton backend: with a random draft the
greedy output, teacher-forced through the plain engine, is its argmax at >= 30 of 32 positions (as for n-gram); a
draft that copies its bigram target is accepted almost always (a bf16 near-tie may flip a draft)."""
import pytest

from kestrel import LLM, SamplingParams
from tests.agreement import MIXED_PROMPTS
from tests.gpu.test_gpu_spec_decode import KV_BLOCKS, teacher_forced_agree
from tests.spec_decode.eagle3_tiny import eagle3_draft, eagle3_target

pytestmark = pytest.mark.gpu


def eagle3(path, k):
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": k}


def test_random_draft_greedy_teacher_forced(tmp_path, tiny_tokenizer):
    target = eagle3_target(tmp_path, tokenizer=tiny_tokenizer, hidden_size=256, intermediate_size=512,
                           logit_scale=4.0)
    draft = eagle3_draft(tmp_path, target, "speculators", own_embed=True)
    plain = LLM(str(target), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS)
    llm = LLM(str(target), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS,
              speculative_config=eagle3(draft, 3))
    outs = llm.generate(MIXED_PROMPTS * 3, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for p, o in zip(MIXED_PROMPTS * 3, outs):
        assert teacher_forced_agree(plain, p, o.outputs[0].token_ids) >= 30, p
    assert llm.engine.core.speculation.num_draft_tokens > 0


def test_copying_draft_is_accepted(tmp_path, tiny_tokenizer):
    target = eagle3_target(tmp_path, bigram=True, tokenizer=tiny_tokenizer, hidden_size=256,
                           intermediate_size=512, logit_scale=4.0)
    llm = LLM(str(target), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS,
              speculative_config=eagle3(eagle3_draft(tmp_path, target, copy=True), 3))
    llm.generate(MIXED_PROMPTS * 4, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    sp = llm.engine.core.speculation
    assert sp.num_draft_tokens > 100 and sp.num_accepted_tokens >= 0.9 * sp.num_draft_tokens


def test_graphs_with_the_draft_loaded_equal_eager(tmp_path, tiny_tokenizer):
    """Decode graphs (above disable_by_batch_size) and verify graphs (below it) replay with the draft's capture in
    place, and the draft's chained forwards replay draft graphs over its KV cache: tokens and drafts as with
    enforce_eager (no graphs anywhere; tests/gpu/test_gpu_spec_decode.py)."""
    from tests.gpu.test_gpu_spec_decode import check_drafter_graphs_equal_eager

    target = eagle3_target(tmp_path, tokenizer=tiny_tokenizer, hidden_size=256, intermediate_size=512,
                           logit_scale=4.0)
    draft = eagle3_draft(tmp_path, target, "speculators", own_embed=True)
    runner = check_drafter_graphs_equal_eager(target, {**eagle3(draft, 3), "disable_by_batch_size": 4},
                                              MIXED_PROMPTS * 3)
    vg = next((g for g in runner.graph_sets if type(g).__name__ == "VerifyGraphSet"), None)
    assert runner.graphs.replays > 5 and vg is not None and vg.replays >= 3
    chained = runner.drafter.chained
    assert chained.graphs and chained.replays > 5


def test_copying_draft_is_accepted_on_long_prompts(tmp_path, tiny_tokenizer):
    """Prompts of 300 tokens, prefilled in chunks, on the Triton backend: the draft layer's own KV cache (written
    by prefill chunks, decodes and verify steps, read by the paged kernels) keeps the copying draft accepted."""
    import random

    target = eagle3_target(tmp_path, bigram=True, tokenizer=tiny_tokenizer, hidden_size=256,
                           intermediate_size=512, logit_scale=4.0)
    llm = LLM(str(target), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS, max_num_batched_tokens=128,
              speculative_config=eagle3(eagle3_draft(tmp_path, target, copy=True), 3))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(300)] for _ in range(6)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    sp = llm.engine.core.speculation
    assert sp.num_draft_tokens > 100 and sp.num_accepted_tokens >= 0.9 * sp.num_draft_tokens
