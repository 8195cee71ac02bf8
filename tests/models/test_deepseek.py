"""DeepSeek-V2, V2-Lite-style and V3 (multi-head latent attention; all layers dense, and with MoE layers) against transformers on the
same tiny weights (CPU, float32): greedy tokens identical for 32 tokens on mixed-length prompts, also with chunked
prefill, preemption and a prefix-cache hit, each asserted to have happened; the path each part of a step took
(absorbed for decodes, dense for prefills; absorbed for everything on a backend without dense prefill) is
asserted from the calls the backend received."""
import pytest

from kestrel import SamplingParams
from kestrel.attention.backends.torch_mla import TorchMLAImpl
from kestrel.core.kv_spec import MLASpec
from tests.agreement import hf_greedy, kestrel_greedy

KINDS = ["deepseek_v2", "deepseek_v2_lite", "deepseek_v3"]
NUM_TOKENS = 32
PROMPTS = [[5, 17, 99, 3], [7] * 11 + [42, 43], list(range(10, 40)), [200, 201, 202, 203, 204, 205, 206, 300, 301]]


@pytest.fixture(scope="module")
def reference(tiny_models):
    return {kind: hf_greedy(tiny_models[kind], PROMPTS, NUM_TOKENS) for kind in KINDS}


@pytest.fixture
def paths(monkeypatch):
    """Records, per call, the query lengths each MLA path served (absorbed: all requests it got; dense: with
    their context lengths)."""
    seen = {"absorbed": [], "dense": []}
    latent, dense = TorchMLAImpl.attend_latent, TorchMLAImpl.attend_dense

    def attend_latent(self, q_lat, q_pe, cache, meta):
        qsl = meta.query_start_loc_cpu
        seen["absorbed"] += [qsl[b + 1] - qsl[b] for b in range(meta.num_absorbed_reqs)]
        return latent(self, q_lat, q_pe, cache, meta)

    def attend_dense(self, q_nope, q_pe, cache, meta, layer, out):
        qsl, sl = meta.query_start_loc_cpu, meta.seq_lens_cpu
        seen["dense"] += [(qsl[b + 1] - qsl[b], sl[b]) for b in range(meta.num_absorbed_reqs, meta.num_reqs)]
        return dense(self, q_nope, q_pe, cache, meta, layer, out)

    monkeypatch.setattr(TorchMLAImpl, "attend_latent", attend_latent)
    monkeypatch.setattr(TorchMLAImpl, "attend_dense", attend_dense)
    return seen


def generate(path, prompts, **kw):
    return kestrel_greedy(path, prompts, NUM_TOKENS, **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(tiny_models, reference, paths, kind):
    tokens, llm = generate(tiny_models[kind], PROMPTS)
    assert tokens == reference[kind]
    runner = llm.engine.core.executor.runner
    assert [type(g.spec) for g in runner.kv_cache_groups] == [MLASpec]
    assert runner.backend.name == "torch_mla"
    assert paths["dense"] and all(q > 1 for q, _ in paths["dense"])  # prompts expanded
    assert paths["absorbed"] and all(q == 1 for q in paths["absorbed"])  # decodes in latent space


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_preemption_prefix_hit(tiny_models, reference, paths, kind):
    tokens, llm = generate(tiny_models[kind], PROMPTS, block_size=4, num_kv_blocks=40, max_num_batched_tokens=8)
    core = llm.engine.core
    assert tokens == reference[kind]
    assert core.scheduler.num_preemptions > 0
    assert any(seq_len > q for q, seq_len in paths["dense"])  # a chunk attended over its cached prefix
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    again = llm.generate([PROMPTS[2]], params)[0]
    assert again.num_cached_tokens > 0 and core.kv.prefix_hits > 0
    assert again.outputs[0].token_ids == reference[kind][2]


def test_backend_without_dense_prefill_routes_prefill_through_absorbed_path(tiny_models, reference, paths):
    """torch_mla_absorbed declares no dense MHA prefill: its builder sends the prompts (short prefills) through
    the absorbed path, and the tokens still match transformers."""
    tokens, llm = generate(tiny_models["deepseek_v3"], PROMPTS[:2], attention_backend="torch_mla_absorbed")
    assert llm.engine.core.executor.runner.backend.name == "torch_mla_absorbed"
    assert tokens == reference["deepseek_v3"][:2]
    assert paths["dense"] == []
    assert sorted(q for q in paths["absorbed"] if q > 1) == [4, 4, 13, 13]  # both prompts, in both layers


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, tiny_tokenizer):
    from tests.tiny import make_checkpoint

    root = tmp_path_factory.mktemp("tiny_deepseek_moe")
    return {k: make_checkpoint(k, root, tokenizer=tiny_tokenizer) for k in ("deepseek_v2_moe", "deepseek_v3_moe")}


@pytest.mark.parametrize("kind", ["deepseek_v2_moe", "deepseek_v3_moe"])
def test_moe_greedy_matches_transformers(moe_models, kind):
    """MLA with DeepSeek's MoE layers (from first_k_dense_replace on; V2: softmax group-limited routing, V3:
    sigmoid + correction bias), also with chunked prefill and preemption."""
    from kestrel.layers.moe import SparseMoeBlock

    ref = hf_greedy(moe_models[kind], PROMPTS, NUM_TOKENS)
    tokens, llm = generate(moe_models[kind], PROMPTS)
    model = llm.engine.core.executor.runner.model
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == [False, True, True]
    assert tokens == ref
    tokens, llm = generate(moe_models[kind], PROMPTS, block_size=4, num_kv_blocks=40, max_num_batched_tokens=8)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert tokens == ref
