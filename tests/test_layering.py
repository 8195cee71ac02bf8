"""Layering rules checked by reading the source: the worker never imports the engine's request objects, the
kernel and attention packages never import upward, and no environment variable changes behaviour outside the
config/CLI code (the few reads that remain are listed here with their reason)."""
import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "kestrel"

# file -> environment variables it may read, and why
ENV_READS = {
    "cli.py": {"KESTREL_API_KEY"},  # --api-key's documented fallback (CLI code)
    "bench/serve.py": {"KESTREL_API_KEY"},  # the same fallback for `kestrel bench serve --api-key` (CLI code)
    "engine/core_client.py": {"CUDA_VISIBLE_DEVICES"},  # honours the user's device mask when placing engine cores
    "engine/core_proc.py": {"CUDA_VISIBLE_DEVICES"},  # sets the engine core's own GPU (written, not a switch)
    "platform/triton_gates.py": {"TRITON_INTERPRET"},  # Triton's own interpreter switch, read as Triton reads it
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def sources(sub: str = ""):
    return sorted((PKG / sub).rglob("*.py"))


def test_worker_does_not_import_engine_requests():
    for path in sources("worker"):
        bad = {m for m in imports_of(path) if m.startswith(("kestrel.engine.request", "kestrel.engine.scheduler"))}
        assert not bad, f"{path.relative_to(PKG)} imports {bad}"


def test_kernels_and_attention_do_not_import_upward():
    upward = {"kernels": ("kestrel.attention", "kestrel.layers", "kestrel.models", "kestrel.engine", "kestrel.worker"),
              "attention": ("kestrel.layers", "kestrel.models", "kestrel.engine", "kestrel.worker"),
              "core": ("kestrel.attention", "kestrel.layers", "kestrel.models", "kestrel.worker", "kestrel.kernels",
                       "kestrel.engine.request", "kestrel.engine.scheduler")}
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
