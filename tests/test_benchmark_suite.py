"""The GPU stage table (benchmarks/stages.py) and its runner (benchmarks/suite.py), the A/B stage's runner
(benchmarks/ab.py) and the GPU test summary (benchmarks/gpu_tests.py), on the CPU: the table parses and keeps
every stage of the shell script it replaced, --help lists them, unknown stages are refused before anything runs,
and the runner skips, caps and stops commands as its budget and GPU count say."""
from __future__ import annotations

import json
import os
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.stages import AREAS, BY_NAME, STAGES, Cmd, Server, Stage, tail
from benchmarks.suite import Suite

ROOT = Path(__file__).resolve().parents[1]
# the 69 stages of benchmarks/gpu_suite.sh (commit 4697735), which this table replaced
SHELL_STAGES = """tests attnt b1k attn tput tput0nopdl tputsweep ab tput0 sweep lat latnopdl lat8b tput8b fp8 structured
structthreads structfill structgpu tputfp8 trace tracelat profile startup imports startprof profile1 profile8b moe
moetune moetunemla moealign kern mlatune16 tputmoe latmoe tp lora tputlora mla mlatune tputmla latmla tputmlad latmlad
vllmmla vllmmlad engine moemodels tp1 profmla prof1moe prof1mla mlasplit vsite mmrender mmv mmvllm mmprof mmkw mmspy
mmk mlak mlapre multigpu1 multigpu2 multigpu3 vllmtp vllmmoe""".split()
PLACEHOLDERS = {"py", "out", "run", "llava", "qwenvl", "vsite", "base", "left", "url", "port", "pythonpath"}


def suite_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.suite", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_table_keeps_every_shell_stage_once():
    assert len(SHELL_STAGES) == 69
    assert len(BY_NAME) == len(STAGES), "stage names repeat"
    assert set(SHELL_STAGES) <= set(BY_NAME), set(SHELL_STAGES) - set(BY_NAME)
    wave = {"flood", "specd", "specng", "specpeer", "speceagle", "specall", "dsak", "dsae2e", "kdatests", "kdak", "tputkimi",
            "latkimi", "vllmkimi", "gdntests", "tputqwen36", "latqwen36", "profdsa", "dsaab", "cpuab", "multiturn", "awq8b", "vllmawq", "vllmqwen36", "tputoss", "latoss", "vllmoss", "tputgemma4",
            "latgemma4", "vllmgemma4", "mmqvl", "kvcopy", "kvsweep"}
    assert set(BY_NAME) - set(SHELL_STAGES) == {"gputests", "tputkv8", "servesbs"} | wave


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_every_stage_has_a_help_line_timeouts_and_known_placeholders(stage):
    assert stage.help and "\n" not in stage.help and len(stage.help) <= 100, stage.help
    assert stage.area in AREAS and stage.cmds and stage.timeout > 0
    for cmd in stage.cmds:
        assert cmd.timeout > 0 and cmd.gpus >= 0
        words = [*cmd.argv, *cmd.env.values(), *stage.env.values(), *(cmd.server.argv if cmd.server else ())]
        names = {f for w in words for _, f, _, _ in string.Formatter().parse(w) if f}
        assert names <= PLACEHOLDERS, names - PLACEHOLDERS
        assert not any(w.startswith("/tmp") for w in words), "scratch paths come from the suite's options"
        if cmd.argv[:2] == ("{py}", "-m") and cmd.argv[2].startswith("benchmarks."):
            assert (ROOT / (cmd.argv[2].replace(".", "/") + ".py")).exists(), cmd.argv[2]


@pytest.mark.parametrize("flag", ["--help", "--list"])
def test_help_and_list_name_every_stage_with_its_help_line(flag):
    run = suite_cli(flag)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    for stage in STAGES:
        assert any(line.split()[:1] == [stage.name] and stage.help in line for line in lines), stage.name
    assert all(f"{area}: " in run.stdout for area in AREAS)


