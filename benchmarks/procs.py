"""Running a benchmark or test command under a timeout: in its own process group, so that a timeout also ends the
processes it started (engine cores, servers), with its output in a file that survives the kill."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def stop(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGTERM to the process group, SIGKILL after grace_s."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            pass


def start(argv: list[str], *, cwd: Path, env: dict[str, str], output: Path) -> subprocess.Popen:
    """argv in a new process group, stdout and stderr to `output`."""
    with open(output, "w") as f:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def run_capped(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float, output: Path) -> int | None:
    """Runs argv to the end or to `timeout` seconds; its exit status, or None when it was stopped."""
    proc = start(argv, cwd=cwd, env=env, output=output)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        return None
