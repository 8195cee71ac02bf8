"""Regression A/B in one GPU call: benchmarks/throughput.py and latency.py on qwen3-0.6b and deepseek-v2-lite for
the previous tree (--base) and this one. The two runs of each benchmark go back to back, in alternating order
(base first, then new first) so that drift over the call favours neither; then one table: shape, metric, base,
new, new/base.

    mkdir .old && git archive PREV | tar -x -C .old && echo PREV > .old/.commit   # on the dev machine,
    echo /.old/ >> .git/info/exclude                                            # then carry [".old"]
    python -m benchmarks.ab --base .old [--shapes qwen3-0.6b,deepseek-v2-lite] [--budget 575] [--json ab.json]
    python -m benchmarks.ab --base .old --benches throughput --abba   # base, new, new, base: order cancels out
    python -m benchmarks.suite ab --base .old                                   # the same as a suite stage
    python -m benchmarks.ab --base .old --scripts new   # both trees' engines under this tree's benchmarks/

A tree whose benchmarks/ is not a package yet (an older commit) runs them as scripts. By default each tree runs
its own benchmarks/: where the scripts changed in between (how latency.py samples TTFT, say), the ratio mixes the
change of method with the change of engine. --scripts new runs the base's kestrel/ under this tree's benchmarks/
(a folder of two links), so only the engine differs; it needs a base whose API the new scripts still call."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import ROOT, print_table
from benchmarks.procs import run_capped

# shape -> (extra flags, throughput timeout s, latency timeout s); V2-Lite as the tputmla/latmla stages run it
SHAPES = {"qwen3-0.6b": ((), 200, 150), "deepseek-v2-lite": (("--max-model-len", "4096"), 300, 200)}
BENCH_FLAGS = {"throughput": ("--hf-requests", "0"), "latency": ("--hf-output-len", "0"),  # Kestrel alone
               "cpu_overhead": ("--steps", "200")}  # host time per step with a stub model (any machine)
# benchmark -> (JSON key, table name, higher is better)
METRICS = {"throughput": (("kestrel_out_tok_s", "out tok/s", True),),
           "latency": (("ms_per_token", "batch-1 ms/token", False), ("ttft_ms", "TTFT ms", False),
                       ("ttft_median_ms", "TTFT median ms", False)),
           "cpu_overhead": (("step_ms", "host ms/step at batch 256", False),
                            ("prepare_min_ms", "runner prepare min ms", False),
                            ("schedule_min_ms", "scheduling min ms", False))}
PRIMARY = {"kestrel_out_tok_s", "ms_per_token", "ttft_ms", "step_ms"}  # rows shown even where a run is missing
MIN_LEFT_S = 30
TOLERANCE = 0.02  # the acceptance bar for "no regression"


@dataclass(frozen=True)
class Tree:
    label: str  # "base" or "new"
    root: Path
    commit: str

    def argv(self, bench: str, args: list[str]) -> list[str]:
        if (self.root / "benchmarks" / "__init__.py").exists():
            return [sys.executable, "-m", f"benchmarks.{bench}", *args]
        return [sys.executable, f"benchmarks/{bench}.py", *args]

    def env(self, other: Tree) -> dict[str, str]:
        """This tree first on PYTHONPATH, the other one off it (the site with the device's wheels stays)."""
        roots = {self.root.resolve(), other.root.resolve()}
        rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() not in roots]
        return {**os.environ, "PYTHONPATH": os.pathsep.join([str(self.root), *rest]), "KESTREL_COMMIT": self.commit}


def base_under_new_scripts(base: Path, new: Path, scratch: Path) -> Path:
    """A folder whose kestrel/ is the base's and benchmarks/ this tree's: the base tree for --scripts new."""
    mixed = scratch / "base-engine-new-scripts"
    mixed.mkdir()
    (mixed / "kestrel").symlink_to(base / "kestrel", target_is_directory=True)
    (mixed / "benchmarks").symlink_to(new / "benchmarks", target_is_directory=True)
    return mixed


def tree_commit(root: Path, fallback: str) -> str:
    if (root / ".commit").exists():
        return (root / ".commit").read_text().strip()
    if root.resolve() == ROOT and os.environ.get("KESTREL_COMMIT"):
        return os.environ["KESTREL_COMMIT"]
    git = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return git.stdout.strip() if git.returncode == 0 and (root / ".git").exists() else fallback


def run_one(tree: Tree, other: Tree, bench: str, shape: str, timeout: float, scratch: Path) -> dict | None:
    extra = SHAPES[shape][0] if bench in ("throughput", "latency") else ()
    out = scratch / f"{tree.label}-{bench}-{shape}.json"
    args = ["--shape", shape, *BENCH_FLAGS[bench], *extra, "--json", str(out)]
    t0 = time.monotonic()
    log = scratch / f"{tree.label}-{bench}-{shape}.log"
    rc = run_capped(tree.argv(bench, args), cwd=tree.root, env=tree.env(other), timeout=timeout, output=log)
    if rc is None:
        print(f"--- {tree.label} {bench} {shape}: timed out after {timeout:.0f} s", flush=True)
        return None
    if rc or not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        print(f"--- {tree.label} {bench} {shape}: exit {rc}", *tail, sep="\n", flush=True)
        return None
    print(f"--- {tree.label} {bench} {shape}: {time.monotonic() - t0:.0f} s", flush=True)
    return json.loads(out.read_text())