def test_unknown_stage_is_refused_in_one_line_before_anything_runs(tmp_path):
    run = suite_cli("tput", "nosuch", "--out", str(tmp_path / "out"))
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines() == [run.stderr.strip()] and "'nosuch'" in run.stderr
    assert not (tmp_path / "out").exists()


def test_ab_without_base_is_refused_in_one_line(tmp_path):
    run = suite_cli("ab", "--out", str(tmp_path / "out"))
    assert run.returncode == 2 and run.stderr.strip() == "suite: stage 'ab' needs --base"


def run_stages(tmp_path, stages, capsys, **kw) -> tuple[int, str]:
    suite = Suite(tmp_path / "out", tmp_path / "scratch", kw.pop("budget", 60), kw.pop("gpus", 0), **kw)
    rc = suite.run(stages)
    return rc, capsys.readouterr().out


def py(code: str, timeout: int = 30, gpus: int = 0, **kw) -> Cmd:
    return Cmd(("{py}", "-c", code), timeout, gpus=gpus, **kw)


def test_stages_needing_more_gpus_are_skipped_with_a_line(tmp_path, capsys):
    two = Stage("two", "core", "h", (py("print('ran two')", gpus=2),))
    mixed = Stage("mixed", "core", "h", (py("print('ran cpu part')", gpus=0), py("print('ran gpu part')", gpus=1)))
    rc, out = run_stages(tmp_path, [two, mixed], capsys, gpus=0)
    lines = out.splitlines()
    assert rc == 0 and "ran two" not in lines and "--- skipped two: needs 2 GPUs, found 0" in lines
    assert "ran cpu part" in lines and "ran gpu part" not in lines
    assert any(line.startswith("--- skipped: needs 1 GPU, found 0: ") for line in lines)


def test_a_command_is_stopped_at_what_is_left_of_the_budget(tmp_path, capsys):
    slow = py("import time; print('started', flush=True); time.sleep(60)", timeout=100, show=tail(3))
    after = py("print('second ran')")
    t0 = time.monotonic()
    rc, out = run_stages(tmp_path, [Stage("slow", "core", "h", (slow, after))], capsys, budget=3, min_left=1)
    assert time.monotonic() - t0 < 30  # capped near 3 s, not the command's 100 s
    assert rc == 1 and "started" in out and "--- timed out after" in out
    assert "second ran" not in out.splitlines() and "--- skipped (" in out  # under min_left of the budget left


def test_output_filter_log_and_exit_status(tmp_path, capsys):
    cmd = py("import sys; [print(i) for i in range(5)]; sys.exit(3)", show=tail(2), log="five.log")
    rc, out = run_stages(tmp_path, [Stage("five", "core", "h", (cmd,))], capsys)
    assert rc == 1 and "\n3\n4\n--- exit 3: " in out and "\n2\n" not in out
    assert (tmp_path / "out" / "five.log").read_text().split() == ["0", "1", "2", "3", "4"]
    assert (tmp_path / "out" / "device.txt").exists()


HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_command_runs_while_its_server_is_up_and_the_server_is_stopped_after(tmp_path, capsys):
    server = Server(("{py}", "-c", HEALTH_SERVER, "{port}"), log="server.log", ready_timeout=30)
    client = py("import urllib.request; print('health', urllib.request.urlopen('{url}/health').status, '{port}')",
                server=server, title="fake peer")
    rc, out = run_stages(tmp_path, [Stage("served", "core", "h", (client,))], capsys)
    assert rc == 0 and "--- fake peer" in out and "--- server ready after" in out, out
    port = int(next(line for line in out.splitlines() if line.startswith("health 200")).split()[-1])
    with pytest.raises(OSError, match="refused"):  # stopped: nothing listens on its port any more
        import socket
        socket.create_connection(("127.0.0.1", port), timeout=2)


def test_a_server_that_exits_skips_its_command(tmp_path, capsys):
    server = Server(("{py}", "-c", "import sys; print('Error: no such model'); sys.exit(1)"), log="server.log",
                    ready_timeout=30)
    rc, out = run_stages(tmp_path, [Stage("dead", "core", "h", (py("print('client ran')", server=server),))], capsys)
    assert rc == 1 and "client ran" not in out.splitlines()
    assert "--- server exited (1)" in out and "Error: no such model" in out


