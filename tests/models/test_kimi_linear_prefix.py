"""Prefix caching for Kimi Linear through state snapshots (kestrel/engine/kv/managers.py StateSlotManager): the
KDA layers' recurrent and convolution states saved at block-aligned chunk ends and restored on a hit, against
transformers 5.17 on the same tiny weights (CPU, float32), greedy tokens identical for 24 tokens.

One run carries a hit from another request's prefix, chunked prefill cutting through the KDA layers (chunks
continuing a state) and preemption (resumed requests hit their own snapshots); another shows a hit that would
land mid-block, past the last snapshot, falling back to the last snapshot."""
import pytest

from kestrel import LLM, SamplingParams
from kestrel.attention.backends.torch_kda import TorchKDAImpl
from kestrel.core.kv_spec import KDAStateSpec
from kestrel.worker import kv_allocation
from tests.agreement import hf_greedy
from tests.tiny import make_checkpoint

NUM_TOKENS = 24
SHARED = [(7 * i + 3) % 200 + 20 for i in range(30)]  # a 30-token shared prefix (7.5 blocks of 4)
FIRST = SHARED + [11, 12, 13]
SECOND = SHARED + [300, 301, 302, 303, 304]
OTHERS = [[5, 17, 99, 3], [7] * 11 + [42, 43], list(range(10, 40)), [77]]
# shares 22 tokens (5.5 blocks) with FIRST, whose chunk ends are 8, 16, 24, 32 with a budget of 8
DIVERGING = SHARED[:22] + [250, 251, 252, 253, 254, 255]
EXTENDED = FIRST + [260, 261, 262]  # a next turn: FIRST's every token, then more


@pytest.fixture(scope="module")
def kimi(tmp_path_factory, tiny_tokenizer):
    return make_checkpoint("kimi_linear", tmp_path_factory.mktemp("kimi_prefix"), tokenizer=tiny_tokenizer)


@pytest.fixture(scope="module")
def reference(kimi):
    prompts = [FIRST, SECOND, *OTHERS, DIVERGING, EXTENDED]
    return dict(zip(map(tuple, prompts), hf_greedy(kimi, prompts, NUM_TOKENS)))


@pytest.fixture
def recorded(monkeypatch):
    """Every KDA prefill or chunk as (query length, whether it continued a state), and every state-slot copy
    the runner made as (group, src, dst, 'restore' or 'save')."""
    seen = {"prefills": [], "copies": []}
    original_prefill, original_copy = TorchKDAImpl.forward_prefill, kv_allocation.copy_state_slots

    def forward_prefill(self, w, qkv, f, beta_logits, gate, cache, slot, has_initial_state):
        seen["prefills"].append((qkv.shape[0], has_initial_state))
        return original_prefill(self, w, qkv, f, beta_logits, gate, cache, slot, has_initial_state)

    def copy_state_slots(groups, layers, copies):
        seen["copies"].append(list(copies))
        return original_copy(groups, layers, copies)

    monkeypatch.setattr(TorchKDAImpl, "forward_prefill", forward_prefill)
    monkeypatch.setattr(kv_allocation, "copy_state_slots", copy_state_slots)
    return seen


def params():
    return SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def state_group(llm):
    runner = llm.engine.core.executor.runner
    return next(g for g in runner.kv_cache_groups if isinstance(g.spec, KDAStateSpec))


@pytest.mark.parametrize("pipelined", ["off", "on"])
def test_hit_with_chunked_prefill_and_preemption(kimi, reference, recorded, pipelined):
    """Pipelined: step N + 1 is scheduled and launched before step N's result (its saves registered later)."""
    llm = LLM(str(kimi), progress=False, max_model_len=256, block_size=4, num_kv_blocks=24,
              max_num_batched_tokens=8, max_num_seqs=4, async_scheduling=pipelined)
    core = llm.engine.core
    assert core.kv.enable_prefix_caching and core.pipelined == (pipelined == "on")
    prompts = [FIRST, SECOND, *OTHERS]
    outs = llm.generate(prompts, params())
    assert [o.outputs[0].token_ids for o in outs] == [reference[tuple(p)] for p in prompts]
    # SECOND, admitted once FIRST's prefill (chunk ends 8, 16, 24, 32) is done, started from FIRST's snapshot at
    # 24: its attention hit is 28 (7 blocks of SHARED), but 28 ended no chunk
    assert outs[1].num_cached_tokens == 24
    assert core.kv.prefix_hits >= 24  # the coordinator's hit counter (resumed requests hit their own too)
    assert core.scheduler.num_preemptions > 0
    assert any(init for _, init in recorded["prefills"])  # chunks continued their request's state
    assert all(q <= 8 for q, _ in recorded["prefills"])  # the budget cut every prompt into chunks
    kda = state_group(llm)
    first_snapshot = kda.spec.num_slots
    assert kda.spec.num_snapshot_slots == 4  # max_num_seqs by default
    restores = [c for copies in recorded["copies"] for c in copies if c[1] >= first_snapshot]
    saves = [c for copies in recorded["copies"] for c in copies if c[2] >= first_snapshot]
    assert restores and saves and all(c[0] == kda.group_id for c in restores + saves)
    # everything back: working slots, and snapshots unreferenced (still cached, evictable)
    state = core.kv.managers[kda.group_id]
    assert sorted(state.free_slots) == list(range(1, first_snapshot)) and not state.pending
    assert state.snapshots.num_free == kda.spec.num_snapshot_slots


