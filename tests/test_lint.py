"""The core stays ruff- and mypy-clean (DESIGN.md conventions)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed (pip install -e '.[dev]')")
    return found


def test_ruff():
    proc = subprocess.run([tool("ruff"), "check", "layerfs", "builder", "cache", "tools",
                           "tests", "bench"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy():
    proc = subprocess.run([tool("mypy"), "layerfs", "builder", "cache", "tools"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
