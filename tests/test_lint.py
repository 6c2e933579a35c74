"""The code stays ruff- and mypy-clean (docs/design.md conventions), and mypy sees it whole.

The source tree is the import tree (``layerfs/`` is the package, its CLI in
``layerfs/cli/``, the builder in ``layerfs/builder/``), so mypy runs on the tree
itself and every import between subpackages is resolved and checked. ``make
lint`` runs this module.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PACKAGE = "layerfs"


def tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed (pip install -e '.[dev]')")
    return found


def mypy(root: Path) -> subprocess.CompletedProcess[str]:
    """The project's type check of the package at ``root``."""
    return subprocess.run([tool("mypy"), "-p", PACKAGE], cwd=root, capture_output=True,
                          text=True)


def test_ruff():
    proc = subprocess.run([tool("ruff"), "check", "layerfs", "tests", "bench", "harness"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy():
    proc = mypy(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# In each subpackage, a module with a wrong import or call into another one.
WRONG_MODULES = {
    "layerfs/_wrong.py": "from layerfs.builder.layer import no_such_builder\n",
    "layerfs/builder/_wrong.py": "from layerfs.cli.common import parse_size\n"
                                 "parse_size(42)\n",
    "layerfs/node/reads/_wrong.py": "from layerfs.cli.main import no_such_command\n",
    "layerfs/cli/_wrong.py": "from layerfs.node.reads.chunkcache import ChunkCache\n"
                             "ChunkCache.no_such_method\n",
}


def copy_of_project(dest: Path) -> Path:
    """The package and pyproject.toml, copied to ``dest``."""
    shutil.copytree(ROOT / PACKAGE, dest / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_mypy_flags_wrong_imports_and_calls_across_subpackages(tmp_path):
    root = copy_of_project(tmp_path / "project")
    for name, code in WRONG_MODULES.items():
        (root / name).write_text(code)
    proc = mypy(root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    for name in WRONG_MODULES:
        assert name in out, f"{name} not flagged:\n{out}"
    assert 'Module "layerfs.builder.layer" has no attribute "no_such_builder"' in out
    assert 'Argument 1 to "parse_size" has incompatible type "int"' in out