def test_partial_hit_falls_back_to_the_last_snapshot(kimi, reference, recorded):
    """FIRST's state is saved at its chunk ends 8, 16, 24 and 32 only. DIVERGING shares 5.5 blocks with it: the
    attention blocks would serve 5 (20 tokens, the hit cannot land mid-block), the snapshots 4 (16 tokens).
    SECOND shares 7.5 blocks: 7 attention blocks, the snapshot at 24."""
    llm = LLM(str(kimi), progress=False, max_model_len=256, block_size=4, max_num_batched_tokens=8)
    first = llm.generate([FIRST], params())[0]
    assert first.num_cached_tokens == 0 and first.outputs[0].token_ids == reference[tuple(FIRST)]
    assert [q for q, _ in recorded["prefills"][::3]] == [8, 8, 8, 8]  # 3 KDA layers; the 33rd token decodes
    core = llm.engine.core
    for prompt, hit in ((DIVERGING, 16), (SECOND, 24)):
        hits_before = core.kv.prefix_hits
        out = llm.generate([prompt], params())[0]
        assert out.num_cached_tokens == hit and core.kv.prefix_hits - hits_before == hit
        assert out.outputs[0].token_ids == reference[tuple(prompt)]


def test_unchunked_prompt_keeps_its_last_full_block(kimi, reference, recorded):
    """With a budget above the prompt, a prompt is still cut at its last block boundary (the tail runs as one
    more step), so a next turn that extends it starts from there."""
    llm = LLM(str(kimi), progress=False, max_model_len=256, block_size=4)
    assert llm.generate([FIRST], params())[0].outputs[0].token_ids == reference[tuple(FIRST)]
    assert [q for q, _ in recorded["prefills"]] == [32] * 3  # the 33rd token in the next step, a decode row
    out = llm.generate([EXTENDED], params())[0]
    assert out.num_cached_tokens == 32 and out.outputs[0].token_ids == reference[tuple(EXTENDED)]
    assert [init for _, init in recorded["prefills"][3:]] == [True] * 3  # EXTENDED's rest continued the snapshot


def test_batched_prefill_path_gives_the_same_tokens(kimi, reference, monkeypatch):
    """The batched prefill (kestrel/attention/kda.py forward_prefills: one call per layer and step for all its
    prefills and chunks, states gathered from the slots and written back) with kda_ref's varlen delta rule in
    fla's place (the CPU has no fla): the reference's tokens through a snapshot hit, chunks continuing states,
    fresh prompts batched with them, and preemption."""
    from kestrel.attention.kda import KDAImpl
    from kestrel.kernels import kda_ref

    calls = []

    def delta_rule(q, k, v, g, beta, initial, cu, cu_cpu, scale):
        calls.append(cu_cpu.tolist())
        return kda_ref.delta_rule_varlen(q, k, v, g, beta, initial, cu, cu_cpu, scale)

    monkeypatch.setattr(KDAImpl, "varlen_delta_rule", staticmethod(delta_rule))
    per_request = []
    monkeypatch.setattr(TorchKDAImpl, "forward_prefill", lambda *a: per_request.append(a))
    llm = LLM(str(kimi), progress=False, max_model_len=256, block_size=4, num_kv_blocks=24,
              max_num_batched_tokens=8, max_num_seqs=4)
    prompts = [FIRST, SECOND, *OTHERS]
    outs = llm.generate(prompts, params())
    assert [o.outputs[0].token_ids for o in outs] == [reference[tuple(p)] for p in prompts]
    assert outs[1].num_cached_tokens == 24 and llm.engine.core.scheduler.num_preemptions > 0
    assert not per_request  # every prefill went through the batched path
    assert any(len(cu) > 2 for cu in calls)  # steps with several prefills in one call
