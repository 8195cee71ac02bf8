"""The engine with an FP8 KV cache (--kv-cache-dtype, LLM(kv_cache_dtype=...)) on the CPU reference backend, on tiny
random checkpoints: GQA (Llama 3), q/k norms (Qwen3), sliding windows + soft-capping (Gemma 3).

Accuracy, teacher-forced against transformers in float32 (the engine in float32 too, so the float8 cache is the
only difference; with the cache in float32 the engine matches to ~1e-6). Stated tolerances, per prompt of 32 greedy
tokens: e4m3 at least 28 tokens agree and every chosen token's logprob within 0.15; e5m2 (2 mantissa bits) at least
26 and 0.4. Measured (session 13, the 4 MIXED_PROMPTS x 3 models): e4m3 29-32 agree, max error 0.09; e5m2 27-32,
0.27. Capacity: the same KV memory holds twice the tokens of a bf16 cache."""
from __future__ import annotations

import logging

import pytest
import torch

from kestrel import LLM
from kestrel.errors import ConfigError
from tests.agreement import MIXED_PROMPTS, teacher_forced_errors
from tests.tiny import make_checkpoint

TOLERANCE = {"fp8": (28, 0.15), "fp8_e5m2": (26, 0.4)}  # (tokens of 32 that agree, max |logprob error|)
KINDS = ["llama_gqa_llama3", "qwen3", "gemma3"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("fp8_kv")
    return {k: make_checkpoint(k, root, tokenizer=tiny_tokenizer) for k in KINDS + ["deepseek_v2"]}


def runner_of(llm):
    return llm.engine.core.executor.runner


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", ["fp8", "fp8_e5m2"])
def test_teacher_forced_agreement_with_a_float8_cache(models, kind, cache):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(models[kind]), kv_cache_dtype=cache, progress=False)
    groups = runner_of(llm).kv_cache_groups
    assert {g.spec.dtype for g in groups} == {torch.float8_e4m3fn if cache == "fp8" else torch.float8_e5m2}
    hf = AutoModelForCausalLM.from_pretrained(str(models[kind]), dtype=torch.float32).eval()
    min_agree, max_err = TOLERANCE[cache]
    for p in MIXED_PROMPTS:
        agree, errors, _, _ = teacher_forced_errors(llm, hf, p, 32, "cpu")
        assert agree >= min_agree and max(errors) < max_err, (kind, cache, len(p), agree, max(errors))
        assert max(errors) > 0  # the cache is really quantised (the float32 cache matches to ~1e-6)


def test_the_pool_holds_twice_the_tokens_of_a_bf16_cache(models, caplog):
    path = str(models["llama_gqa_llama3"])
    opts = dict(dtype="bfloat16", kv_cache_memory=4 * 2**20, progress=False)
    bf16 = runner_of(LLM(path, **opts))
    with caplog.at_level(logging.INFO, logger="kestrel.engine.core"):
        fp8 = runner_of(LLM(path, kv_cache_dtype="fp8_e4m3", **opts))
    assert fp8.bytes_per_block * 2 == bf16.bytes_per_block
    assert fp8.num_blocks == 2 * bf16.num_blocks
    tokens = fp8.num_blocks * fp8.block_size
    assert any(f"= {tokens} tokens" in r.message and "float8_e4m3fn" in r.message for r in caplog.records)


def test_checkpoint_scales_are_loaded_and_used(models, tmp_path):
    """An FP8-checkpoint-style k_scale / v_scale per attention module reaches the layer and its impl, and the
    cache holds K / k_scale: the float8 values of the prompt's keys span the range the scale gives them."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = models["llama_gqa_llama3"]
    path = tmp_path / "scaled"
    shutil.copytree(src, path)
    f = next(path.glob("*.safetensors"))
    tensors = load_file(f)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.004)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.002)
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor([0.003])
    save_file(tensors, f, metadata={"format": "pt"})
    llm = LLM(str(path), kv_cache_dtype="fp8", progress=False)
    runner = runner_of(llm)
    layers = runner.loaded.context.attention_layers
    l0, l1 = layers["model.layers.0.self_attn.attn"], layers["model.layers.1.self_attn.attn"]
    assert (l0.k_scale.item(), l0.v_scale.item()) == pytest.approx((0.004, 0.002))
    assert (l1.k_scale.item(), l1.v_scale.item()) == pytest.approx((0.003, 0.003))
    assert l0.impl.k_scale is l0.k_scale and l0.impl.v_scale is l0.v_scale
    unscaled = runner_of(LLM(str(src), kv_cache_dtype="fp8", progress=False))
    assert unscaled.loaded.context.attention_layers["model.layers.0.self_attn.attn"].k_scale.item() == 1.0
    llm.generate([list(range(10, 40))], _greedy(1))
    k_cache = l0.kv_cache[0].float()
    # keys of this model are O(0.1-1): stored / 0.004 they reach far up the float8 range (unscaled they stay < 2)
    assert k_cache.abs().max().item() > 50


def test_calculate_kv_scales_sets_them_from_the_first_batch(models):
    from transformers import AutoModelForCausalLM

    path = str(models["qwen3"])
    llm = LLM(path, kv_cache_dtype="fp8", calculate_kv_scales=True, progress=False)
    layers = list(runner_of(llm).loaded.context.attention_layers.values())
    assert all(layer.calibrate_kv_scales and layer.k_scale.item() == 1.0 for layer in layers)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    min_agree, max_err = TOLERANCE["fp8"]
    agree, errors, _, _ = teacher_forced_errors(llm, hf, MIXED_PROMPTS[2], 32, "cpu")
    assert agree >= min_agree and max(errors) < max_err, (agree, max(errors))
    first = [(layer.k_scale.item(), layer.v_scale.item()) for layer in layers]
    assert not any(layer.calibrate_kv_scales for layer in layers)
    assert all(0 < k != 1.0 and 0 < v != 1.0 for k, v in first)
    llm.generate([[5, 6, 7]], _greedy(2))
    assert [(layer.k_scale.item(), layer.v_scale.item()) for layer in layers] == first  # set once


def test_mla_with_a_float8_cache_is_refused_at_start_up(models):
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype fp8: an FP8 cache of MLASpec pages \(layer "
                                          r"model\.layers\.0\.self_attn.*\) is not implemented"):
        LLM(str(models["deepseek_v2"]), kv_cache_dtype="fp8", progress=False)


def _greedy(n):
    from kestrel import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
