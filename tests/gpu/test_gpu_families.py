"""The families built from small mechanisms (tests/models/test_families.py on the CPU) on the GPU (skipped without
CUDA): a bf16 engine against transformers in float32, teacher-forced, with CUDA graphs on and off (>= 30/32 tokens
agree, or every disagreement but one a near-tie of the reference; the MoE families held instead to transformers'
own bf16 run: tests/agreement.py's MOE_BAR; chosen-token logprobs within the bf16 tolerance over what transformers'
own bf16 run costs, at all positions but one); CUDA-graph replay equals eager. Head dim 64
(the Triton attention's sizes; MLA: latent 64 + rope 16); routers sharpened (decisive_routers).

Why the MoE families are held to transformers' bf16 run: on the H100 at f5c7396 MiniMax-M2 agreed 27/32 on the
4-token prompt and Mistral 4 28/32 on the 7-token one, graphs and eager alike, and on the CPU transformers' own bf16
run agrees 25/32 and 29/32 there (ours 25 and 30): router near-ties of the tiny checkpoints, not the engine (over
seeds 0-3 on the CPU: MiniMax-M2 ours 600/640, transformers bf16 599; Mistral 4 589, 586)."""
import pytest

from kestrel import LLM
from tests.agreement import (MIXED_PROMPTS, assert_bf16_beside_transformers, assert_graph_replay_equals_eager,
                             decisive_routers)

pytestmark = pytest.mark.gpu
KV_BLOCKS = 2048
PROMPTS = MIXED_PROMPTS + [list(range(40, 100))]  # past every window or chunk (8) and query-scale step (16)
WIDE = dict(hidden_size=256, intermediate_size=512, logit_scale=4.0)
SIZES = {
    "seed_oss": dict(head_dim=64),
    "smollm3": dict(head_dim=64),
    "olmo3": dict(head_dim=64),
    "glm4": dict(head_dim=64),  # sandwich norms, pair rotary on half of each head
    "ministral3": dict(head_dim=64),
    "ernie4_5_moe": dict(head_dim=64, moe_intermediate_size=128),
    "hunyuan_v1_moe": dict(head_dim=64, intermediate_size=128),
    "minimax_m2": dict(head_dim=64, intermediate_size=128),
    "llama4": dict(head_dim=64, intermediate_size=128, intermediate_size_mlp=512),
    "mistral4": dict(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=64,
                     moe_intermediate_size=128),
    "gpt_oss": dict(head_dim=64, intermediate_size=128),  # sinks in the Triton kernels, the reference MoE
    "gpt_oss_mxfp4": dict(head_dim=64, intermediate_size=128),  # its experts in MXFP4, dequantised on load
}
MOE = {"ernie4_5_moe", "hunyuan_v1_moe", "minimax_m2", "llama4", "mistral4", "gpt_oss", "gpt_oss_mxfp4"}


def _build(kind, root, tokenizer, **kw):
    from tests.tiny import gpt_oss_mxfp4_checkpoint, make_checkpoint

    if kind == "gpt_oss_mxfp4":
        return gpt_oss_mxfp4_checkpoint(root, tokenizer=tokenizer, **kw)
    return make_checkpoint(kind, root, tokenizer=tokenizer, vary_vectors=True, **kw)


def _hf_load(kind) -> dict:
    """transformers' from_pretrained options: MXFP4 experts dequantised (as its CPU path does)."""
    if kind != "gpt_oss_mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer):
    root, built = tmp_path_factory.mktemp("gpu_families"), {}

    def get(kind):
        if kind not in built:
            built[kind] = _build(kind, root, tiny_tokenizer, **{**WIDE, **SIZES[kind]})
            decisive_routers(built[kind])
        return built[kind]

    return get


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("kind", list(SIZES))
def test_bf16_matches_transformers(checkpoint, kind, graphs):
    path = str(checkpoint(kind))
    llm = LLM(path, dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS, enforce_eager=not graphs)
    assert (llm.engine.core.executor.runner.graphs is not None) == graphs
    assert_bf16_beside_transformers(llm, path, PROMPTS, kind in MOE, kind, **_hf_load(kind))


@pytest.mark.parametrize("kind", list(SIZES))
def test_cuda_graph_replay_equals_eager(checkpoint, kind):
    assert_graph_replay_equals_eager(checkpoint(kind), PROMPTS, KV_BLOCKS)