def mean_of(runs: list[dict], key: str) -> float | None:
    """The median of a tree's runs (the mean of two; --repeat on a busy host: the middle run, not the outlier)."""
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def comparison_rows(results: dict) -> list[dict]:
    """results[(shape, bench)][label] -> a list of runs; rows of shape, metric, base, new, new/base (each tree's
    mean over its runs; "-" where a run is missing)."""
    rows = []
    for (shape, bench), by_tree in results.items():
        for key, name, _ in METRICS[bench]:
            base, new = (mean_of(by_tree.get(t, []), key) for t in ("base", "new"))
            if base is None and new is None and key not in PRIMARY:
                continue  # a metric neither tree's benchmark reports (an older tree's)
            rows.append(dict(shape=shape, metric=name, base="-" if base is None else base,
                             new="-" if new is None else new,
                             ratio=f"{new / base:.3f}" if base and new is not None else "-"))
    return rows


def regressions(rows: list[dict]) -> list[str]:
    """Rows where the new tree is worse than the base by more than TOLERANCE."""
    higher = {name: up for metrics in METRICS.values() for _, name, up in metrics}
    worse = []
    for r in rows:
        if r["ratio"] != "-":
            ratio = float(r["ratio"])
            if (ratio < 1 - TOLERANCE) if higher[r["metric"]] else (ratio > 1 + TOLERANCE):
                worse.append(f"{r['shape']} {r['metric']} {ratio:.3f}")
    return worse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="a checkout of the previous commit")
    ap.add_argument("--new", type=Path, default=ROOT, help="the tree under test (default: this one)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--benches", default="throughput,latency", help="comma-separated, of throughput, latency, cpu_overhead")
    ap.add_argument("--abba", action="store_true",
                    help="run each pair four times, base new new base, and compare the means (order drift cancels)")
    ap.add_argument("--budget", type=float, default=575, help="seconds for all runs; later runs are skipped")
    ap.add_argument("--scripts", choices=("own", "new"), default="own",
                    help="own: each tree runs its own benchmarks/; new: the base's engine under --new's benchmarks/")
    ap.add_argument("--repeat", type=int, default=1, help="run the whole list of pairs this many times (means)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    if not (args.base / "benchmarks" / "throughput.py").exists():
        ap.error(f"--base {args.base}: no benchmarks/throughput.py there (git archive SHA | tar -x -C DIR)")
    if unknown := [s for s in shapes if s not in SHAPES]:
        ap.error(f"--shapes: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    if bad := [b for b in args.benches.split(",") if b not in METRICS]:
        ap.error(f"--benches: unknown {', '.join(bad)} (known: {', '.join(METRICS)})")
    deadline = time.monotonic() + args.budget
    base = Tree("base", args.base.resolve(), tree_commit(args.base, "base"))
    new = Tree("new", args.new.resolve(), tree_commit(args.new, "new"))
    results, missing = {}, 0
    with tempfile.TemporaryDirectory(prefix="kestrel-ab-") as scratch:
        if args.scripts == "new":
            base = Tree("base", base_under_new_scripts(base.root, new.root, Path(scratch)), base.commit)
        pairs = [(shape, bench) for shape in shapes for bench in args.benches.split(",")] * args.repeat
        for i, (shape, bench) in enumerate(pairs):
            order = ((base, new), (new, base))[:: 1 if i % 2 == 0 else -1]
            for tree, other in order + (order[::-1] if args.abba else ()):
                timeout = min(SHAPES[shape][1 if bench == "throughput" else 2], deadline - time.monotonic())
                if timeout < MIN_LEFT_S:
                    print(f"--- {tree.label} {bench} {shape}: skipped ({timeout:.0f} s left)", flush=True)
                    result = None
                else:
                    result = run_one(tree, other, bench, shape, timeout, Path(scratch))
                missing += result is None
                results.setdefault((shape, bench), {}).setdefault(tree.label, []).append(result or {})
    rows = comparison_rows(results)
    runs = ("means of base new new base" if args.abba else "one run each") + (
        f", medians of {args.repeat} rounds" if args.repeat > 1 else "") + (
        "; both under this tree's benchmarks/" if args.scripts == "new" else "")
    print_table(f"A/B: base {base.commit} vs new {new.commit} (new/base, {runs}; Kestrel alone, bf16 random "
                f"weights)", rows)
    worse = regressions(rows)
    print(f"\nworse than base by more than {TOLERANCE:.0%}: {', '.join(worse) if worse else 'none'}"
          + (f"; {missing} run(s) missing" if missing else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(base=base.commit, new=new.commit, rows=rows, worse=worse,
                                                   runs={f"{s} {b}": r for (s, b), r in results.items()}), indent=1))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
