"""The Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5 text, Qwen3.5-MoE text: GDN layers on the KDA paths with
kda_ref.DeltaOptions, gated full attention with partial RoPE) against transformers 5.17 on the same tiny weights
(CPU, float32): greedy tokens identical for 24 tokens on mixed-length prompts in one batch; then, in one run, a
prefix-cache hit (from the coordinator's hit counter) through the GDN state snapshots, chunked prefill cutting
through the GDN layers (chunks continuing a state, asserted from the calls) and preemption (from the counter).
The text part of a Qwen3.5 vision-language checkpoint: tests/models/test_qwen3_5_vl_text.py."""
import pytest

from kestrel import LLM, SamplingParams
from kestrel.core.kv_spec import FullAttentionSpec, GDNStateSpec
from tests.agreement import hf_greedy
from tests.models.test_kimi_linear import prefills  # noqa: F401  (the fixture: every prefill a GDN layer ran)
from tests.tiny import make_checkpoint

NUM_TOKENS = 24
KINDS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
# the one-token prompt goes through the decode path for its first token (a zero state, not its slot's)
PROMPTS = [[5, 17, 99, 3], [7] * 11 + [42, 43], list(range(10, 40)), [200, 201, 202, 203, 204, 205, 206, 300, 301],
           [77]]
SHARED = [(7 * i + 3) % 200 + 20 for i in range(30)]  # a 30-token shared prefix (7.5 blocks of 4)
FIRST = SHARED + [11, 12, 13]
SECOND = SHARED + [300, 301, 302, 303, 304]


@pytest.fixture(scope="module", params=KINDS)
def case(request, tmp_path_factory, tiny_tokenizer):
    """(checkpoint, transformers' tokens per prompt) of one model type."""
    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param), tokenizer=tiny_tokenizer)
    prompts = [*PROMPTS, FIRST, SECOND]
    return path, dict(zip(map(tuple, prompts), hf_greedy(path, prompts, NUM_TOKENS)))


def params():
    return SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def test_greedy_matches_transformers(case, prefills):
    path, reference = case
    llm = LLM(str(path), progress=False, max_model_len=256)
    outs = llm.generate(PROMPTS, params())
    assert [o.outputs[0].token_ids for o in outs] == [reference[tuple(p)] for p in PROMPTS]
    runner = llm.engine.core.executor.runner
    assert sorted(type(g.spec).__name__ for g in runner.kv_cache_groups) == ["FullAttentionSpec", "GDNStateSpec"]
    gdn = next(g for g in runner.kv_cache_groups if isinstance(g.spec, GDNStateSpec))
    assert len(gdn.layer_names) == 3  # every GDN layer in one state group
    s = gdn.spec  # 2 key heads of 16 repeated to 4 value heads of 32; conv over q|k|v: 2*2*16 + 4*32 channels
    assert (s.num_heads, s.num_key_heads, s.head_dim, s.value_head_dim) == (4, 2, 16, 32)
    assert [shape for _, shape in s.state_parts()] == [(4, 16, 32), (192, 3)]
    full = next(g for g in runner.kv_cache_groups if isinstance(g.spec, FullAttentionSpec))
    assert full.spec.head_dim == 32 and full.spec.num_kv_heads == 2
    assert {b.name for b in runner.backends} == {"torch_kda", "torch_ref"}
    assert all(slot != 0 for _, _, slot in prefills)  # never the null slot
    assert sorted(q for q, init, _ in prefills if init) == [14] * 3  # the 30-token prompt's tail continued


def test_prefix_hit_chunked_prefill_and_preemption(case, prefills):
    """Block 4, a budget of 8 tokens a step and a small pool: SECOND starts from FIRST's snapshot at its chunk
    end 24 (the hit counter), every prompt is cut into chunks, and requests are preempted and recomputed."""
    path, reference = case
    llm = LLM(str(path), progress=False, max_model_len=256, block_size=4, num_kv_blocks=24,
              max_num_batched_tokens=8, max_num_seqs=4)
    core = llm.engine.core
    prompts = [FIRST, SECOND, *PROMPTS]
    outs = llm.generate(prompts, params())
    assert [o.outputs[0].token_ids for o in outs] == [reference[tuple(p)] for p in prompts]
    assert outs[1].num_cached_tokens == 24 and core.kv.prefix_hits >= 24
    assert core.scheduler.num_preemptions > 0
    assert any(init for _, init, _ in prefills)  # chunks continued their request's state through the GDN layers
    assert all(q <= 8 for q, _, _ in prefills)  # the budget cut every prompt into chunks
    fresh = sum(1 for _, init, _ in prefills if not init)  # every start from a zero state: one per GDN layer
    assert fresh >= 3 * (len(prompts) - 2)  # the prompts but SECOND (a hit) and the one-token one (a decode row)


def test_embedding_contract_and_profile_batch(case):
    """forward(input_ids) == forward(inputs_embeds=embed_input_ids(input_ids)); the memory profile's dummy batch
    (tables past the slot pool: those rows read the null slot) runs."""
    import torch

    from kestrel.config import EngineConfig
    from kestrel.engine.core import EngineCore
    from kestrel.worker.memory_profile import dummy_prefill_batch

    cfg = EngineConfig.create(model=str(case[0]), num_kv_blocks=64, max_model_len=256, max_num_seqs=4,
                              max_num_batched_tokens=600)
    runner = EngineCore(cfg, progress=False).executor.runner
    outs = []
    for n, embed in ((4, False), (4, True), (600, False)):
        ids, positions, ctx = dummy_prefill_batch(runner, n)
        with torch.inference_mode():
            embeds = runner.model.embed_input_ids(ids) if embed else None
            outs.append(runner.model(ids, positions, ctx, inputs_embeds=embeds))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert torch.isfinite(outs[2]).all()
