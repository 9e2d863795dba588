"""The tools `bash deploy/install-tools.sh` puts in .tools/bin (helm, kubectl,
kubernetes-validate, Claude Code, Codex) and in .tools/ai-sdk (the Vercel AI SDK's npm
packages), which PyPI does not ship as the project's dependencies; CI runs it first. A
missing tool fails the test with that instruction; nothing is skipped.
"""

from __future__ import annotations

import os
import shutil
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


def ai_sdk() -> tuple[str, Path]:
    """`node` and the folder the AI SDK's packages are installed in (scripts run there
    find them); fails the test when either is missing."""
    node = shutil.which("node")
    folder = ROOT / ".tools" / "ai-sdk"
    if node is None or not (folder / "node_modules" / "ai" / "package.json").is_file():
        missing = "node" if node is None else ".tools/ai-sdk"
        pytest.fail(
            f"{missing} is missing: run `bash deploy/install-tools.sh` first (it needs Node.js)",
            pytrace=False,
        )
    return node, folder
