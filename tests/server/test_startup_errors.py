"""Issue 36: every CLI mistake and start-up refusal of `kestrel serve` is one line on stderr and exit 2, never a
traceback; a model given as a hub id comes from the local Hugging Face cache (offline) or gets one line saying how
to point at a folder."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, free_port


def serve(*args: str, env: dict | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **(env or {})}
    defaults = ["--port", str(free_port()), "--cpu-threads", "1", "--num-kv-blocks", "16", "--max-model-len", "128"]
    return subprocess.run([sys.executable, "-m", "kestrel.cli", "serve", *args[:1], *defaults, *args[1:]],
                          capture_output=True, text=True, env=e, cwd=ROOT, timeout=timeout)


def one_line_refusal(run: subprocess.CompletedProcess, words: str) -> None:
    err = run.stderr.strip()
    assert "Traceback" not in run.stderr and "Traceback" not in run.stdout, run.stderr[-3000:]
    assert run.returncode == 2, (run.returncode, err[-3000:])
    last = err.splitlines()[-1]
    assert words in last and last.startswith("kestrel"), err[-3000:]
    assert sum(line.startswith("kestrel") and "error" in line for line in err.splitlines()) == 1, err[-3000:]


@pytest.mark.parametrize("flags,words", [
    (["--lora-modules", "a=/x"], "kestrel: error: --lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "nameonly"],
     """--lora-modules expects name=path or {"name": ..., "path": ...}, got 'nameonly'"""),
    (["--enable-lora", "--lora-modules", "a=/no/such/adapter"],
     "--lora-modules a=/no/such/adapter: not a PEFT adapter folder (no adapter_config.json)"),
    (["--max-lora-rank", "x"], "kestrel serve: error: argument --max-lora-rank: invalid int value: 'x'"),
    (["--chat-template", "nofile"], "--chat-template 'nofile' is neither a file nor a Jinja template"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
])
def test_cli_mistake_is_one_line(flags, words, server_model):
    one_line_refusal(serve(str(server_model), *flags), words)


def test_engine_start_up_refusal_is_one_line(server_model):
    """The engine core refuses a tensor-parallel size that does not divide the heads (4): before, uvicorn's
    lifespan printed a 50-line traceback and exited 3."""
    one_line_refusal(serve(str(server_model), "--tensor-parallel-size", "3"),
                     "num_attention_heads = 4 is not divisible by --tensor-parallel-size 3")


def test_adapter_failing_in_the_engine_is_one_line(server_model, tmp_path):
    """An adapter folder that passes the CLI check but that the engine refuses (a rank over --max-lora-rank)."""
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 64, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    run = serve(str(server_model), "--enable-lora", "--max-lora-rank", "8", "--lora-modules",
                f"big={tmp_path / 'big'}")
    one_line_refusal(run, "big")


def _fake_hub_cache(root, repo: str, checkpoint, commit: str = "0123456789abcdef0123456789abcdef01234567"):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/files}."""
    folder = root / ("models--" + repo.replace("/", "--"))
    shutil.copytree(checkpoint, folder / "snapshots" / commit)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    return folder / "snapshots" / commit


def test_hub_id_resolves_from_the_local_cache(server_model, tmp_path):
    from kestrel.hub_cache import resolve_model_path

    snapshot = _fake_hub_cache(tmp_path, "tiny-org/tiny-llama", server_model)
    assert os.path.samefile(resolve_model_path("tiny-org/tiny-llama", cache_dir=str(tmp_path)), snapshot)
    assert os.path.samefile(resolve_model_path("tiny-org/tiny-llama", revision=snapshot.name,
                                               cache_dir=str(tmp_path)), snapshot)
    from kestrel.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'tiny-org/other' is not in the local Hugging Face cache .* the hub is "
                                          r"not reachable from here: .* pass its folder"):
        resolve_model_path("tiny-org/other", cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="at revision v2 is not in the local Hugging Face cache"):
        resolve_model_path("tiny-org/tiny-llama", revision="v2", cache_dir=str(tmp_path))


def test_generate_with_a_cached_hub_id(server_model, tmp_path):
    """End to end through the CLI, the cache found through $HF_HUB_CACHE as huggingface_hub finds it."""
    _fake_hub_cache(tmp_path, "tiny-org/tiny-llama", server_model)
    e = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "kestrel.cli", "generate", "--model", "tiny-org/tiny-llama",
                          "--max-tokens", "2", "--num-kv-blocks", "16", "--max-model-len", "64", "--cpu-threads", "1",
                          "hello"], capture_output=True, text=True, env=e, cwd=ROOT, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    one_line_refusal(serve("tiny-org/missing", env={"HF_HUB_CACHE": str(tmp_path)}),
                     "'tiny-org/missing' is not in the local Hugging Face cache")


