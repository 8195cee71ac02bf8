"""gpt-oss beyond the family test (tests/models/test_families.py): its experts in the released checkpoints' MXFP4
format (`*_blocks` / `*_scales`, quant_method mxfp4) against transformers, which dequantises them on the CPU with
Mxfp4Config(dequantize=True): greedy tokens identical for 24 tokens (float32), also with chunked prefill and
preemption forced; what it refuses by name (another swiglu_limit, a backend without sinks)."""
import json

import pytest
import torch

from tests.agreement import hf_causal_lm, hf_greedy, kestrel_greedy
from tests.models.test_families import NUM_TOKENS, PROMPTS
from tests.tiny import gpt_oss_mxfp4_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer):
    return gpt_oss_mxfp4_checkpoint(tmp_path_factory.mktemp("gpt_oss_mxfp4"), tokenizer=tiny_tokenizer)


def _hf_kwargs():
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def test_checkpoint_is_in_the_real_format(checkpoint):
    from safetensors import safe_open

    assert json.loads((checkpoint / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    with safe_open(str(next(checkpoint.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
        blocks = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks")
    assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (4, 64, 2, 16)  # [E, 2I, H / 32, 16]
    assert "model.layers.0.mlp.experts.down_proj_scales" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    # transformers reads it as MXFP4 (its experts are the dequantised values, not the float weights we quantised)
    hf = hf_causal_lm(checkpoint, dtype=torch.float32, **_hf_kwargs())
    assert hf.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 64, 64)


def test_greedy_matches_transformers(checkpoint):
    ref = hf_greedy(checkpoint, PROMPTS, NUM_TOKENS, **_hf_kwargs())
    tokens, llm = kestrel_greedy(checkpoint, PROMPTS, NUM_TOKENS)
    model = llm.engine.core.executor.runner.model
    assert {b.experts.kernel_name for b in model.moe_blocks().values()} == {"mxfp4_dequant_moe"}
    assert tokens == ref
    tokens, llm = kestrel_greedy(checkpoint, PROMPTS, NUM_TOKENS, block_size=4, num_kv_blocks=24,
                                 max_num_batched_tokens=8)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert tokens == ref


def test_another_swiglu_limit_is_refused(tmp_path, tiny_tokenizer):
    from kestrel import LLM
    from kestrel.errors import ConfigError
    from tests.tiny import make_checkpoint

    path = make_checkpoint("gpt_oss", tmp_path, tokenizer=tiny_tokenizer)
    cfg = json.loads((path / "config.json").read_text())
    cfg["swiglu_limit"] = 10.0
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="swiglu_limit 10.0 is not supported"):
        LLM(str(path), progress=False)


def test_a_backend_without_sinks_is_not_selected(checkpoint, monkeypatch):
    """The layers' sinks are a requirement of the backend choice: with the reference backend made to lack them,
    no backend fits on the CPU, and the error names the missing capability."""
    from kestrel import LLM
    from kestrel.attention.backends.torch_ref import TorchRefBackend
    from kestrel.errors import ConfigError

    monkeypatch.setattr(TorchRefBackend, "supports_attention_sinks", False)
    with pytest.raises(ConfigError, match="torch_ref: lacks supports_attention_sinks"):
        LLM(str(checkpoint), progress=False)
