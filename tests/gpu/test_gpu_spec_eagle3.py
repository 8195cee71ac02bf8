"""GPU checks of EAGLE-3 speculation (skipped without CUDA), bf16 on the Triton backend: with a random draft the
greedy output, teacher-forced through the plain engine, is its argmax at >= 30 of 32 positions (as for n-gram); a
draft that copies its bigram target is accepted almost always (a bf16 near-tie may flip a draft)."""
import pytest
import torch

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
    place, and the draft's own k forwards replay draft graphs: tokens and drafts as with enforce_eager (no graphs
    anywhere; tests/gpu/test_gpu_spec_decode.py)."""
    from tests.gpu.test_gpu_spec_decode import check_drafter_graphs_equal_eager

    target = eagle3_target(tmp_path, tokenizer=tiny_tokenizer, hidden_size=256, intermediate_size=512,
                           logit_scale=4.0)
    draft = eagle3_draft(tmp_path, target, "speculators", own_embed=True)
    runner = check_drafter_graphs_equal_eager(target, {**eagle3(draft, 3), "disable_by_batch_size": 4},
                                              MIXED_PROMPTS * 3)
    assert runner.graphs.replays > 5 and runner.verify_graphs is not None and runner.verify_graphs.replays >= 3
    assert runner.drafter.graphs is not None and runner.drafter.graphs.graphs and runner.drafter.graphs.replays > 5
    # the draft graphs alone, at the buckets' own sizes: the drafts of the same chain run eagerly
    drafter, g = runner.drafter, torch.Generator().manual_seed(0)
    for i, n in enumerate([64, 10, 1, 33]):
        drafter.windows[f"w{i}"] = (torch.arange(n, device="cuda") + 5,
                                    torch.randn(n, 256, generator=g).to("cuda", torch.bfloat16),
                                    torch.randint(3, 200, (n,), generator=g).cuda())
    graphs = drafter.graphs
    for rids in (["w0"], ["w0", "w1"], ["w0", "w1", "w2", "w3"]):
        replays = graphs.replays
        replayed = drafter.propose(rids)
        assert graphs.replays == replays + 1
        drafter.graphs = None
        try:
            assert replayed == drafter.propose(rids)
        finally:
            drafter.graphs = graphs
