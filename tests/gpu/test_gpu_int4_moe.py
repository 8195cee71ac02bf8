"""INT4 (pack-quantized) experts on the GPU (skipped without CUDA): a Kimi-K2-like tiny model (tests/int4_tiny.py,
wider: hidden 256, experts of 128) in a bf16 engine, its experts dequantised on load for the Triton fused MoE
(triton_int4_dequant_moe), against transformers in float32 on the dequantised twin, teacher-forced and judged as every MoE family is (assert_bf16_beside_transformers: beside transformers' own bf16 run); CUDA-graph replay
equals eager."""
import pytest

from kestrel import LLM
from tests.agreement import MIXED_PROMPTS, assert_bf16_beside_transformers, assert_graph_replay_equals_eager

pytestmark = pytest.mark.gpu
KV_BLOCKS = 2048


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer):
    from tests.int4_tiny import kimi_int4_checkpoints

    int4, ref = kimi_int4_checkpoints(tmp_path_factory.mktemp("gpu_kimi_int4"), tokenizer=tiny_tokenizer,
                                      hidden_size=256, moe_intermediate_size=128, intermediate_size=512,
                                      logit_scale=4.0, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                                      v_head_dim=32, q_lora_rank=64)  # MLA dims the Triton backend (graphs) takes
    # no decisive_routers here: on this grouped sigmoid router (DeepSeek-V3's) the x8 sharpening made two
    # positions of a 7-token prompt cost 3.8 and 6.6 nats in bf16 (H100, session 20) where the random router
    # passes beside transformers' own bf16 run
    return int4, ref


def test_int4_moe_bf16_matches_transformers(checkpoints):
    int4, ref = checkpoints
    llm = LLM(str(int4), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS)
    blocks = llm.engine.core.executor.runner.model.moe_blocks()
    assert {b.experts.kernel_name for b in blocks.values()} == {"triton_int4_dequant_moe"}
    # as every MoE family (test_gpu_families.py): held to what transformers' own bf16 run of the dequantised twin
    # gives against its float32 run (an expert flip at a router near-tie costs a bf16 MoE a token now and then)
    assert_bf16_beside_transformers(llm, ref, MIXED_PROMPTS, moe=True, label="kimi_int4")


def test_int4_moe_cuda_graph_replay_equals_eager(checkpoints):
    assert_graph_replay_equals_eager(checkpoints[0], MIXED_PROMPTS, KV_BLOCKS)
