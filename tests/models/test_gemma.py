"""Gemma 3 (sliding-window layers) and Gemma against transformers on the same tiny weights (CPU, float32): greedy
tokens identical for 32 tokens, also with chunked prefill, a prefix-cache hit and preemption, each asserted to have
happened; a sliding-window group frees the blocks that left its window while the request runs."""
import pytest

from kestrel import LLM, SamplingParams
from kestrel.core.kv_spec import FullAttentionSpec, SlidingWindowSpec
from kestrel.engine.kv import NULL_BLOCK_ID
from tests.agreement import hf_greedy

NUM_TOKENS = 32
# window 8: every prompt but the first is longer than the window, and 32 outputs run past it anyway
PROMPTS = [[5, 17, 99, 3], [7] * 11 + [42, 43], list(range(10, 40)), [200, 201, 202, 203, 204, 205, 206, 300, 301]]


@pytest.fixture(scope="module")
def reference(tiny_models):
    # eager attention: the one transformers path that applies attention soft-capping
    return {kind: hf_greedy(tiny_models[kind], PROMPTS, NUM_TOKENS, attn_implementation="eager")
            for kind in ("gemma", "gemma3")}


def generate(path, prompts, **kw):
    llm = LLM(str(path), progress=False, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], llm.engine.core


@pytest.mark.parametrize("kind", ["gemma", "gemma3"])
def test_greedy_matches_transformers(tiny_models, reference, kind):
    tokens, core = generate(tiny_models[kind], PROMPTS)
    assert tokens == reference[kind]
    specs = {type(g.spec) for g in core.executor.runner.kv_cache_groups}
    assert specs == ({SlidingWindowSpec, FullAttentionSpec} if kind == "gemma3" else {FullAttentionSpec})


def test_gemma3_chunked_prefill(tiny_models, reference):
    tokens, core = generate(tiny_models["gemma3"], PROMPTS, max_num_batched_tokens=8, block_size=4)
    assert tokens == reference["gemma3"]


def test_gemma3_prefix_cache_hit(tiny_models, reference):
    llm = LLM(str(tiny_models["gemma3"]), progress=False, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    first = llm.generate([PROMPTS[2]], params)[0].outputs[0].token_ids
    again = llm.generate([PROMPTS[2]], params)[0]
    assert first == again.outputs[0].token_ids == reference["gemma3"][2]
    assert again.num_cached_tokens > 0 and llm.engine.core.kv.prefix_hits > 0


def test_gemma3_preemption(tiny_models, reference):
    tokens, core = generate(tiny_models["gemma3"], PROMPTS, block_size=4, num_kv_blocks=40, max_num_batched_tokens=8)
    assert core.scheduler.num_preemptions > 0
    assert tokens == reference["gemma3"]


def test_sliding_group_frees_blocks_while_running(tiny_models):
    llm = LLM(str(tiny_models["gemma3"]), progress=False, block_size=4, max_num_batched_tokens=8)
    engine, core = llm.engine, llm.engine.core
    engine.add_request(list(range(10, 40)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    sliding = [g.group_id for g in core.executor.runner.kv_cache_groups if isinstance(g.spec, SlidingWindowSpec)]
    full = [g.group_id for g in core.executor.runner.kv_cache_groups if type(g.spec) is FullAttentionSpec]
    seen_freed = False
    while engine.has_unfinished_requests():
        engine.step()
        for req in core.scheduler.running:
            ids = core.kv.block_ids(req)
            assert all(NULL_BLOCK_ID not in ids[g] for g in full)
            if all(ids[g].count(NULL_BLOCK_ID) >= 3 for g in sliding):  # window 8 = 2 blocks of 4 kept
                held = sum(len(ids[g]) - ids[g].count(NULL_BLOCK_ID) for g in sliding)
                assert held <= len(sliding) * (2 + 2 + 1)  # window + a chunk of 8 + the partial block
                seen_freed = True
    assert seen_freed
    assert core.kv.num_free_blocks == core.kv.num_blocks



def test_gemma3_runner_inputs_match_the_kv_manager(tiny_models, reference):
    """Every step, each group's block table row and slot mapping that the runner builds (gathered from its per-request
    block rows, all groups at once) hold the blocks the KV manager gave the request: with chunked prefill,
    preemption and sliding windows freeing blocks (entries that became the null block are never read)."""
    llm = LLM(str(tiny_models["gemma3"]), progress=False, block_size=4, num_kv_blocks=40, max_num_batched_tokens=8)
    core = llm.engine.core
    runner, bs = core.executor.runner, 4
    orig = runner._prepare
    checked = {"tokens": 0, "entries": 0}

    def prepare(chunks, states, prev):
        ctx = orig(chunks, states, prev)
        t = 0
        for b, c in enumerate(chunks):
            kv_ids = core.kv.block_ids(core.scheduler.requests[c.request_id])
            for g, meta in enumerate(ctx.attn_metadata):
                row = meta.block_tables[b].tolist()
                live = [j for j, i in enumerate(kv_ids[g]) if i != NULL_BLOCK_ID]
                assert [row[j] for j in live] == [kv_ids[g][j] for j in live]
                checked["entries"] += len(live)
                for k in range(c.num_new_tokens):
                    p = c.num_computed_tokens + k
                    assert meta.slot_mapping[t + k].item() == kv_ids[g][p // bs] * bs + p % bs
            t += c.num_new_tokens
        checked["tokens"] += t
        return ctx

    runner._prepare = prepare
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == reference["gemma3"]
    assert core.scheduler.num_preemptions > 0 and len(runner.kv_cache_groups) > 2
    assert checked["tokens"] >= sum(len(p) for p in PROMPTS) + len(PROMPTS) * (NUM_TOKENS - 1)
    rows = runner.block_rows
    assert len(rows._free) + len(runner.requests) == len(rows.ids)  # rows of finished requests went back
