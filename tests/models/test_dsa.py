"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5, GLM-5.2's shared layers) against transformers on the same tiny
weights (CPU, float32): 24 greedy tokens identical for prompts of 5 to 48 tokens at index_topk 4, 8 and 2048 (4 and
8 below most contexts, so the selection decides the output; 2048 above all, so sparse is dense), also with chunked
prefill, preemption and a prefix-cache hit, each asserted to have happened.

Then the regression for vLLM's dense-prefill bug (#52512): the route of a step is decided once, from the backend's
AND the layer class's declared capability AND the prefill length; a layer that does not declare dense prefill is
scored and attends sparsely even when the backend could go dense."""
from pathlib import Path

import pytest
import torch

from kestrel import SamplingParams
from kestrel.attention.backends.torch_sparse_mla import TorchSparseMLAImpl
from kestrel.attention.sparse_mla import DENSE, SPARSE, SparseMLAAttention, SparseMLAMetadataBuilder
from kestrel.core.kv_spec import SparseMLASpec
from tests.agreement import hf_greedy, kestrel_greedy

NUM_TOKENS = 24
PROMPTS = [[5, 17, 99, 3, 8], list(range(10, 40)), [200 + (7 * i) % 97 for i in range(48)], [7] * 11 + [42, 43]]
CASES = [("deepseek_v32", 4), ("deepseek_v32", 8), ("deepseek_v32", 2048), ("glm_moe_dsa", 4), ("glm_moe_dsa", 8),
         ("glm_moe_dsa", 2048), ("glm_moe_dsa_shared", 4), ("glm_moe_dsa_shared", 2048)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer):
    from tests.tiny import make_checkpoint

    root, built = tmp_path_factory.mktemp("tiny_dsa"), {}

    def get(kind: str, topk: int) -> Path:
        if (kind, topk) not in built:
            built[kind, topk] = make_checkpoint(kind, root, tokenizer=tiny_tokenizer, name=f"{kind}_{topk}",
                                                index_topk=topk)
        return built[kind, topk]
    return get


@pytest.fixture(scope="module")
def reference(checkpoints):
    cache = {}

    def get(kind: str, topk: int, prompts=tuple(map(tuple, PROMPTS))):
        if (kind, topk, prompts) not in cache:
            cache[kind, topk, prompts] = hf_greedy(checkpoints(kind, topk), [list(p) for p in prompts], NUM_TOKENS)
        return cache[kind, topk, prompts]
    return get


@pytest.fixture
def calls(monkeypatch):
    """Spies on the step's route (from the builder), on scoring (query tokens per select_topk call) and on the
    dense path (query tokens it served)."""
    seen = {"routes": [], "scored": [], "dense": []}
    build, select, dense = SparseMLAMetadataBuilder.build, TorchSparseMLAImpl.select_topk, TorchSparseMLAImpl.attend_dense

    def spy_build(self, common, block_table, slot_mapping):
        meta = build(self, common, block_table, slot_mapping)
        sl = common.seq_lens_cpu[:common.num_reqs]
        seen["routes"].append((meta.route, max(sl[common.num_decodes:], default=0), max(sl)))
        return meta

    def spy_select(self, index_q, index_w, index_cache, meta):
        seen["scored"].append(index_q.shape[0])
        return select(self, index_q, index_w, index_cache, meta)

    def spy_dense(self, q_nope, q_pe, cache, meta, layer, out):
        seen["dense"].append(q_nope.shape[0])
        return dense(self, q_nope, q_pe, cache, meta, layer, out)

    monkeypatch.setattr(SparseMLAMetadataBuilder, "build", spy_build)
    monkeypatch.setattr(TorchSparseMLAImpl, "select_topk", spy_select)
    monkeypatch.setattr(TorchSparseMLAImpl, "attend_dense", spy_dense)
    return seen


def generate(path, prompts, **kw):
    return kestrel_greedy(path, prompts, NUM_TOKENS, **kw)


def test_selection_changes_transformers_output(reference):
    """The oracle is not dense MLA in disguise: with index_topk below the context, transformers' tokens differ."""
    for kind in ("deepseek_v32", "glm_moe_dsa"):
        assert reference(kind, 4) != reference(kind, 2048)


