"""Issue 55 acceptance 2: every numeric flag of `kestrel serve` (walked from its argparse parser: Kestrel's own and
the vLLM compatibility flags) at 0, -1, NaN and a huge value either starts or stops with one line naming the flag,
never a traceback. Values are checked where the config is built (kestrel/cli.py check_ranges, before anything
starts), so each value goes through main() with the server start replaced (as in test_vllm_flags.py); the values
of Kestrel's own flags that are accepted are listed below with why they are safe, so a new flag (or a loosened
range) must say so. A few real launches: a KV cache larger than the machine (refused by the engine in one line,
before: the allocator's traceback), and one server started with accepted extremes that serves."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT, Server, http
from test_vllm_flags import no_server_start  # noqa: F401  (main() runs up to the server start)

HUGE_INT, HUGE_FLOAT = "99999999999999999999", "1e30"
VALUES = ("0", "-1", "nan", "huge")

# Kestrel's own numeric flags: the hostile values that start a working server, and why
ACCEPTED = {
    "--port": {"0"},  # the OS picks a free port
    "--max-model-len": {"-1"},  # vLLM's "the model's own length"
    "--seed": {"0", "-1"},  # any 64-bit seed
    "--max-logprobs": {"0", "huge"},  # a cap (0: no logprobs); requests are still checked against the vocabulary
    "--default-max-tokens": {"huge"},  # a default, capped by the context left
    "--max-request-body-bytes": {"huge"},  # a cap on the body
    "--responses-store-size": {"0", "huge"},  # 0: keep none, as vLLM; a count bounded by --responses-store-bytes
    "--responses-store-bytes": {"huge"},  # a cap
    "--engine-restart-limit": {"0", "huge"},  # 0: never restart; a count within the window
    "--max-seqs-per-request": {"0", "huge"},  # 0: half of --max-num-seqs; a cap
    "--contended-seqs-per-request": {"0", "-1", "huge"},  # 0: the contended window, -1: no cap; a cap
    "--num-kv-blocks": {"huge"},  # the engine refuses a cache larger than the device (test below)
    "--num-state-snapshots": {"0"},  # 0: no prefix caching for recurrent-state models
    "--structured-output-threads": {"0"},  # 0: the usable CPUs less two
    "--cpu-threads": {"0"},  # 0: the default share of the cores
    "--cuda-graph-prefill-max-tokens": {"0", "huge"},  # 0: prefill eager; capped by the step's token budget
    "--max-cpu-loras": {"huge"},  # a cap of an LRU cache
    "--limit-mm-per-prompt": {"0", "huge"},  # 0: images refused; a cap
    "--max-image-bytes": {"huge"},  # a cap
    "--max-image-pixels": {"huge"},  # a cap
    "--image-render-processes": {"0"},  # 0: the render threads process images
    "--kv-offloading-preempt-min-tokens": {"0", "huge"},  # 0: every preemption offloads; huge: none does
}


def numeric_flags() -> list:
    """The serve parser's actions that take one number (their type turns "0" into an int or a float)."""
    from kestrel.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions).choices["serve"]
    found = []
    for action in serve._actions:
        if not action.option_strings or action.type is None or action.nargs == 0:
            continue
        try:
            zero = action.type("0")
        except Exception:
            continue
        if isinstance(zero, (int, float)) and not isinstance(zero, bool):
            found.append(action)
    return found


FLAGS = numeric_flags()


