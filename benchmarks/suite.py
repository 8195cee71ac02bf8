"""Everything the GPU checks need, in one device call, from the repository root:

    python3 -m benchmarks.suite STAGE...      (no STAGE: tests tput lat lat8b tput8b; --list: the stages)

The stages are in benchmarks/stages.py. On the lent GPU machine the packages its image lacks travel as wheels
(`bash scripts/device_wheels.sh` fills .whl/; every call carries [".whl"]) and each call starts with

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
      .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD KESTREL_COMMIT=<sha> &&

(KESTREL_COMMIT: the device's copy of .git is not this checkout's HEAD, and the benchmarks report it). vLLM 0.26,
the peer, goes into the same site (shared/peers/vllm/stage.sh); the `vsite` stage adds what vLLM's LLaVA path needs
(carry [".whl2"]). Results go to --out; model folders and the staged vsite to --scratch, which a warm machine
keeps between calls. Each command runs under its timeout capped by what is left of --budget (one call's 600 s,
less a margin), and one with under 30 s left is skipped; a stage or command that needs more GPUs than the
machine has is skipped with a line saying so."""
from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.procs import run_capped, start, stop
from benchmarks.stages import AREAS, BY_NAME, DEFAULT, STAGES, Cmd, Server, Stage

ROOT = Path(__file__).resolve().parent.parent
MIN_LEFT_S = 30  # a command with less of the budget left is skipped
HEALTH_POLL_S = 2


def listing() -> str:
    """Every stage with its help line, by area; GPUs needed (when not 1) and its most seconds."""
    width = max(len(s.name) for s in STAGES)
    out = []
    for area, about in AREAS.items():
        out.append(f"{area}: {about}")
        for s in (s for s in STAGES if s.area == area):
            gpus = ("" if s.gpus == 1 else " [no GPU]" if not s.gpus else f" [{plural(s.gpus, 'GPU')}]"
                    if s.min_gpus == s.gpus else f" [{s.min_gpus}-{s.gpus} GPUs]")
            out.append(f"  {s.name:<{width}}  {s.help}{gpus} (<= {s.timeout} s)")
    return "\n".join(out)


def count_gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def say(*lines: str) -> None:
    for line in lines:
        print(line, flush=True)