# ---- benchmarks/ab.py on two fake trees: an old one whose benchmarks/ is not a package, and a package one
FAKE_BENCH = """
import argparse, json, os, pathlib
ap = argparse.ArgumentParser()
ap.add_argument("--shape"); ap.add_argument("--json")
args, _ = ap.parse_known_args()
tree = pathlib.Path(__file__).resolve().parents[1].name
try:  # a fake tree's own kestrel/ says which tree it is
    import kestrel
    tree += f"+kestrel:{kestrel.TREE}" if "TREE" in vars(kestrel) else ""
except ImportError:
    pass
with open(os.environ["AB_ORDER"], "a") as f:
    f.write(f"{tree} {pathlib.Path(__file__).stem} {args.shape} {os.environ['KESTREL_COMMIT']}\\n")
json.dump(RESULT, open(args.json, "w"))
"""


def fake_tree(root: Path, package: bool, tput: float, ms: float, ttft: float) -> Path:
    (root / "benchmarks").mkdir(parents=True)
    if package:
        (root / "benchmarks" / "__init__.py").write_text("")
    for name, result in (("throughput", {"kestrel_out_tok_s": tput}), ("latency", {"ms_per_token": ms,
                                                                                   "ttft_ms": ttft})):
        (root / "benchmarks" / f"{name}.py").write_text(f"RESULT = {result!r}\n" + FAKE_BENCH)
    return root


