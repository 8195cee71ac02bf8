"""GPU checks (skipped without CUDA): bf16 engine vs transformers, CUDA-graph replay vs eager."""
import pytest
import torch

from kestrel import LLM, SamplingParams
from tests.agreement import MIXED_PROMPTS

pytestmark = pytest.mark.gpu
KV_BLOCKS = 2048  # several engines live in this process: a fixed cache each instead of 90% of the device


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, tiny_tokenizer):
    """Tiny models with head dim 64 (the Triton kernels are checked for 64/128/256)."""
    from tests.tiny import make_checkpoint

    root = tmp_path_factory.mktemp("gpu_models")
    wide = dict(hidden_size=256, intermediate_size=512, logit_scale=4.0)
    return {
        "llama": make_checkpoint("llama", root, tokenizer=tiny_tokenizer, **wide),
        "llama_gqa_llama3": make_checkpoint("llama_gqa_llama3", root, tokenizer=tiny_tokenizer, **wide),
        "qwen3": make_checkpoint("qwen3", root, tokenizer=tiny_tokenizer, head_dim=64, **wide),
        # 6 KV-cache groups (5 sliding-window, 1 full): every group's block table and slot mapping under graphs
        "gemma3": make_checkpoint("gemma3", root, tokenizer=tiny_tokenizer, head_dim=64, **wide),
    }

PROMPTS = MIXED_PROMPTS


@pytest.mark.parametrize("kind", ["llama", "llama_gqa_llama3", "qwen3"])
def test_bf16_matches_transformers(tiny_models, kind):
    from transformers import AutoModelForCausalLM

    from tests.agreement import teacher_forced_agreement

    path = str(tiny_models[kind])
    llm = LLM(path, dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS)
    assert llm.engine.core.executor.runner.backend.name == "triton"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    for p in PROMPTS:
        agree, lp_err, tol = teacher_forced_agreement(llm, hf, p, 32, "cuda")
        assert agree >= 30, (kind, p, agree)
        assert lp_err < tol, (kind, p, lp_err, tol)


def test_cuda_graph_replay_equals_eager(tiny_models):
    path = str(tiny_models["qwen3"])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS * 3  # 12 requests: padded to a captured size of 16
    graphs = LLM(path, dtype="bfloat16", progress=False, async_scheduling="off", num_kv_blocks=KV_BLOCKS)
    assert graphs.engine.core.executor.runner.graphs is not None
    eager = LLM(path, dtype="bfloat16", enforce_eager=True, progress=False, async_scheduling="off",
                num_kv_blocks=KV_BLOCKS)
    assert eager.engine.core.executor.runner.graphs is None
    a = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert a == b
    for p in PROMPTS:  # batch 1: the fused GEMV path (norm + projection + activation in one kernel)
        a = graphs.generate([p], params)[0].outputs[0].token_ids
        b = eager.generate([p], params)[0].outputs[0].token_ids
        assert a == b, p


def test_kv_groups_cuda_graph_replay_equals_eager_and_transformers(tiny_models):
    """Gemma 3: several KV-cache groups, staged together (kestrel/worker/input_batch.py); CUDA-graph replay gives
    the eager run's tokens, and both agree with transformers teacher-forced."""
    from transformers import AutoModelForCausalLM

    from tests.agreement import teacher_forced_agreement

    path = str(tiny_models["gemma3"])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    graphs = LLM(path, dtype="bfloat16", progress=False, async_scheduling="off", num_kv_blocks=KV_BLOCKS)
    runner = graphs.engine.core.executor.runner
    assert runner.graphs is not None and len(runner.kv_cache_groups) > 2
    eager = LLM(path, dtype="bfloat16", enforce_eager=True, progress=False, async_scheduling="off",
                num_kv_blocks=KV_BLOCKS)
    a = [o.outputs[0].token_ids for o in graphs.generate(PROMPTS * 3, params)]
    b = [o.outputs[0].token_ids for o in eager.generate(PROMPTS * 3, params)]
    assert a == b
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").cuda().eval()
    for p in PROMPTS:
        agree, lp_err, tol = teacher_forced_agreement(graphs, hf, p, 32, "cuda")
        assert agree >= 30, (p, agree)
        assert lp_err < tol, (p, lp_err, tol)


def test_seeded_sampling_on_gpu_is_batch_invariant(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS)
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], sp)[0].outputs[0].token_ids
    batch = llm.generate(PROMPTS, [sp] + [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 3)
    assert batch[0].outputs[0].token_ids == alone


def test_pipelined_decode_equals_synchronous_on_gpu(tiny_models):
    path = str(tiny_models["llama"])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def tokens(mode):
        llm = LLM(path, dtype="bfloat16", progress=False, async_scheduling=mode, num_kv_blocks=KV_BLOCKS)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 4, params)]

    assert tokens("on") == tokens("off")
