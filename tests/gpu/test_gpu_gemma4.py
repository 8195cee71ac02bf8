"""Gemma 4 (tests/models/test_gemma4.py on the CPU) on the GPU (skipped without CUDA): a bf16 engine against
transformers in float32, teacher-forced, with CUDA graphs on and off (>= 30/32 tokens agree, or every disagreement
but one a near-tie of the reference; the MoE checkpoint held instead to transformers' own bf16 run, MOE_BAR);
CUDA-graph replay equals eager. Heads of 64 (sliding) and 128 (global), the Triton attention's sizes, so both
groups and the KV-shared readers run on the Triton backend; the MoE on the Triton fused kernel's GELU epilogue."""
import pytest

from kestrel import LLM
from tests.agreement import (MIXED_PROMPTS, assert_bf16_beside_transformers, assert_graph_replay_equals_eager,
                             decisive_routers)
from tests.tiny import GEMMA4_CONFIGS

pytestmark = pytest.mark.gpu
KV_BLOCKS = 2048
PROMPTS = MIXED_PROMPTS + [list(range(40, 100))]  # past the window (8)
SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=64, global_head_dim=128, logit_scale=4.0)
MOE = {"gemma4_moe"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer):
    from tests.tiny import make_checkpoint

    root, built = tmp_path_factory.mktemp("gpu_gemma4"), {}

    def get(kind):
        if kind not in built:
            extra = dict(moe_intermediate_size=128) if kind in MOE else {}
            built[kind] = make_checkpoint(kind, root, tokenizer=tiny_tokenizer, **SIZES, **extra)
            decisive_routers(built[kind])
        return built[kind]

    return get


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("kind", sorted(GEMMA4_CONFIGS))
def test_bf16_matches_transformers(checkpoint, kind, graphs):
    path = str(checkpoint(kind))
    llm = LLM(path, dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS, enforce_eager=not graphs)
    runner = llm.engine.core.executor.runner
    assert (runner.graphs is not None) == graphs
    assert {b.name for b in runner.backends} == {"triton"}
    if kind in MOE:
        assert runner.model.layers[0].moe.experts.kernel_name == "triton_fused_moe"
    assert_bf16_beside_transformers(llm, path, PROMPTS, kind in MOE, kind)


@pytest.mark.parametrize("kind", sorted(GEMMA4_CONFIGS))
def test_cuda_graph_replay_equals_eager(checkpoint, kind):
    assert_graph_replay_equals_eager(checkpoint(kind), PROMPTS, KV_BLOCKS)


def test_global_heads_of_512_on_triton(tmp_path, tiny_tokenizer):
    """Gemma 4's real global head size (512, K = V) on the Triton backend with CUDA graphs: the tiles the
    launchers choose for heads of 512 (triton_attention's default configs), teacher-forced beside transformers."""
    from tests.tiny import make_checkpoint

    path = make_checkpoint("gemma4_k_eq_v", tmp_path, tokenizer=tiny_tokenizer, **{**SIZES, "global_head_dim": 512})
    llm = LLM(str(path), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS)
    runner = llm.engine.core.executor.runner
    assert runner.graphs is not None and {b.name for b in runner.backends} == {"triton"}
    assert 512 in {layer.head_dim for layer in runner.model.modules() if hasattr(layer, "kv_cache_spec")}
    assert_bf16_beside_transformers(llm, str(path), PROMPTS, False, "gemma4 heads of 512")
