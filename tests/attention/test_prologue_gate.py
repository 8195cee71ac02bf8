"""The fused q/k norm-rope prologue rounds as Llama's RMSNorm does: an attention layer whose q/k norm is not
`fusable` (GemmaRMSNorm: transformers' float32 (1 + w) order) must not take it."""
import pytest

from kestrel import LLM
from kestrel.attention.layer import Attention
from tests.tiny import make_checkpoint


@pytest.mark.parametrize("kind,fused", [("qwen3", True), ("gemma3", False)])
def test_prologue_follows_the_norms_fusable_flag(tmp_path, tiny_tokenizer, kind, fused):
    llm = LLM(str(make_checkpoint(kind, tmp_path, tokenizer=tiny_tokenizer)), device="cpu", progress=False)
    layers = [m for m in llm.engine.core.executor.runner.model.modules() if isinstance(m, Attention)]
    assert layers and {layer.plain_prologue for layer in layers} == {fused}
    llm.shutdown()
