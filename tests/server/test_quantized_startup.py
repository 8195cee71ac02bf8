"""Issue 54: a checkpoint whose quantization we do not read, or a --quantization that contradicts the checkpoint,
stops `kestrel serve` with one line naming it, before any engine starts; vLLM's --quantization names parse."""
from __future__ import annotations

import json

import pytest

from test_startup_errors import one_line_refusal, serve


@pytest.fixture(scope="module")
def gptq_model(tmp_path_factory, tiny_tokenizer):
    from tests.w4a16_tiny import quantized_checkpoints

    return quantized_checkpoints("gptq", tmp_path_factory.mktemp("gptq_serve"), "llama", 32,
                                 tokenizer=tiny_tokenizer)[0]


def test_unread_quant_method_is_one_line(gptq_model, tmp_path):
    import shutil

    folder = tmp_path / "bnb"
    shutil.copytree(gptq_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    one_line_refusal(serve(str(folder)), "checkpoint quant_method 'bitsandbytes' is not supported")


@pytest.mark.parametrize("flags,words", [
    (["--quantization", "awq"], "quantization='awq' does not match the checkpoint's quant_method 'gptq'"),
    (["--quantization", "bitsandbytes"], "argument --quantization/-q: invalid choice: 'bitsandbytes'"),
])
def test_quantization_flag_mismatch_is_one_line(gptq_model, flags, words):
    one_line_refusal(serve(str(gptq_model), *flags), words)


def test_unsupported_variant_is_one_line(gptq_model, tmp_path):
    import shutil

    folder = tmp_path / "gptq3"
    shutil.copytree(gptq_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["bits"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    one_line_refusal(serve(str(folder)), "gptq checkpoint: 3-bit weights are not supported (4 or 8-bit only)")
