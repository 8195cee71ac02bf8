"""A tiny Kimi-K2-like model (DeepSeek-V3 text: MLA, routed + shared experts) whose routed experts are INT4 in
compressed-tensors' pack-quantized format (tests/int4_tiny.py), loaded through our loader, against transformers
on the same model with the experts' weights dequantised by compressed-tensors (float32 twin checkpoint): greedy
tokens identical for 24 tokens on CPU float32, mixed-length prompts, also with chunked prefill and preemption."""
from __future__ import annotations

import pytest

from kestrel.kernels.moe_int4 import Int4DequantMoE
from kestrel.layers.moe import SparseMoeBlock
from tests.agreement import MIXED_PROMPTS, hf_greedy, kestrel_greedy
from tests.int4_tiny import kimi_int4_checkpoints

NUM_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer):
    return kimi_int4_checkpoints(tmp_path_factory.mktemp("kimi_int4"), tokenizer=tiny_tokenizer)


@pytest.fixture(scope="module")
def reference(checkpoints):
    return hf_greedy(checkpoints[1], MIXED_PROMPTS, NUM_TOKENS)


def test_int4_experts_greedy_match_transformers(checkpoints, reference):
    assert (checkpoints[0] / "config.json").read_text().count('"pack-quantized"') == 1
    tokens, llm = kestrel_greedy(checkpoints[0], MIXED_PROMPTS, NUM_TOKENS)
    model = llm.engine.core.executor.runner.model
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert len(blocks) == 2 and all(type(b.experts.kernel) is Int4DequantMoE for b in blocks)
    assert all(not b.fse.fused and b.shared_mlp is not None for b in blocks)  # bf16 shared experts stay apart
    assert tokens == reference


def test_int4_experts_chunked_prefill_and_preemption(checkpoints, reference):
    tokens, llm = kestrel_greedy(checkpoints[0], MIXED_PROMPTS, NUM_TOKENS, block_size=4, num_kv_blocks=24,
                                 max_num_batched_tokens=8)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert tokens == reference


def test_int4_dequantisation_matters(reference, tmp_path_factory, tiny_tokenizer):
    """The comparison can fail: the same model before its experts were quantised writes other tokens."""
    from tests.int4_tiny import KIMI
    from tests.tiny import make_checkpoint

    plain = make_checkpoint("deepseek_v3_moe", tmp_path_factory.mktemp("kimi_plain"), tokenizer=tiny_tokenizer,
                            **KIMI)
    tokens, _ = kestrel_greedy(plain, MIXED_PROMPTS, NUM_TOKENS)
    assert tokens != reference


def test_kimi_k25_text_part(checkpoints, reference, tmp_path_factory, caplog):
    """A Kimi-K2.5-shaped checkpoint (model_type kimi_k25, text under language_model., a vision tower): its text
    model loads and writes the same tokens; the vision tower is skipped with one log line; images are refused."""
    from kestrel.models.interfaces import supports_images
    from kestrel.models.kimi_k25 import KimiK25ForConditionalGeneration
    from tests.int4_tiny import kimi_k25_checkpoint

    path = kimi_k25_checkpoint(checkpoints[0], tmp_path_factory.mktemp("kimi_k25"))
    with caplog.at_level("INFO", logger="kestrel.models.kimi_k25"):
        tokens, llm = kestrel_greedy(path, MIXED_PROMPTS, NUM_TOKENS)
    model = llm.engine.core.executor.runner.model
    assert type(model) is KimiK25ForConditionalGeneration and not supports_images(model)
    assert all(type(layer.mlp.experts.kernel) is Int4DequantMoE for layer in model.layers[1:])
    assert tokens == reference
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kestrel.models.kimi_k25"]
    assert "skipped the vision tower and projector (2 tensors)" in line and "text part only" in line


def test_kimi_k2_thinking_model_type(checkpoints, reference, tmp_path_factory):
    """Kimi K2-Thinking's config.json says model_type kimi_k2 (with an auto_map to Moonshot's code), which
    transformers does not know: read as deepseek_v3 without --trust-remote-code, its quantization_config kept."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("kimi_k2") / "kimi_k2_thinking"
    shutil.copytree(checkpoints[0], path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (path / "config.json").write_text(json.dumps(config))
    tokens, llm = kestrel_greedy(path, MIXED_PROMPTS[:2], NUM_TOKENS)
    assert type(llm.engine.core.executor.runner.model.layers[1].mlp.experts.kernel) is Int4DequantMoE
    assert tokens == reference[:2]
