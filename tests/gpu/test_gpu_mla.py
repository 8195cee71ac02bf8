"""GPU checks for MLA (skipped without CUDA): a tiny DeepSeek-V3 in bf16 on the Triton MLA backend (absorbed decode
kernel, dense prefill through the varlen Triton attention) against transformers, and CUDA-graph replay vs eager."""
import pytest
import torch

from kestrel import LLM, SamplingParams
from tests.agreement import MIXED_PROMPTS

pytestmark = pytest.mark.gpu
KV_BLOCKS = 2048
PROMPTS = MIXED_PROMPTS


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, tiny_tokenizer):
    """Latent 64 + rope 16 (the kernel's powers of two), wider than the CPU tiny models."""
    from tests.tiny import make_checkpoint

    root = tmp_path_factory.mktemp("gpu_mla")
    return make_checkpoint("deepseek_v3", root, tokenizer=tiny_tokenizer, hidden_size=256, intermediate_size=512,
                           kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                           q_lora_rank=64, logit_scale=4.0)


def test_bf16_matches_transformers(deepseek):
    from transformers import AutoModelForCausalLM

    from tests.agreement import teacher_forced_agreement

    llm = LLM(str(deepseek), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS)
    assert llm.engine.core.executor.runner.backend.name == "triton_mla"
    hf = AutoModelForCausalLM.from_pretrained(deepseek, dtype=torch.bfloat16).cuda().eval()
    for p in PROMPTS:
        agree, lp_err, tol = teacher_forced_agreement(llm, hf, p, 32, "cuda")
        assert agree >= 30, (p, agree)
        assert lp_err < tol, (p, lp_err, tol)


def test_cuda_graph_replay_equals_eager(deepseek):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS * 3
    graphs = LLM(str(deepseek), dtype="bfloat16", progress=False, async_scheduling="off", num_kv_blocks=KV_BLOCKS)
    assert graphs.engine.core.executor.runner.graphs is not None
    eager = LLM(str(deepseek), dtype="bfloat16", enforce_eager=True, progress=False, async_scheduling="off",
                num_kv_blocks=KV_BLOCKS)
    a = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert a == b
