"""Families built from small mechanisms (each an option of the layer it changes, read from the config) against
transformers on the same tiny weights (CPU, float32): greedy tokens identical for 24 tokens on prompts longer than
any sliding window or attention chunk, also with chunked prefill and preemption forced (asserted to have
happened)."""
import pytest

from kestrel.core.kv_spec import SlidingWindowSpec
from tests.agreement import hf_greedy, kestrel_greedy
from tests.tiny import FAMILY_CONFIGS, make_checkpoint

NUM_TOKENS = 24
# windows and chunks of 8: every prompt but the first is longer, and 24 outputs run past them anyway
PROMPTS = [[5, 17, 99, 3], [7] * 11 + [42, 43], list(range(10, 40)), [200, 201, 202, 203, 204, 205, 206, 300, 301]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer):
    root, built = tmp_path_factory.mktemp("families"), {}

    def get(kind: str):
        if kind not in built:
            built[kind] = make_checkpoint(kind, root, tokenizer=tiny_tokenizer, vary_vectors=True)
        return built[kind]

    return get


def _model(llm):
    return llm.engine.core.executor.runner.model


# what each family's layers must have been built with (the option is read, not assumed)
def _check_seed_oss(model):
    attn = model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and getattr(attn.o_proj, "bias", None) is None


def _check_smollm3(model):
    assert [layer.self_attn.attn.rotary is None for layer in model.layers] == [False, False, False, True]


def _check_olmo3(model):
    specs = [type(layer.self_attn.attn.kv_cache_spec) for layer in model.layers]
    assert [s is SlidingWindowSpec for s in specs] == [True, True, True, False]
    assert all(layer.self_attn.attn.qk_norm_all_heads for layer in model.layers)


def _check_ernie4_5_moe(model):
    assert [layer.is_moe for layer in model.layers] == [False, True, True]
    gate = model.layers[1].mlp.gate
    assert gate.cfg.scoring == "softmax" and gate.e_score_correction_bias.abs().sum() > 0
    assert model.layers[0].self_attn.attn.rotary.interleaved


def _check_hunyuan_v1_moe(model):
    attn = model.layers[0].self_attn
    assert attn.attn.qk_norm_after_rope and attn.query_layernorm is attn.attn._qk_norms[0]
    assert all(layer.mlp.shared_mlp is not None or layer.mlp.fse.fused for layer in model.layers)


def _check_minimax_m2(model):
    attn = model.layers[0].self_attn.attn
    assert attn.qk_norm_all_heads and attn.rotary.rot_dim == 8
    gate = model.layers[0].block_sparse_moe.gate
    assert gate.cfg.scoring == "sigmoid" and gate.e_score_correction_bias.abs().sum() > 0


def _check_ministral3(model):
    scale = model.layers[0].self_attn.attn.query_scale
    assert scale is not None and (scale.alpha, scale.period, scale.offset) == (0.5, 16.0, 0.0)


def _check_mistral4(model):
    attn = model.layers[0].self_attn
    assert attn.query_scale is not None and attn.mla_attn.rotary.interleaved
    gate = model.layers[1].mlp.gate
    assert (gate.cfg.scoring, gate.cfg.num_groups, gate.cfg.group_score) == ("softmax", 2, "top2_sum")


def _check_olmo2(model):
    assert all(layer.self_attn.attn.qk_norm_all_heads for layer in model.layers)
    assert not hasattr(model.layers[0], "input_layernorm")


def _check_llama4(model):
    from kestrel.core.kv_spec import ChunkedLocalAttentionSpec

    attns = [layer.self_attn.attn for layer in model.layers]
    assert [type(a.kv_cache_spec) is ChunkedLocalAttentionSpec for a in attns] == [True, True, True, False]
    assert [a.rotary is None for a in attns] == [False, False, False, True]
    assert attns[3].query_scale is not None and attns[0].query_scale is None
    assert [layer.is_moe for layer in model.layers] == [False, True, False, True]
    assert model.layers[1].feed_forward.weights_on_input


def _check_gpt_oss(model):
    from kestrel.core.kv_spec import SlidingWindowSpec

    attns = [layer.self_attn.attn for layer in model.layers]
    assert [type(a.kv_cache_spec) is SlidingWindowSpec for a in attns] == [True, False]
    assert all(a.sinks is not None and a.sinks.abs().min() > 0 and a.impl.sinks is a.sinks for a in attns)
    block = model.layers[0].mlp
    assert block.experts.spec.activation == "swigluoai" and block.experts.spec.bias
    assert block.gate.bias is not None and block.gate.bias.abs().min() > 0
    assert block.experts.w13_bias.abs().min() > 0


def _check_glm4(model):
    layer = model.layers[0]
    attn = layer.self_attn
    assert attn.attn.rotary.interleaved and attn.attn.rotary.rot_dim == 8
    assert attn.qkv_proj.bias is not None and getattr(attn.o_proj, "bias", None) is None
    assert layer._out_norms == (layer.post_self_attn_layernorm, layer.post_mlp_layernorm)


CHECKS = {"gpt_oss": _check_gpt_oss, "llama4": _check_llama4, "olmo2": _check_olmo2, "mistral4": _check_mistral4, "ministral3": _check_ministral3, "seed_oss": _check_seed_oss, "smollm3": _check_smollm3, "olmo3": _check_olmo3,
          "ernie4_5_moe": _check_ernie4_5_moe, "hunyuan_v1_moe": _check_hunyuan_v1_moe,
          "minimax_m2": _check_minimax_m2, "glm4": _check_glm4}
# KV blocks of 4 tokens: the longest request fits alone (1 block table, or several where sliding layers group
# apart), the four together do not
KV_BLOCKS = {"olmo3": 40, "llama4": 64}


@pytest.mark.parametrize("kind", list(FAMILY_CONFIGS))
def test_greedy_matches_transformers(checkpoint, kind):
    path = checkpoint(kind)
    ref = hf_greedy(path, PROMPTS, NUM_TOKENS)
    tokens, llm = kestrel_greedy(path, PROMPTS, NUM_TOKENS)
    CHECKS[kind](_model(llm))
    assert tokens == ref
    tokens, llm = kestrel_greedy(path, PROMPTS, NUM_TOKENS, block_size=4, num_kv_blocks=KV_BLOCKS.get(kind, 24),
                                 max_num_batched_tokens=8)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert tokens == ref


def test_docs_list_every_architecture():
    """docs/models.md has a row for every architecture the registry serves."""
    from pathlib import Path

    from kestrel.models.registry import supported_architectures

    doc = (Path(__file__).parents[2] / "docs" / "models.md").read_text()
    assert [a for a in supported_architectures() if a not in doc] == []