def test_unusable_model_folder_is_one_line(server_model, tmp_path):
    """Before: 75 and 102 lines, two and four tracebacks (the engine core's and the server's tokenizer load)."""
    (tmp_path / "empty").mkdir()
    one_line_refusal(serve(str(tmp_path / "empty")), "has no config.json")
    shutil.copytree(server_model, tmp_path / "foo")
    config = json.loads((tmp_path / "foo" / "config.json").read_text())
    (tmp_path / "foo" / "config.json").write_text(json.dumps({**config, "architectures": ["FooForCausalLM"],
                                                              "model_type": "foo"}))
    one_line_refusal(serve(str(tmp_path / "foo")), "model architecture 'FooForCausalLM'")
    (tmp_path / "foo" / "config.json").write_text("{nope")
    one_line_refusal(serve(str(tmp_path / "foo")), "config.json is not JSON")


def test_port_in_use_is_one_line_before_the_model_loads(server_model):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        run = serve(str(server_model), "--port", port)
    one_line_refusal(run, f"cannot listen on 127.0.0.1:{port}: Address already in use")
    assert "engine core" not in run.stderr  # refused before any engine started


def test_llm_takes_a_cached_hub_id(server_model, tmp_path):
    from kestrel import LLM
    from kestrel.core.sampling_params import SamplingParams
    from kestrel.errors import ConfigError

    snapshot = _fake_hub_cache(tmp_path, "tiny-org/tiny-llama", server_model)
    llm = LLM("tiny-org/tiny-llama", progress=False, download_dir=str(tmp_path), num_kv_blocks=16, max_model_len=64,
              cpu_threads=1)
    assert os.path.samefile(llm.config.model.model, snapshot)
    assert len(llm.generate("hi", SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids) == 2
    with pytest.raises(ConfigError, match="'tiny-org/nope' is not in the local Hugging Face cache"):
        LLM("tiny-org/nope", download_dir=str(tmp_path))


def test_bad_tls_files_are_one_line_before_the_model_loads(server_model, tmp_path):
    (tmp_path / "key.pem").write_text("not a key")
    (tmp_path / "cert.pem").write_text("not a certificate")
    for flags, words in ((["--ssl-keyfile", str(tmp_path / "missing.pem"), "--ssl-certfile", str(tmp_path / "cert.pem")],
                          f"--ssl-keyfile {tmp_path / 'missing.pem'}: no such file"),
                         (["--ssl-keyfile", str(tmp_path / "key.pem")], "--ssl-keyfile needs --ssl-certfile"),
                         (["--ssl-keyfile", str(tmp_path / "key.pem"), "--ssl-certfile", str(tmp_path / "cert.pem")],
                          f"--ssl-certfile {tmp_path / 'cert.pem'} / --ssl-keyfile")):
        run = serve(str(server_model), *flags)
        one_line_refusal(run, words)
        assert "engine core" not in run.stderr


@pytest.mark.parametrize("flags,words", [
    (["--api-key", ""], "--api-key is empty"),
    (["--data-parallel-size", "1000"], "--data-parallel-size must be from 1 to"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be from 1 to 65536, got 0"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be from 1 to 16777216, got 0"),
    (["--engine-hang-timeout", "-1"], "--engine-hang-timeout must be a positive number of seconds, got -1.0"),
    (["--request-timeout", "nan"], "--request-timeout must be a positive number of seconds, got nan"),
    (["--grammar-parse-timeout", "0"], "--grammar-parse-timeout must be a positive number of seconds"),
    (["--max-model-len", "-2"], "--max-model-len must be from 1 to 16777216, got -2"),  # -1: the model's own (vLLM)
    (["--block-size", "0"], "--block-size must be from 1 to 1024, got 0"),
    (["--port", "70000"], "--port must be from 0 to 65535, got 70000"),
    (["--tokenizer", "/etc"], "--tokenizer /etc holds no tokenizer"),
])
def test_launch_values_are_checked_at_parse_time(flags, words, server_model):
    """Issue 55: these started without auth, forked hundreds of engines, started and hung, started with a
    time-out that never fires, or refused with a traceback. Now one line each, before anything starts."""
    one_line_refusal(serve(str(server_model), *flags, timeout=30), words)


def test_a_device_is_not_a_model():
    one_line_refusal(serve("/dev/zero", timeout=30), "--model /dev/zero is neither a checkpoint folder nor a file")
