"""GPU checks (skipped without CUDA): bf16 engine vs transformers, CUDA-graph replay vs eager."""
import pytest
import torch

from kestrel import LLM, SamplingParams

pytestmark = pytest.mark.gpu


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
    }

PROMPTS = [[5, 17, 99, 3], [7] * 11 + [42, 43], list(range(10, 40)), [200, 201, 202, 203, 204, 205, 206]]


def _hf_tokens(path, prompts, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        g = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                           output_logits=True, return_dict_in_generate=True)
        outs.append((g.sequences[0, len(p):].tolist(), [l[0].float().log_softmax(-1) for l in g.logits]))
    return outs


@pytest.mark.parametrize("kind", ["llama", "llama_gqa_llama3", "qwen3"])
def test_bf16_matches_transformers(tiny_models, kind):
    path = str(tiny_models[kind])
    llm = LLM(path, dtype="bfloat16", progress=False)
    assert llm.engine.core.runner.backend.name == "triton"
    ours = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1))
    for o, (ref, ref_lp) in zip(ours, _hf_tokens(path, PROMPTS, 32)):
        toks = o.outputs[0].token_ids
        agree = sum(a == b for a, b in zip(toks, ref))
        assert agree >= 30, (kind, agree, toks, ref)
        # logprobs of the tokens both chose, up to the first divergence: within bf16 tolerance
        for i, (a, b) in enumerate(zip(toks, ref)):
            if a != b:
                break
            assert abs(o.outputs[0].logprobs[i][a].logprob - ref_lp[i][a].item()) < 0.1


def test_cuda_graph_replay_equals_eager(tiny_models):
    path = str(tiny_models["qwen3"])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS * 3  # 12 requests: padded to a captured size of 16
    graphs = LLM(path, dtype="bfloat16", progress=False, async_scheduling="off")
    assert graphs.engine.core.runner.graphs is not None
    eager = LLM(path, dtype="bfloat16", enforce_eager=True, progress=False, async_scheduling="off")
    assert eager.engine.core.runner.graphs is None
    a = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert a == b


def test_seeded_sampling_on_gpu_is_batch_invariant(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", progress=False)
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], sp)[0].outputs[0].token_ids
    batch = llm.generate(PROMPTS, [sp] + [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 3)
    assert batch[0].outputs[0].token_ids == alone


def test_pipelined_decode_equals_synchronous_on_gpu(tiny_models):
    path = str(tiny_models["llama"])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in LLM(path, dtype="bfloat16", progress=False, async_scheduling="on")
         .generate(PROMPTS * 4, params)]
    b = [o.outputs[0].token_ids for o in LLM(path, dtype="bfloat16", progress=False, async_scheduling="off")
         .generate(PROMPTS * 4, params)]
    assert a == b
