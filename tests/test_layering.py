"""Layering rules checked by reading the source: the package graph of kestrel/ has no cycle (every import counts,
lazy ones too; only `if TYPE_CHECKING:` imports are exempt), the lowest floors never import upward, and no
environment variable changes behaviour outside the config/CLI code (the few reads that remain are listed here with
their reason)."""
import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "kestrel"

# file -> environment variables it may read, and why
ENV_READS = {
    "cli.py": {"KESTREL_API_KEY", "VLLM_API_KEY"},  # --api-key's documented fallbacks, ours and vLLM's (CLI code)
    "bench/serve.py": {"KESTREL_API_KEY"},  # the same fallback for `kestrel bench serve --api-key` (CLI code)
    "ipc/core_client.py": {"CUDA_VISIBLE_DEVICES"},  # honours the user's device mask when placing engine cores
    "ipc/core_proc.py": {"CUDA_VISIBLE_DEVICES"},  # sets the engine core's own GPU (written, not a switch)
    "platform/triton_gates.py": {"TRITON_INTERPRET"},  # Triton's own interpreter switch, read as Triton reads it
}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (imports for annotations only: not edges)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for n in ast.walk(node)}
    return skip


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (lazy imports count too)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def sources(sub: str = ""):
    return sorted((PKG / sub).rglob("*.py"))


def unit_of(module: str) -> str | None:
    """The package (or top-level module) of kestrel that `module` belongs to: kestrel.engine.core -> engine."""
    parts = module.split(".")
    return parts[1] if parts[0] == "kestrel" and len(parts) > 1 else None


def package_graph(root: Path = PKG) -> dict[str, dict[str, set[str]]]:
    """unit -> imported unit -> the files (relative to kestrel/) whose imports make that edge."""
    edges: dict[str, dict[str, set[str]]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        src = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if src == "__init__":
            continue  # kestrel/__init__.py's lazy re-exports of LLM and SamplingParams sit above everything
        for m in imports_of(path):
            dst = unit_of(m)
            if dst and dst != src and dst != "__init__":
                edges.setdefault(src, {}).setdefault(dst, set()).add(str(rel))
    return edges


def find_cycle(edges: dict[str, dict[str, set[str]]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None when it is acyclic (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(edges.get(u, {})):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        path.pop()
        state[u] = 2
        return None

    for u in sorted(edges):
        if u not in state and (found := visit(u)):
            return found
    return None


def test_package_graph_is_acyclic():
    """The packages of kestrel/ import each other in one direction only (docs/architecture.md's floors)."""
    edges = package_graph()
    cycle = find_cycle(edges)
    if cycle:
        why = "; ".join(f"{a} -> {b} in {sorted(edges[a][b])}" for a, b in zip(cycle, cycle[1:]))
        raise AssertionError(f"package cycle {' -> '.join(cycle)}: {why}")


def test_cycle_finder_sees_an_upward_import(tmp_path):
    """The check itself: a tree where a low package imports a high one (lazily, inside a function) has a cycle."""
    for pkg, body in {"core": "from kestrel.engine import x\n",
                      "engine": "def f():\n    from kestrel.core import y\n"}.items():
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "m.py").write_text(body)
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "m.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from kestrel.engine import z\n")
    edges = package_graph(tmp_path)
    assert find_cycle(edges) in (["core", "engine", "core"], ["engine", "core", "engine"])
    assert "worker" not in edges  # an import for annotations only is not an edge


def test_worker_does_not_import_engine_requests():
    for path in sources("worker"):
        bad = {m for m in imports_of(path) if m.startswith(("kestrel.engine", "kestrel.frontend", "kestrel.ipc"))}
        assert not bad, f"{path.relative_to(PKG)} imports {bad}"


def test_kernels_and_attention_do_not_import_upward():
    upward = {"kernels": ("kestrel.attention", "kestrel.layers", "kestrel.models", "kestrel.engine", "kestrel.worker",
                          "kestrel.lora"),
              "attention": ("kestrel.layers", "kestrel.models", "kestrel.engine", "kestrel.worker"),
              "core": ("kestrel.attention", "kestrel.layers", "kestrel.models", "kestrel.worker", "kestrel.kernels",
                       "kestrel.engine", "kestrel.structured_output", "kestrel.frontend", "kestrel.ipc")}
    for sub, banned in upward.items():
        for path in sources(sub):
            bad = {m for m in imports_of(path) if m.startswith(banned)}
            assert not bad, f"{path.relative_to(PKG)} imports {bad}"


def test_no_environment_switches():
    pattern = re.compile(r"(?:os\.environ(?:\.get)?\s*[\[(]\s*|os\.getenv\(\s*)[\"']([A-Z0-9_]+)[\"']")
    for path in sources():
        rel = str(path.relative_to(PKG))
        names = set(pattern.findall(path.read_text()))
        allowed = ENV_READS.get(rel, set())
        assert names <= allowed, f"{rel} reads environment variables {names - allowed}: make them config fields"
        assert "KESTREL_" not in path.read_text().replace("KESTREL_API_KEY", ""), f"{rel} names a KESTREL_ variable"
