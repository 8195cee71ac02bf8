"""The whole GPU test suite in one pytest run, then a pass/fail summary by file. It runs tests/gpu and every other
test file that does something on CUDA when it is there (a `gpu` marker, or a device chosen by
torch.cuda.is_available(): the Triton kernel tests, which run under the interpreter on the CPU). Without a
GPU those tests skip, so the summary is only meaningful on the GPU machine.

    python -m benchmarks.gpu_tests [FILE...] [--budget 575] [--log gputests.log] [--workers 4]

When the budget runs out first, the summary names the files not reached: pass them in the next call."""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import ROOT, print_table
from benchmarks.procs import run_capped

USES_CUDA = re.compile(r"pytest\.mark\.gpu\b|torch\.cuda\.is_available\(\)")
RESULT = re.compile(r"^(?P<file>[^\s:]+\.py)::(?P<test>\S.*?) (?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
# pytest-xdist's -v line: "[gw1] [ 12%] PASSED tests/gpu/test_x.py::test_y"
XDIST_RESULT = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) "
                          r"(?P<file>[^\s:]+\.py)::(?P<test>\S+)")
COLLECT_ERROR = re.compile(r"^ERROR (?P<file>[^\s:]+\.py)(?: - .*)?$")


def gpu_test_files(root: Path = ROOT) -> list[str]:
    tests = root / "tests"
    found = sorted(tests.glob("gpu/test_*.py"))
    found += sorted(p for p in tests.rglob("test_*.py")
                    if p.relative_to(tests).parts[0] != "gpu" and USES_CUDA.search(p.read_text()))
    return [str(p.relative_to(root)) for p in found]


def summarize(lines: list[str], files: list[str]) -> tuple[dict[str, Counter], list[str]]:
    """pytest -v output -> (outcomes per given file, the node ids that failed or errored). pytest prints a file
    relative to where it ran (ROOT) or to its rootdir; either way it is matched to the given path."""
    rootdir = next((Path(m[1]) for m in map(re.compile(r"^rootdir: (\S+)").match, lines) if m), ROOT)
    by_path = {(ROOT / f).resolve(): f for f in files}
    counts = {f: Counter() for f in files}
    failed = []
    for line in lines:
        if m := RESULT.match(line) or XDIST_RESULT.match(line):
            file, outcome, node = m["file"], m["outcome"], f"{m['file']}::{m['test']}"
        elif m := COLLECT_ERROR.match(line):  # the file did not import: none of its tests ran
            file, outcome, node = m["file"], "ERROR", line
        else:
            continue
        given = by_path.get((ROOT / file).resolve()) or by_path.get((rootdir / file).resolve(), file)
        counts.setdefault(given, Counter())[outcome] += 1
        if outcome in ("FAILED", "ERROR"):
            failed.append(node)
    return counts, failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="test files (default: every GPU test file)")
    ap.add_argument("--budget", type=float, default=575, help="seconds for the pytest run")
    ap.add_argument("--log", type=Path, default=None, help="the whole pytest output")
    ap.add_argument("--workers", type=int, default=0,
                    help="pytest-xdist processes sharing the GPU, one file each at a time (tests size their KV cache "
                         "by blocks, so several fit); 0 runs in one process")
    args = ap.parse_args(argv)
    files = args.files or gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--continue-on-collection-errors", *files]
    if args.workers:
        cmd += ["-n", str(args.workers), "--dist", "loadfile"]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        log = args.log or Path(tmp) / "gputests.log"
        failures = log.with_suffix(".failures")  # tracebacks as they happen (tests/conftest.py), kept at a budget stop
        env = dict(os.environ, KESTREL_FAILURE_LOG=str(failures))
        rc = run_capped(cmd, cwd=ROOT, env=env, timeout=args.budget, output=log)
        lines = log.read_text(errors="replace").splitlines()
    counts, failed = summarize(lines, files)
    rows = [dict(file=f, passed=c["PASSED"], failed=c["FAILED"], errors=c["ERROR"],
                 skipped=c["SKIPPED"] + c["XFAIL"]) for f, c in counts.items() if c]
    print_table(f"GPU tests ({len(files)} files)", rows)
    total = sum(counts.values(), Counter())
    for node in failed[:40]:
        print("failed:", node)
    not_reached = [f for f, c in counts.items() if not c]
    print(f"\nGPU tests: {total['PASSED']} passed, {total['FAILED']} failed, {total['ERROR']} errors, "
          f"{total['SKIPPED'] + total['XFAIL']} skipped in {time.monotonic() - t0:.0f} s"
          + (f"; stopped at the budget ({args.budget:.0f} s)" if rc is None else ""))
    if not_reached:
        print("not reached:", " ".join(not_reached))
    return 0 if rc == 0 and total["PASSED"] and not total["FAILED"] + total["ERROR"] else 1


if __name__ == "__main__":
    sys.exit(main())