@pytest.mark.parametrize("kind,topk", CASES)
def test_greedy_matches_transformers(checkpoints, reference, calls, kind, topk):
    tokens, llm = generate(checkpoints(kind, topk), PROMPTS)
    runner = llm.engine.core.executor.runner
    assert [type(g.spec) for g in runner.kv_cache_groups] == [SparseMLASpec]
    assert runner.backend.name == "torch_sparse_mla"
    assert tokens == reference(kind, topk)
    # contexts outgrow index_topk 4 and 8: scored; never 2048: every step takes the DENSE route, nothing scored
    assert bool(calls["scored"]) == (topk < 2048)
    assert {r for r, _, _ in calls["routes"]} == ({DENSE} if topk == 2048 else {SPARSE})


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_route_with_every_token_selected(checkpoints, reference, calls, monkeypatch, kind):
    """index_topk above every context through the sparse path (the layer declares no dense prefill): the
    selection is every visible token, and the tokens equal transformers' (sparse == dense)."""
    monkeypatch.setattr(SparseMLAAttention, "supports_dense_mha_prefill", False)
    tokens, _ = generate(checkpoints(kind, 2048), PROMPTS)
    assert tokens == reference(kind, 2048)
    assert calls["scored"] and {r for r, _, _ in calls["routes"]} == {SPARSE}


@pytest.mark.parametrize("kind,topk", [("deepseek_v32", 4), ("glm_moe_dsa", 8), ("glm_moe_dsa_shared", 4)])
def test_chunked_prefill_preemption_prefix_hit(checkpoints, reference, calls, kind, topk):
    tokens, llm = generate(checkpoints(kind, topk), PROMPTS, block_size=4, num_kv_blocks=28,
                           max_num_batched_tokens=8)
    core = llm.engine.core
    assert tokens == reference(kind, topk)
    assert core.scheduler.num_preemptions > 0
    assert any(longest > 8 for route, longest, _ in calls["routes"] if route == SPARSE)  # chunks over a prefix
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    again = llm.generate([PROMPTS[2]], params)[0]
    assert again.num_cached_tokens > 0 and core.kv.prefix_hits > 0
    assert again.outputs[0].token_ids == reference(kind, topk)[2]


def test_mtp_layers_past_num_hidden_layers_are_ignored(checkpoints, reference, tmp_path):
    """A checkpoint with multi-token-prediction tensors at layer index num_hidden_layers loads and decodes as
    without them."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = checkpoints("deepseek_v32", 8)
    dst = tmp_path / "with_mtp"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    layer2 = {k: v for k, v in tensors.items() if k.startswith("model.layers.2.")}
    tensors.update({k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in layer2.items()})
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # an MTP-only module
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    tokens, _ = generate(dst, PROMPTS[:2])
    assert tokens == reference("deepseek_v32", 8)[:2]


# ---- the route: one decision per step, from declared capabilities (vLLM #52512)

SHORT = [[5, 17, 99, 3, 8, 11], [40, 41, 42, 43, 44, 45, 46]]  # prefills under index_topk 8


def test_layer_without_dense_prefill_takes_sparse_route(checkpoints, reference, calls, monkeypatch):
    """The backend declares dense MHA prefill, the layer class does not, the prefills are short: every step is
    SPARSE, the prompts are scored, the dense path never runs (it would raise: this layer has none), and the
    tokens equal transformers'."""
    monkeypatch.setattr(SparseMLAAttention, "supports_dense_mha_prefill", False)

    def no_dense_path(*args):
        raise AssertionError("the layer declares no dense prefill: the dense path must not run")
    monkeypatch.setattr(TorchSparseMLAImpl, "attend_dense", no_dense_path)
    tokens, llm = generate(checkpoints("deepseek_v32", 8), SHORT)
    assert llm.engine.core.executor.runner.backend.supports_dense_mha_prefill
    assert tokens == reference("deepseek_v32", 8, tuple(map(tuple, SHORT)))
    assert {r for r, _, _ in calls["routes"]} == {SPARSE}
    assert any(longest > 0 for _, longest, _ in calls["routes"])
    assert max(calls["scored"]) >= len(SHORT[0]) + len(SHORT[1])  # the prompts' tokens were scored


