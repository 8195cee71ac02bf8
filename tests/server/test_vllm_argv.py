"""vLLM's command-line forms (kestrel/vllm_argv.py): rewritten into plain flags before argparse, the rest untouched."""
from __future__ import annotations

import json

import pytest

from kestrel.errors import ConfigError
from kestrel.vllm_argv import rewrite


def test_plain_command_lines_are_untouched():
    argv = ["serve", "/m", "-tp", "2", "--max-model-len", "-1", "--gpu-memory-utilization", "0.9", "--host",
            "0.0.0.0", "--served-model-name", "Qwen2.5-7B", "--chat-template=./t.jinja", "--seed", "-3"]
    assert rewrite(argv) == argv


def test_underscores_and_optimization_levels():
    assert rewrite(["serve", "--max_model_len=4k", "--enable_prefix_caching"]) == [
        "serve", "--max-model-len=4k", "--enable-prefix-caching"]
    assert rewrite(["serve", "--help=ModelConfig"]) == ["serve", "--help"]
    for form in (["-O3"], ["-O", "3"], ["-O=3"]):
        assert rewrite(["serve", *form]) == ["serve", "--optimization-level", "3"], form


def test_dotted_flags_merge_into_one_json_value():
    out = rewrite(["serve", "/m", "--speculative-config.method", "ngram",
                   "--speculative_config.num_speculative_tokens=3",
                   "--compilation-config.pass_config.fuse_norm_quant", "true", "--compilation-config.sizes+", "1,2",
                   "--compilation-config.sizes+", "4", "--max-num-batched-tokens", "8k"])
    assert out[:4] == ["serve", "/m", "--max-num-batched-tokens", "8k"]
    merged = dict(zip(out[4::2], map(json.loads, out[5::2])))
    assert merged == {"--speculative-config": {"method": "ngram", "num_speculative_tokens": 3},
                      "--compilation-config": {"pass_config": {"fuse_norm_quant": True}, "sizes": ["1", "2", "4"]}}
    assert rewrite(["serve", "--kv-transfer-config.kv_buffer_size", "1g"])[-1] == '{"kv_buffer_size": 1000000000}'


def test_config_file(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text("max_model_len: 2048\nenforce-eager: true\nenable-prefix-caching: false\ntrust-remote-code: false\n"
                    "served-model-name: [a, b]\nlimit-mm-per-prompt: {image: 2}\nrevision: null\nmodel: /from/file\n")
    known = {"--no-enable-prefix-caching", "--enforce-eager"}
    # after the subcommand and its positional model (which wins over the file's), before the command line's flags
    assert rewrite(["serve", "/m", "--config", str(path), "-tp", "2"], known) == [
        "serve", "/m", "--max-model-len", "2048", "--enforce-eager", "--no-enable-prefix-caching",
        "--served-model-name", "a", "b", "--limit-mm-per-prompt", '{"image": 2}', "-tp", "2"]
    assert rewrite(["serve", f"--config={path}"], known)[-2:] == ["--model", "/from/file"]


@pytest.mark.parametrize("argv,words", [
    (["serve", "--config", "c.json"], "--config c.json: the file must be YAML (.yaml or .yml)"),
    (["serve", "--config", "/no/c.yaml"], "--config /no/c.yaml: No such file or directory"),
    (["serve", "--config"], "--config needs a YAML file"),
    (["serve", "--config", "a.yaml", "--config", "b.yaml"], "--config is given twice"),
    (["serve", "--hf-overrides.a..b", "1"], "--hf-overrides.a..b: expected --flag.key value"),
    (["serve", "--hf-overrides.a"], "--hf-overrides.a needs a value"),
])
def test_refusals_are_one_line(argv, words):
    with pytest.raises(ConfigError) as e:
        rewrite(argv)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_config_file_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- max-model-len\n")
    with pytest.raises(ConfigError, match="expected a mapping of flag names to values"):
        rewrite(["serve", "--config", str(path)])
    path.write_text("a: [\n")
    with pytest.raises(ConfigError, match="not YAML"):
        rewrite(["serve", "--config", str(path)])