def test_ab_runs_both_trees_alternating_and_tabulates_new_over_base(tmp_path):
    base = fake_tree(tmp_path / "old", package=False, tput=100.0, ms=2.0, ttft=10.0)
    (base / ".commit").write_text("abc1234\n")
    new = fake_tree(tmp_path / "cur", package=True, tput=95.0, ms=2.0, ttft=9.0)
    order = tmp_path / "order.txt"
    run = subprocess.run([sys.executable, "-m", "benchmarks.ab", "--base", str(base), "--new", str(new), "--shapes",
                          "qwen3-0.6b,deepseek-v2-lite", "--json", str(tmp_path / "ab.json")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "AB_ORDER": str(order), "KESTREL_COMMIT": "def5678"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert order.read_text().splitlines() == [
        "old throughput qwen3-0.6b abc1234", "cur throughput qwen3-0.6b new",
        "cur latency qwen3-0.6b new", "old latency qwen3-0.6b abc1234",
        "old throughput deepseek-v2-lite abc1234", "cur throughput deepseek-v2-lite new",
        "cur latency deepseek-v2-lite new", "old latency deepseek-v2-lite abc1234"]
    assert "| qwen3-0.6b | out tok/s | 100.0 | 95.0 | 0.950 |" in run.stdout
    assert "| deepseek-v2-lite | TTFT ms | 10.0 | 9.0 | 0.900 |" in run.stdout
    assert ("worse than base by more than 2%: qwen3-0.6b out tok/s 0.950, deepseek-v2-lite out tok/s 0.950"
            in run.stdout)
    res = json.loads((tmp_path / "ab.json").read_text())
    assert (res["base"], res["new"], len(res["rows"])) == ("abc1234", "new", 6)


def test_ab_abba_runs_base_new_new_base_and_compares_means(tmp_path):
    base = fake_tree(tmp_path / "old", package=True, tput=100.0, ms=2.0, ttft=10.0)
    new = fake_tree(tmp_path / "cur", package=True, tput=90.0, ms=2.0, ttft=9.0)
    order = tmp_path / "order.txt"
    run = subprocess.run([sys.executable, "-m", "benchmarks.ab", "--base", str(base), "--new", str(new), "--shapes",
                          "deepseek-v2-lite", "--benches", "throughput", "--abba"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "AB_ORDER": str(order)})
    assert run.returncode == 0, run.stdout + run.stderr
    assert [ln.split()[0] for ln in order.read_text().splitlines()] == ["old", "cur", "cur", "old"]
    assert "| deepseek-v2-lite | out tok/s | 100.0 | 90.0 | 0.900 |" in run.stdout
    assert "means of base new new base" in run.stdout and "latency" not in order.read_text()
    bad = subprocess.run([sys.executable, "-m", "benchmarks.ab", "--base", str(base), "--benches", "speed"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--benches: unknown speed" in bad.stderr


def test_ab_scripts_new_runs_the_base_engine_under_the_new_benchmarks(tmp_path):
    base = fake_tree(tmp_path / "old", package=True, tput=100.0, ms=2.0, ttft=10.0)
    new = fake_tree(tmp_path / "cur", package=True, tput=100.0, ms=2.0, ttft=9.0)
    for tree in (base, new):
        (tree / "kestrel").mkdir()
        (tree / "kestrel" / "__init__.py").write_text(f"TREE = {tree.name!r}\n")
    order = tmp_path / "order.txt"
    run = subprocess.run([sys.executable, "-m", "benchmarks.ab", "--base", str(base), "--new", str(new), "--shapes",
                          "qwen3-0.6b", "--benches", "latency", "--scripts", "new"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "AB_ORDER": str(order), "PYTHONPATH": ""})
    assert run.returncode == 0, run.stdout + run.stderr
    # base first: the new tree's script (its folder) with the base's kestrel; then the new tree's own
    assert [ln.split()[0] for ln in order.read_text().splitlines()] == ["cur+kestrel:old", "cur+kestrel:cur"]
    assert "both under this tree's benchmarks/" in run.stdout


# ---- benchmarks/gpu_tests.py
def test_gpu_test_files_are_tests_gpu_and_every_file_that_uses_cuda():
    from benchmarks.gpu_tests import gpu_test_files

    files = gpu_test_files()
    assert {str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "gpu").glob("test_*.py")} <= set(files)
    assert {"tests/attention/test_triton_mla.py", "tests/kernels/test_fp8_numerics.py",
            "tests/kernels/test_moe_triton_interp.py", "tests/structured_output/test_bitmask_triton.py"} <= set(files)
    assert "tests/test_config.py" not in files and "tests/server/test_cli.py" not in files


def test_gpu_tests_summary_counts_each_file_and_names_the_failures(tmp_path):
    mixed = tmp_path / "test_mixed.py"
    mixed.write_text("import pytest\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2\n\n"
                     "@pytest.mark.skip(reason='no')\ndef test_skipped():\n    pass\n\n"
                     "@pytest.mark.parametrize('x', [1, 2])\ndef test_param(x):\n    assert x\n")
    broken = tmp_path / "test_broken.py"
    broken.write_text("import no_such_module_here\n\ndef test_never():\n    pass\n")
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_tests", str(mixed), str(broken), "--log",
                          str(tmp_path / "log.txt")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout
    assert f"| {mixed} | 3 | 1 | 0 | 1 |" in run.stdout
    assert f"| {broken} | 0 | 0 | 1 | 0 |" in run.stdout
    failed = [line for line in run.stdout.splitlines() if line.startswith("failed: ")]
    assert len(failed) == 2 and failed[0].endswith("test_mixed.py::test_bad") and "test_broken.py" in failed[1]
    assert "GPU tests: 3 passed, 1 failed, 1 errors, 1 skipped" in run.stdout
    assert (tmp_path / "log.txt").read_text().count("PASSED") == 3


def test_gpu_tests_summary_reads_xdist_lines():
    from benchmarks.gpu_tests import summarize

    lines = ["[gw0] [ 25%] PASSED tests/gpu/test_a.py::test_one",
             "[gw1] [ 50%] FAILED tests/gpu/test_b.py::test_two[bf16]",
             "[gw0] [100%] SKIPPED tests/gpu/test_a.py::test_three"]
    counts, failed = summarize(lines, ["tests/gpu/test_a.py", "tests/gpu/test_b.py"])
    assert counts["tests/gpu/test_a.py"] == {"PASSED": 1, "SKIPPED": 1}
    assert counts["tests/gpu/test_b.py"] == {"FAILED": 1}
    assert failed == ["tests/gpu/test_b.py::test_two[bf16]"]