def test_the_walk_finds_every_kind_of_numeric_flag():
    names = {a.option_strings[0] for a in FLAGS}
    assert len(FLAGS) >= 80, len(FLAGS)
    assert {"--max-num-seqs", "--max-model-len", "--gpu-memory-utilization", "--engine-hang-timeout", "--port",
            "--limit-mm-per-prompt", "--cuda-graph-sizes", "--swap-space", "--pipeline-parallel-size"} <= names
    assert set(ACCEPTED) <= names, set(ACCEPTED) - names


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    from kestrel.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("action", FLAGS, ids=[a.option_strings[0] for a in FLAGS])
def test_numeric_flag_at_hostile_values(action, server_model, no_server_start, capsys):
    flag, own = action.option_strings[0], not action.dest.startswith(("vllm_", "spec_"))
    huge = HUGE_FLOAT if isinstance(action.type("0"), float) else HUGE_INT
    accepted = set()
    for name in VALUES:
        value = huge if name == "huge" else name
        no_server_start.clear()
        code, err = run_main(["serve", str(server_model), flag, value], capsys)
        assert "Traceback" not in err, (flag, value, err)
        if code == 0:
            assert "args" in no_server_start, (flag, value)
            accepted.add(name)
            continue
        assert code == 2 and "args" not in no_server_start, (flag, value, code, err)
        assert err.splitlines() == [err], (flag, value, err)
        assert any(s in err for s in action.option_strings), (flag, value, err)
    if own:
        assert accepted == ACCEPTED.get(flag, set()), (flag, accepted)
    if "nan" in accepted:  # only a vLLM flag that changes nothing here takes any value
        from kestrel.vllm_flags import COMPAT_FLAGS

        assert any(f.dest == action.dest and f.why.startswith("no effect") for f in COMPAT_FLAGS), flag


def test_tensor_parallel_over_a_ray_cluster_is_not_bounded_by_this_machine(server_model, no_server_start, capsys):
    code, err = run_main(["serve", str(server_model), "-tp", "4096", "--distributed-executor-backend", "ray"], capsys)
    assert code == 0 and no_server_start["config"].parallel.tensor_parallel_size == 4096, err
    code, err = run_main(["serve", str(server_model), "-tp", "4096"], capsys)
    assert code == 2 and "--tensor-parallel-size must be from 1 to" in err, err


def test_float_bounds_are_finite_and_usable():
    """The upper bounds of the seconds flags fit threading's and asyncio's waits (threading.TIMEOUT_MAX)."""
    import threading

    from kestrel.cli import _float_ranges

    for field, (low, high, _) in _float_ranges().items():
        assert math.isfinite(high) and low < high, field
        if field.endswith(("timeout", "window", "interval")):
            assert high < threading.TIMEOUT_MAX, field


def test_kv_cache_larger_than_the_machine_is_one_line(server_model):
    """Accepted at parse time (the bytes of a block are the model's), refused by the engine before allocating.
    Before: the CPU allocator's RuntimeError with the engine core's traceback."""
    run = subprocess.run([sys.executable, "-m", "kestrel.cli", "serve", str(server_model), "--cpu-threads", "1",
                          "--max-model-len", "128", "--num-kv-blocks", HUGE_INT[:13]], capture_output=True,
                         text=True, cwd=ROOT, timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
    err = run.stderr.strip()
    assert run.returncode == 2 and "Traceback" not in err + run.stdout, err[-3000:]
    last = err.splitlines()[-1]
    assert last.startswith("kestrel: error:") and "--num-kv-blocks 9999999999999" in last, err[-3000:]
    assert "more than the" in last and "GiB of cpu memory available" in last, last


def test_a_server_with_accepted_extremes_serves(server_model, tmp_path):
    """The largest seconds values, zero and no-cap values of the accepted list: the server starts and serves."""
    s = Server(server_model, tmp_path / "server.log", [
        "--seed", "-1", "--engine-hang-timeout", "10000000", "--engine-restart-window", "10000000",
        "--engine-startup-timeout", "10000000", "--grammar-parse-timeout", "10000000", "--log-stats-interval",
        "10000000", "--request-timeout", "10000000", "--max-request-body-bytes", HUGE_INT, "--default-max-tokens",
        HUGE_INT, "--max-seqs-per-request", HUGE_INT, "--contended-seqs-per-request", "-1",
        "--responses-store-size", "0", "--engine-restart-limit", "0", "--max-logprobs", "0",
        "--limit-mm-per-prompt", "0", "--cuda-graph-prefill-max-tokens", "0", "--max-num-seqs", "65536"])
    try:
        s.wait_ready()
        status, r = http("POST", s.url + "/v1/completions", {"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert status == 200 and r["usage"]["completion_tokens"] == 3, r
        status, r = http("POST", s.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                  "max_tokens": 2})
        assert status == 200, r
        status, r = http("POST", s.url + "/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": 1})
        assert status == 400 and r["error"]["param"] == "logprobs", r
        assert s.health()[0] == 200
    finally:
        s.stop()
    assert "Traceback" not in (tmp_path / "server.log").read_text()
