"""The command line as a new user meets it (issue 17): `kestrel bench` works outside the source tree and shows its
own flags, --help prints each default once, bad flags and Ctrl-C end with one line and no traceback; and
LLM.generate takes vLLM's prompt dicts."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, free_port, http
from kestrel.core.sampling_params import SamplingParams


def test_help_prints_each_default_once():
    import argparse

    from kestrel.cli import build_parser

    def walk(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from walk(sub)

    for parser in walk(build_parser()):
        for action in parser._actions:
            assert (action.help or "").count("default") <= 1, (parser.prog, action.option_strings, action.help)


@pytest.mark.parametrize("which,flags", [("throughput", ["--num-prompts", "--input-len", "--model"]),
                                          ("latency", ["--batch-size", "--num-iters", "--model"])])
def test_bench_help_shows_its_own_flags(which, flags, capsys):
    from kestrel.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", which, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and all(f in out for f in flags), out


def test_bench_throughput_and_latency_run_outside_the_source_tree(server_model, tmp_path, monkeypatch, capsys):
    """Before: `ModuleNotFoundError: common` (the scripts were run from benchmarks/)."""
    from kestrel.cli import main

    monkeypatch.chdir(tmp_path)
    small = ["--model", str(server_model), "--input-len", "8", "--output-len", "4", "--num-kv-blocks", "32",
             "--max-model-len", "64"]
    assert main(["bench", "throughput", *small, "--num-prompts", "4", "--output-json", "t.json"]) == 0
    assert "output_tokens_per_s" in capsys.readouterr().out and (tmp_path / "t.json").exists()
    assert main(["bench", "latency", *small, "--num-iters", "2"]) == 0
    assert "ms_per_output_token" in capsys.readouterr().out


@pytest.mark.parametrize("args,words", [
    (["--linear-backend", "nope"], "--linear-backend 'nope' is not one of auto, "),
    (["--attention-backend", "flash9"], "--attention-backend 'flash9' is not one of auto"),
    (["--moe-backend", "x"], "--moe-backend 'x' is not one of auto"),
    (["--renderer-num-workers", "0"], "--renderer-num-workers must be from 1 to 1024, got 0"),
    (["--image-render-processes", "-1"], "--image-render-processes must be from 0 to"),
])
def test_bad_backend_is_one_clear_line(server_model, args, words, capsys):
    from kestrel.cli import main

    for cmd in (["generate", "--model", str(server_model)], ["serve", str(server_model)]):
        assert main([*cmd, *args]) == 2  # an exception escaping main() would be the traceback
        err = capsys.readouterr().err.strip()
        assert err.splitlines() == [err] and err.startswith("kestrel: error: ") and words in err, err


def test_missing_model_path_is_one_clear_line(tmp_path, capsys):
    from kestrel.cli import main

    for cmd in (["generate", "--model", str(tmp_path / "nothing")], ["serve", str(tmp_path / "nothing")]):
        assert main(cmd) == 2
        assert capsys.readouterr().err.strip() == (f"kestrel: error: model path '{tmp_path / 'nothing'}' does not "
                                                   f"exist (give a checkpoint folder or a .gguf file)")


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_ctrl_c_stops_the_server_without_tracebacks(server_model, tmp_path, sigint):
    """Ctrl-C reaches the whole process group (server and engine core); the engine leaves the shutdown to the
    server, which ends cleanly. Also from a process that started with SIGINT ignored (a shell's background job:
    uvicorn still shuts down on Ctrl-C, and the exit status is still 130)."""
    port = free_port()
    handler = signal.SIG_DFL if sigint == "default" else signal.SIG_IGN
    log = open(tmp_path / "serve.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "kestrel.cli", "serve", str(server_model), "--port", str(port),
                          "--num-kv-blocks", "32", "--max-model-len", "128", "--cpu-threads", "1"],
                         stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, handler))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            try:
                if http("GET", f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                    break
            except OSError:
                time.sleep(0.3)
        os.killpg(p.pid, signal.SIGINT)
        assert p.wait(30) == 130  # the shell's convention for "ended by Ctrl-C"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert text.rstrip().endswith("kestrel: interrupted"), text[-3000:]


def test_llm_generate_takes_vllm_prompt_dicts(offline_llm):
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids = offline_llm.tokenizer.encode("The quick brown fox")
    plain = offline_llm.generate(["The quick brown fox", ids], p)
    dicts = offline_llm.generate([{"prompt": "The quick brown fox"}, {"prompt_token_ids": ids}], p)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    single = offline_llm.generate({"prompt_token_ids": ids}, p)
    assert single[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="exactly one of 'prompt' or 'prompt_token_ids'"):
        offline_llm.generate({"prompt": "x", "prompt_embeds": []}, p)


def test_api_key_sources(tmp_path, monkeypatch):
    """Issue 33: --api-key-file and vLLM's VLLM_API_KEY besides --api-key and KESTREL_API_KEY."""
    from kestrel.cli import resolve_api_key
    from kestrel.errors import ConfigError

    monkeypatch.delenv("KESTREL_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    (tmp_path / "key").write_text("  s3cret\n")
    assert resolve_api_key(None, str(tmp_path / "key")) == "s3cret"
    assert resolve_api_key(None, None) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert resolve_api_key(None, None) == "from-vllm"
    monkeypatch.setenv("KESTREL_API_KEY", "from-kestrel")
    assert resolve_api_key(None, None) == "from-kestrel"
    assert resolve_api_key("flag", None) == "flag"
    with pytest.raises(ConfigError, match="not both"):
        resolve_api_key("flag", str(tmp_path / "key"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        resolve_api_key(None, str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="No such file"):
        resolve_api_key(None, str(tmp_path / "missing"))
