"""Kimi Linear (Kimi Delta Attention + NoPE MLA + MoE with a shared expert and a dense first layer) against
transformers 5.17 on the same tiny weights (CPU, float32): greedy tokens identical for 24 tokens on mixed-length
prompts; also with chunked prefill cutting through the KDA layers (a chunk continuing its request's state, asserted
from the calls) and preemption (asserted from the counter), prefix caching off. Prefix caching on (state
snapshots): tests/models/test_kimi_linear_prefix.py."""
import pytest

from kestrel import LLM, SamplingParams
from kestrel.attention.backends.torch_kda import TorchKDAImpl
from kestrel.core.kv_spec import KDAStateSpec, MLASpec
from kestrel.worker.memory_profile import dummy_prefill_batch
from tests.agreement import hf_greedy
from tests.tiny import make_checkpoint

NUM_TOKENS = 24
# the one-token prompt goes through the decode path for its first token (a zero state, not its slot's)
PROMPTS = [[5, 17, 99, 3], [7] * 11 + [42, 43], list(range(10, 40)), [200, 201, 202, 203, 204, 205, 206, 300, 301],
           [77]]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory, tiny_tokenizer):
    return make_checkpoint("kimi_linear", tmp_path_factory.mktemp("kimi"), tokenizer=tiny_tokenizer)


@pytest.fixture(scope="module")
def reference(kimi):
    return hf_greedy(kimi, PROMPTS, NUM_TOKENS)


@pytest.fixture
def prefills(monkeypatch):
    """Records (query length, whether it continued a state) of every prefill or chunk a KDA layer ran."""
    seen = []
    original = TorchKDAImpl.forward_prefill

    def forward_prefill(self, w, qkv, f, beta_logits, gate, cache, slot, has_initial_state):
        seen.append((qkv.shape[0], has_initial_state, slot))
        return original(self, w, qkv, f, beta_logits, gate, cache, slot, has_initial_state)

    monkeypatch.setattr(TorchKDAImpl, "forward_prefill", forward_prefill)
    return seen


def generate(path, prompts, **kw):
    llm = LLM(str(path), progress=False, max_model_len=256, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], llm


def test_greedy_matches_transformers(kimi, reference, prefills):
    tokens, llm = generate(kimi, PROMPTS)
    assert tokens == reference
    core = llm.engine.core
    runner = core.executor.runner
    assert sorted(type(g.spec).__name__ for g in runner.kv_cache_groups) == ["KDAStateSpec", "MLASpec"]
    kda = next(g for g in runner.kv_cache_groups if isinstance(g.spec, KDAStateSpec))
    assert len(kda.layer_names) == 3  # every KDA layer in one state group
    max_num_seqs = llm.engine.config.scheduler.max_num_seqs
    assert kda.spec.num_slots == max_num_seqs + 1  # + the null slot
    assert kda.spec.num_snapshot_slots == max_num_seqs  # prefix caching (on by default) keeps state snapshots
    assert {b.name for b in runner.backends} == {"torch_kda", "torch_mla"}
    # prefix caching cuts a prompt crossing a block boundary (16 tokens) at its last one: 30 = 16 + 14
    assert sorted(q for q, init, _ in prefills if not init) == sorted([4, 13, 16, 9] * 3)  # 3 layers
    assert sorted(q for q, init, _ in prefills if init) == [14] * 3  # the 30-token prompt's tail continued
    assert all(slot != 0 for _, _, slot in prefills)  # never the null slot
    assert core.kv.enable_prefix_caching and core.kv.prefix_hits == 0  # no prompt shares a block with another
    state = core.kv.managers[runner.kv_cache_groups.index(kda)]
    assert sorted(state.free_slots) == list(range(1, kda.spec.num_slots))  # every slot back, 0 never out


def test_chunked_prefill_and_preemption(kimi, reference, prefills):
    tokens, llm = generate(kimi, PROMPTS, block_size=4, num_kv_blocks=20, max_num_batched_tokens=8,
                           enable_prefix_caching=False)
    core = llm.engine.core
    assert tokens == reference
    assert core.scheduler.num_preemptions > 0
    assert any(init for _, init, _ in prefills)  # a chunk continued its request's state through the KDA layers
    # every preempted request was recomputed from a zero state: one fresh start per prompt and per preemption
    fresh = sum(1 for _, init, _ in prefills if not init)
    assert fresh == 3 * (len(PROMPTS) - 1 + core.scheduler.num_preemptions)  # less the one-token prompt
    runner = core.executor.runner
    assert [type(g.spec) for g in runner.kv_cache_groups].count(MLASpec) == 1
    kda = next(g for g in runner.kv_cache_groups if isinstance(g.spec, KDAStateSpec))
    assert kda.spec.num_snapshot_slots == 0  # no prefix caching, no snapshots
    again = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))[0]
    assert again.num_cached_tokens == 0 and core.kv.prefix_hits == 0
    assert again.outputs[0].token_ids == reference[2]


def test_slots_reused_without_leaking_state(kimi, reference):
    """Two requests at a time: later requests (the one-token prompt last) take slots that earlier ones dirtied,
    and still give transformers' tokens."""
    tokens, llm = generate(kimi, PROMPTS, max_num_seqs=2)
    assert tokens == reference
    runner = llm.engine.core.executor.runner
    kda = next(g for g in runner.kv_cache_groups if isinstance(g.spec, KDAStateSpec))
    assert kda.spec.num_slots == 3 and kda.spec.num_state_slots == 3 + 2  # + 2 snapshot slots


def test_embedding_contract_and_profile_batch(kimi):
    """forward(input_ids) == forward(inputs_embeds=embed_input_ids(input_ids)); and the memory profile's dummy
    batch, whose tables number blocks past the slot pool, runs (those rows read the null slot)."""
    import torch

    from kestrel.config import EngineConfig
    from kestrel.engine.core import EngineCore

    core = EngineCore(EngineConfig.create(model=str(kimi), num_kv_blocks=64, max_model_len=256, max_num_seqs=4,
                                          max_num_batched_tokens=600), progress=False)
    runner = core.executor.runner
    model, ids = runner.model, torch.tensor([3, 9, 27, 81])

    def run(**kw):
        _, positions, ctx = dummy_prefill_batch(runner, 4)  # a fresh cache and one 4-token sequence
        with torch.inference_mode():
            return model(ids, positions, ctx, **kw)

    torch.testing.assert_close(run(), run(inputs_embeds=model.embed_input_ids(ids)), rtol=0, atol=0)
    ids600, positions, ctx = dummy_prefill_batch(runner, 600)  # 256 + 256 + 88 tokens; tables start at blocks 0, 16, 32
    kda_meta = next(m for m in ctx.attn_metadata if getattr(m, "state_slots", None) is not None)
    assert kda_meta.state_slots.tolist() == [0, 0, 0]
    with torch.inference_mode():
        assert torch.isfinite(model(ids600, positions, ctx)).all()