def test_dense_route_still_writes_indexer_keys(checkpoints, reference, calls):
    """Backend and layer both declare dense prefill: the short prefills go dense and are not scored (so do the
    decodes while every context is within index_topk), and the decodes after them, whose contexts outgrow
    index_topk, are scored over the keys the dense steps wrote."""
    tokens, llm = generate(checkpoints("deepseek_v32", 8), SHORT)
    assert tokens == reference("deepseek_v32", 8, tuple(map(tuple, SHORT)))
    routes = calls["routes"]
    assert routes[0][:2] == (DENSE, 7) and all(r == DENSE for r, _, ctx in routes if ctx <= 8)
    assert all(r == SPARSE for r, _, ctx in routes if ctx > 8) and routes[-1][0] == SPARSE
    assert calls["dense"] and max(calls["scored"]) == len(SHORT)  # only decodes were scored
    assert len(calls["scored"]) == 3 * sum(ctx > 8 for _, _, ctx in routes)  # the 3 layers, sparse steps only
    assert reference("deepseek_v32", 8, tuple(map(tuple, SHORT))) != reference(
        "deepseek_v32", 2048, tuple(map(tuple, SHORT)))  # the decodes' selection mattered


def test_fp8_block_checkpoint_with_power_of_two_scales(tiny_tokenizer, tmp_path):
    """DeepSeek-V3.2's FP8 format: 128 x 128 blocks whose scales are powers of two (`scale_fmt` ue8m0), the
    indexer's wq_b / wk quantized, weights_proj left unquantized. It loads through the FP8 path (on the CPU the
    dequantizing kernel: float32 weights, float32 activations) and gives transformers' greedy tokens on the
    float32 dequantized checkpoint, with index_topk 8 below the contexts. Every MLP dense: the CPU has no FP8 MoE
    kernel for experts this narrow."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from kestrel.kernels.fp8_quant import expand_block_scale
    from tests.fp8_utils import DEFAULT_SKIP, make_fp8_checkpoint
    from tests.tiny import make_checkpoint

    src = make_checkpoint("deepseek_v32", tmp_path, tokenizer=tiny_tokenizer, first_k_dense_replace=3)
    fp8 = make_fp8_checkpoint(src, tmp_path / "fp8", fmt="block", skip=DEFAULT_SKIP + ("weights_proj",))
    tensors = load_file(fp8 / "model.safetensors")
    dequantized = {k: v for k, v in tensors.items() if not k.endswith(".weight_scale_inv")}
    for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        w_name = name.replace("weight_scale_inv", "weight")
        q, s = tensors[w_name], tensors[name]
        s2 = torch.exp2(torch.ceil(torch.log2(s)))  # ue8m0: the next power of two
        w = q.float() * expand_block_scale(s, *q.shape, (128, 128))
        tensors[w_name] = (w / expand_block_scale(s2, *q.shape, (128, 128))).to(q.dtype)
        tensors[name] = s2
        dequantized[w_name] = tensors[w_name].float() * expand_block_scale(s2, *q.shape, (128, 128))
    save_file(tensors, fp8 / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"]["scale_fmt"] = "ue8m0"
    (fp8 / "config.json").write_text(json.dumps(cfg))
    assert "model.layers.1.self_attn.indexer.wq_b.weight_scale_inv" in tensors
    assert "model.layers.1.self_attn.indexer.weights_proj.weight_scale_inv" not in tensors
    plain = tmp_path / "dequantized"
    shutil.copytree(src, plain)
    save_file(dequantized, plain / "model.safetensors", metadata={"format": "pt"})

    tokens, llm = generate(fp8, PROMPTS, dtype="float32")
    indexer = llm.engine.core.executor.runner.model.layers[1].self_attn.indexer
    assert indexer.wq_b.kernel.name == indexer.wk.kernel.name == "fp8_dequant_fallback"
    assert indexer.weights_proj.weight.dtype == torch.float32
    assert tokens == hf_greedy(plain, PROMPTS, NUM_TOKENS)


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa_shared"])
def test_mixed_steps_take_the_dense_prefill_route(checkpoints, reference, calls, kind):
    """A short prompt prefilled beside a decode whose context outgrew index_topk: that step expands the prefill
    (unscored) and scores the decode (DENSE_PREFILL; GLM-5.2's shared layers reuse the decode's selection); every
    route of the run gives transformers' tokens."""
    from kestrel.attention.sparse_mla import DENSE_PREFILL

    prompts = [list(range(10, 40)), SHORT[0]]
    tokens, _ = generate(checkpoints(kind, 8), prompts, max_num_batched_tokens=8)
    assert tokens == reference(kind, 8, tuple(map(tuple, prompts)))
    routes = {r for r, _, _ in calls["routes"]}
    assert DENSE_PREFILL in routes and SPARSE in routes