class Suite:
    def __init__(self, out: Path, scratch: Path, budget: float, gpus: int, base: Path | None = None,
                 vsite: Path | None = None, min_left: float = MIN_LEFT_S):
        self.t0 = time.monotonic()
        self.out, self.scratch, self.budget, self.gpus, self.min_left = out, scratch, budget, gpus, min_left
        pythonpath = os.environ.get("PYTHONPATH", "")
        if str(ROOT) not in pythonpath.split(os.pathsep):
            pythonpath = os.pathsep.join(p for p in (str(ROOT), pythonpath) if p)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "PYTHONPATH": pythonpath}
        self.values = dict(py=sys.executable, out=str(out.resolve()), run="", llava=str(scratch / "llava-next-7b"), qwenvl=str(scratch / "qwen2.5-vl-7b"),
                           vsite=str(vsite or scratch / "vsite"), pythonpath=pythonpath)
        if base is not None:
            self.values["base"] = str(base.resolve())
        self.failed = 0

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def missing_values(self, stage: Stage) -> set[str]:
        """Placeholders of the stage's commands that this suite has no value for (e.g. {base} without --base)."""
        missing = set()
        for cmd in stage.cmds:
            words = [*cmd.argv, *cmd.env.values(), *(cmd.server.argv if cmd.server else ())]
            for word in words:
                try:
                    word.format(**self.values, left=0, url="", port=0)
                except KeyError as e:
                    missing.add(e.args[0])
        return missing

    def run(self, stages: list[Stage]) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.values["run"] = tempfile.mkdtemp(prefix="run-", dir=self.scratch)  # fresh for this call
        self.describe_device()
        for stage in stages:
            self.run_stage(stage)
        say(f"=== done {time.strftime('%H:%M:%S')}")
        return 1 if self.failed else 0

    def describe_device(self) -> None:
        try:
            query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
            gpus = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            gpus = ""
        commit = os.environ.get("KESTREL_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        text = f"{gpus or 'no NVIDIA GPU'}\n{commit or 'unknown commit'}"
        (self.out / "device.txt").write_text(text + "\n")
        say(text)

    def run_stage(self, stage: Stage) -> None:
        say(f"=== {stage.name} {time.strftime('%H:%M:%S')}")
        if stage.min_gpus > self.gpus:
            say(f"--- skipped {stage.name}: needs {plural(stage.min_gpus, 'GPU')}, found {self.gpus}")
            return
        for cmd in stage.cmds:
            self.run_cmd(cmd, stage.env)

    def run_cmd(self, cmd: Cmd, stage_env: dict[str, str]) -> None:
        left = int(self.left())
        port = free_port() if cmd.server else 0
        values = {**self.values, "left": left - 5, "port": port, "url": f"http://127.0.0.1:{port}"}
        argv = [w.format(**values) for w in cmd.argv]
        if cmd.title:
            say(f"--- {cmd.title}")
        if cmd.gpus > self.gpus:
            say(f"--- skipped: needs {plural(cmd.gpus, 'GPU')}, found {self.gpus}: {shlex.join(argv)}")
            return
        if left < self.min_left:
            say(f"--- skipped ({left} s left): {shlex.join(argv)}")
            return
        env = {**self.env, **stage_env, **{k: v.format(**values) for k, v in cmd.env.items()}}
        server = self.start_server(cmd.server, values, env) if cmd.server else None
        if cmd.server and server is None:
            self.failed += 1
            return
        try:
            self.run_process(cmd, argv, env, min(cmd.timeout, int(self.left())))
        finally:
            if server is not None:
                stop(server, grace_s=30)

    def run_process(self, cmd: Cmd, argv: list[str], env: dict[str, str], timeout: int) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            output = self.out / cmd.log if cmd.log else Path(tmp) / "output"
            rc = run_capped(argv, cwd=ROOT, env=env, timeout=timeout, output=output)
            lines = output.read_text(errors="replace").splitlines()
        say(*cmd.show(lines))
        if rc is None:
            self.failed += 1
            say(f"--- timed out after {timeout} s: {shlex.join(argv)}")
        elif rc:
            self.failed += 1
            say(f"--- exit {rc}: {shlex.join(argv)}")

    def start_server(self, server: Server, values: dict, env: dict[str, str]) -> subprocess.Popen | None:
        argv = [w.format(**values) for w in server.argv]
        env = {**env, **{k: v.format(**values) for k, v in server.env.items()}}
        log_path = self.out / server.log
        proc = start(argv, cwd=ROOT, env=env, output=log_path)
        t0 = time.monotonic()
        wait_s = min(server.ready_timeout, self.left() - self.min_left)
        while time.monotonic() - t0 < wait_s:
            if proc.poll() is not None:
                errors = [s for s in log_path.read_text(errors="replace").splitlines() if "error" in s.lower()]
                say(f"--- server exited ({proc.returncode}): {shlex.join(argv)}", *errors[-5:])
                return None
            try:
                with urllib.request.urlopen(values["url"] + "/health", timeout=HEALTH_POLL_S) as r:
                    if r.status == 200:
                        say(f"--- server ready after {time.monotonic() - t0:.0f} s")
                        return proc
            except OSError:
                pass
            time.sleep(HEALTH_POLL_S)
        say(f"--- server not ready after {wait_s:.0f} s: {shlex.join(argv)}")
        stop(proc)
        return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__,
                                epilog="stages:\n" + listing(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stages", nargs="*", metavar="STAGE", help=f"stages to run, in order (default: {' '.join(DEFAULT)})")
    p.add_argument("--list", action="store_true", help="print the stages by area and exit")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_out"),
                   help="logs and JSON results (default: $OUT, else ./gpu_out)")
    p.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "kestrel-suite",
                   help="model folders, Triton caches and the vsite (default: kestrel-suite in the temp folder)")
    p.add_argument("--budget", type=float, default=580, help="seconds for the whole call (default 580)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to plan for (default: what nvidia-smi lists)")
    p.add_argument("--base", type=Path, default=None,
                   help="ab: a checkout of the previous commit (git archive SHA | tar -x -C DIR; DIR/.commit names it)")
    p.add_argument("--vsite", type=Path, default=None, help="vLLM's LLaVA site (default: SCRATCH/vsite)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        say(listing())
        return 0
    names = args.stages or list(DEFAULT)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"suite: unknown stage {', '.join(map(repr, unknown))} (python -m benchmarks.suite --list shows them)",
              file=sys.stderr)
        return 2
    suite = Suite(args.out, args.scratch, args.budget, count_gpus() if args.gpus is None else args.gpus,
                  base=args.base, vsite=args.vsite)
    stages = [BY_NAME[n] for n in names]
    for stage in stages:
        if missing := suite.missing_values(stage):
            print(f"suite: stage {stage.name!r} needs {', '.join(f'--{m}' for m in sorted(missing))}", file=sys.stderr)
            return 2
    return suite.run(stages)


if __name__ == "__main__":
    sys.exit(main())
