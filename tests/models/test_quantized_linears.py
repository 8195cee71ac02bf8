"""Tiny Llama / Qwen3 / DeepSeek-V2 (MLA) checkpoints with quantized linear layers (issue 54): GPTQ (with and without act-order, group
sizes 32 / 64 / 128, channel), AWQ GEMM, compressed-tensors W4A16 (group, channel) and W8A8 INT8, loaded through
our loader on the CPU in float32: greedy tokens identical to transformers' on the dequantised float32 twin
(tests/w4a16_tiny.py), 16 tokens after mixed-length prompts."""
from __future__ import annotations

import pytest

from kestrel.kernels.int8 import Int8DequantFallbackLinear
from kestrel.kernels.w4a16 import W4A16DequantLinear
from tests.agreement import MIXED_PROMPTS, hf_greedy, kestrel_greedy
from tests.w4a16_tiny import quantized_checkpoints

NUM_TOKENS = 16

CASES = [
    ("gptq", "qwen3", 32, True, dict(bits=8)),  # 8-bit GPTQ (four values a word)
    ("ct_w4a16", "llama", 32, False, {}),
    ("ct_w4a16", "qwen3", None, False, {}),  # channel-wise
    ("ct_w4a16", "llama", 64, True, {}),  # actorder "group": weight_g_idx
    ("ct_w4a16_asym", "qwen3", 32, False, {}),  # zero points
    ("gptq", "llama", 32, False, {}),
    ("gptq", "qwen3", 64, True, {}),  # act-order: every projection its own column order
    ("gptq", "qwen3", 128, True, dict(hidden_size=128)),
    ("gptq", "llama", -1, False, {}),
    ("awq", "llama", 64, False, {}),
    ("awq", "qwen3", 32, False, {}),
    ("awq", "qwen2", 32, False, dict(vary_vectors=True)),  # q/k/v biases beside the 4-bit weights
    ("ct_int8", "llama", None, False, {}),
    ("ct_int8", "qwen3", None, False, {}),
    # MLA (q_a / q_b / kv_a / kv_b): the absorbed attention reads kv_b_proj's dequantised weight
    ("gptq", "deepseek_v2", 32, True, {}),
    ("awq", "deepseek_v2", 32, False, {}),
    ("ct_w4a16", "deepseek_v2", 32, False, {}),
    ("ct_int8", "deepseek_v2", None, False, {}),
]


@pytest.mark.parametrize("fmt,kind,group,act_order,overrides", CASES,
                         ids=[f"{c[0]}{c[4].get('bits', '')}-{c[1]}-g{c[2]}{'-act' if c[3] else ''}" for c in CASES])
def test_quantized_greedy_equals_dequantised_model(fmt, kind, group, act_order, overrides, tmp_path_factory,
                                                   tiny_tokenizer):
    quant, ref = quantized_checkpoints(fmt, tmp_path_factory.mktemp(fmt), kind, group, act_order,
                                       tokenizer=tiny_tokenizer, **overrides)
    reference = hf_greedy(ref, MIXED_PROMPTS, NUM_TOKENS)
    tokens, llm = kestrel_greedy(quant, MIXED_PROMPTS, NUM_TOKENS)
    model = llm.engine.core.executor.runner.model
    expected = Int8DequantFallbackLinear if fmt == "ct_int8" else W4A16DequantLinear
    linears = [m for m in model.layers.modules() if hasattr(m, "kernel")]
    assert len(linears) >= 8 and all(type(m.kernel) is expected for m in linears), linears
    assert type(model.lm_head).__name__ != "Linear" or model.lm_head.spec.quant is None
    assert tokens == reference


def test_quantization_changes_tokens(tmp_path_factory, tiny_tokenizer):
    """The comparison can fail: the model before quantisation writes other tokens than its 4-bit twin."""
    from tests.tiny import make_checkpoint

    quant, ref = quantized_checkpoints("awq", tmp_path_factory.mktemp("awq_fail"), "llama", 64,
                                       tokenizer=tiny_tokenizer)
    plain = make_checkpoint("llama", tmp_path_factory.mktemp("plain"), tokenizer=tiny_tokenizer)
    tokens, _ = kestrel_greedy(plain, MIXED_PROMPTS, NUM_TOKENS)
    assert tokens != hf_greedy(ref, MIXED_PROMPTS, NUM_TOKENS)


def test_unsupported_checkpoint_is_one_line(tmp_path_factory, tiny_tokenizer):
    """A quant_method we do not read stops the load with one line naming it."""
    import json

    quant, _ = quantized_checkpoints("gptq", tmp_path_factory.mktemp("bnb"), "llama", 32, tokenizer=tiny_tokenizer)
    config = json.loads((quant / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quant / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="^checkpoint quant_method 'bitsandbytes' is not supported"):
        kestrel_greedy(quant, MIXED_PROMPTS[:1], 2)


def test_dummy_weights_load(tmp_path_factory, tiny_tokenizer):
    """--load-format dummy (benchmarks) on a quantized config: integer tensors keep their initial values (zeros,
    the trivial g_idx), float ones are random; the model runs."""
    quant, _ = quantized_checkpoints("gptq", tmp_path_factory.mktemp("dummy"), "llama", 32, True,
                                     tokenizer=tiny_tokenizer)
    tokens, llm = kestrel_greedy(quant, MIXED_PROMPTS[:2], 4, load_format="dummy")
    assert [len(t) for t in tokens] == [4, 4]
