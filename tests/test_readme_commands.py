"""Issue 36: every `kestrel ...` command that the README and docs/serving.md show parses with today's flags (a flag
renamed or dropped breaks this test, not a new user's first command)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for doc in ("README.md", "docs/serving.md"):
        text = re.sub(r"\\\n\s*", " ", (ROOT / doc).read_text())  # shell line continuations
        for line in text.splitlines():
            if line.startswith(".venv/bin/kestrel "):
                argv = shlex.split(line, comments=True)[1:]
                if "--help" not in argv and argv[:2] != ["bench", "serve"]:  # bench serve has its own parser
                    found.append((doc, argv))
    return found


def test_the_docs_show_commands():
    assert len(documented_commands()) >= 15


@pytest.mark.parametrize("doc,argv", documented_commands(), ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_documented_command_parses(doc, argv):
    from kestrel.cli import build_parser
    from kestrel.config import from_cli_args

    args = build_parser().parse_args(argv)  # a mistake exits 2 with one line, failing the test
    from_cli_args(args)
