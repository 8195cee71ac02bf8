"""GPU checks of the FP8 KV cache (skipped without CUDA): the Triton backend with float8 K/V (fused cache write,
decode, prefill, sliding windows, CUDA graphs) against transformers, and graph replay against eager.

Tolerance (teacher-forced against transformers in float32, 32 tokens a prompt): the bf16 engine's own tolerance
(tests/agreement.py) plus what the float8 cache costs on the CPU (tests/models/test_fp8_kv_cache.py: e4m3 0.15,
e5m2 0.4), and at least 28 (e4m3) / 26 (e5m2) tokens agreeing."""
import pytest
import torch

from kestrel import LLM, SamplingParams
from tests.agreement import MIXED_PROMPTS, teacher_forced_errors
from tests.gpu.test_gpu_engine import tiny_models  # noqa: F401  (the fixture: its head-dim-64 models)

pytestmark = pytest.mark.gpu
KV_BLOCKS = 2048
TOLERANCE = {"fp8": (28, 0.15), "fp8_e5m2": (26, 0.4)}


def check_against_transformers(llm, path, cache):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    min_agree, fp8_err = TOLERANCE[cache]
    for p in MIXED_PROMPTS:
        agree, errors, bf16_tol, _ = teacher_forced_errors(llm, hf, p, 32, "cuda")
        assert agree >= min_agree and max(errors) < bf16_tol + fp8_err, (path, cache, len(p), agree, max(errors))


@pytest.mark.parametrize("kind", ["llama_gqa_llama3", "qwen3", "gemma3"])
@pytest.mark.parametrize("cache", ["fp8", "fp8_e5m2"])
def test_fp8_kv_matches_transformers(tiny_models, kind, cache):
    llm = LLM(str(tiny_models[kind]), dtype="bfloat16", kv_cache_dtype=cache, progress=False, num_kv_blocks=KV_BLOCKS)
    runner = llm.engine.core.executor.runner
    assert runner.backend.name == "triton"
    assert all(g.spec.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for g in runner.kv_cache_groups)
    check_against_transformers(llm, str(tiny_models[kind]), cache)


def test_fp8_kv_cuda_graph_replay_equals_eager(tiny_models):
    """Gemma 3 (sliding windows, several KV groups) with a float8 cache: graph replay gives the eager tokens."""
    path = str(tiny_models["gemma3"])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    opts = dict(dtype="bfloat16", kv_cache_dtype="fp8", progress=False, async_scheduling="off",
                num_kv_blocks=KV_BLOCKS)
    graphs = LLM(path, **opts)
    assert graphs.engine.core.executor.runner.graphs is not None
    eager = LLM(path, enforce_eager=True, **opts)
    a = [o.outputs[0].token_ids for o in graphs.generate(MIXED_PROMPTS * 3, params)]
    b = [o.outputs[0].token_ids for o in eager.generate(MIXED_PROMPTS * 3, params)]
    assert a == b


def test_calculated_scales_reach_the_captured_graphs(tiny_models):
    """--calculate-kv-scales sets the scales after graph capture (first real prefill, unfused path); the decode
    graphs read them through their pointers: graph decoding equals eager decoding with the same scales."""
    path = str(tiny_models["qwen3"])
    opts = dict(dtype="bfloat16", kv_cache_dtype="fp8", calculate_kv_scales=True, progress=False,
                async_scheduling="off", num_kv_blocks=KV_BLOCKS)
    graphs = LLM(path, **opts)
    eager = LLM(path, enforce_eager=True, **opts)
    first = SamplingParams(temperature=0, max_tokens=1)
    for llm in (graphs, eager):  # both calibrate on the same first prompt
        llm.generate([MIXED_PROMPTS[2]], first)
    layers = [list(llm.engine.core.executor.runner.loaded.context.attention_layers.values())
              for llm in (graphs, eager)]
    assert all(layer.k_scale.item() != 1.0 and not layer.calibrate_kv_scales for layer in layers[0])
    assert [x.k_scale.item() for x in layers[0]] == [x.k_scale.item() for x in layers[1]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in graphs.generate(MIXED_PROMPTS, params)]
    b = [o.outputs[0].token_ids for o in eager.generate(MIXED_PROMPTS, params)]
    assert a == b
    check_against_transformers(graphs, path, "fp8")
