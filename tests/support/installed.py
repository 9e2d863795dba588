"""The tools `bash deploy/install-tools.sh` puts in .tools/bin (helm, kubectl,
kubernetes-validate, Claude Code, Codex), which PyPI does not ship as the project's
dependencies; CI runs it first. A missing tool fails the test with that instruction;
nothing is skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools" / "bin"


def tool(name: str) -> str:
    """The path of an installed tool; fails the test when it is not installed."""
    path = TOOLS / name
    if not os.access(path, os.X_OK):
        pytest.fail(
            f".tools/bin/{name} is missing: run `bash deploy/install-tools.sh` first",
            pytrace=False,
        )
    return str(path)
