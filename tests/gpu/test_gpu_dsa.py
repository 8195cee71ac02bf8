"""GPU checks for DSA (skipped without CUDA): tiny DeepSeek-V3.2 and GLM-5 in bf16 on the Triton sparse MLA backend
(indexer scores + chunked top-k + sparse absorbed attention, prefills and decodes) against transformers in float32,
teacher-forced, with index_topk below most contexts so the selection decides; the sparse and the dense-prefill
routes both. The backend declares no CUDA graphs yet, so the runner runs these eagerly (asserted)."""
import pytest

from kestrel import LLM
from tests.agreement import MIXED_PROMPTS, assert_teacher_forced

pytestmark = pytest.mark.gpu
PROMPTS = MIXED_PROMPTS + [[100 + (13 * i) % 211 for i in range(48)]]


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def dsa(request, tmp_path_factory, tiny_tokenizer):
    """Latent 64 + rope 16 and a 16-head x 32 indexer: the kernels' powers of two."""
    from tests.tiny import make_checkpoint

    root = tmp_path_factory.mktemp("gpu_dsa")
    return make_checkpoint(request.param, root, tokenizer=tiny_tokenizer, hidden_size=256, intermediate_size=512,
                           kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                           q_lora_rank=64, index_topk=8, logit_scale=4.0)


@pytest.mark.parametrize("chunk", [None, 8])  # 8: chunked prefill, every prefill step takes the sparse route
def test_bf16_matches_transformers(dsa, chunk):
    llm = LLM(str(dsa), dtype="bfloat16", progress=False, num_kv_blocks=512,
              **({"max_num_batched_tokens": chunk} if chunk else {}))
    runner = llm.engine.core.executor.runner
    assert runner.backend.name == "triton_sparse_mla" and runner.graphs is None
    assert_teacher_forced(llm, dsa, PROMPTS, n=32, spare=1, device="cuda")
