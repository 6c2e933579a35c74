"""The code stays ruff- and mypy-clean (docs/design.md conventions), and mypy sees it whole.

``builder/``, ``cache/`` and ``tools/`` are installed as ``layerfs.builder``,
``layerfs.node.reads`` and ``layerfs.cli`` (pyproject's ``package-dir``); the
editable install's import hook is invisible to mypy. So the checker runs on a
shadow tree, ``.mypy-src/layerfs``, of symlinks laid out as the installed
package (made from ``package-dir`` on every run), and every import between the
four folders is resolved and checked. ``make lint`` runs this module.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SHADOW = ".mypy-src"  # pyproject's [tool.mypy] mypy_path
PACKAGE = "layerfs"


def tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed (pip install -e '.[dev]')")
    return found


def mapped_folders(root: Path) -> dict[str, Path]:
    """Subpackage name -> its folder, for each ``layerfs.X`` mapped elsewhere."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    mapping = pyproject["tool"]["setuptools"]["package-dir"]
    return {name.removeprefix(PACKAGE + "."): root / folder
            for name, folder in mapping.items() if name.startswith(PACKAGE + ".")}


def link_installed_layout(root: Path) -> Path:
    """Make ``root/.mypy-src/layerfs``: the package as installed, as symlinks."""
    shadow = root / SHADOW / PACKAGE
    if shadow.parent.exists():
        shutil.rmtree(shadow.parent)
    shadow.mkdir(parents=True)
    for entry in sorted((root / PACKAGE).iterdir()):
        if entry.name != "__pycache__":
            (shadow / entry.name).symlink_to(entry)
    for name, folder in mapped_folders(root).items():
        (shadow / name).symlink_to(folder)
    return shadow


def mypy(root: Path) -> subprocess.CompletedProcess[str]:
    """The project's type check of the package at ``root``."""
    link_installed_layout(root)
    return subprocess.run([tool("mypy"), "-p", PACKAGE], cwd=root, capture_output=True,
                          text=True)


def test_ruff():
    proc = subprocess.run([tool("ruff"), "check", "layerfs", "builder", "cache", "tools",
                           "tests", "bench", "harness"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy():
    proc = mypy(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# In each folder, a module with a wrong import or call into another folder.
WRONG_MODULES = {
    "layerfs/_wrong.py": "from layerfs.builder.layer import no_such_builder\n",
    "layerfs/builder/_wrong.py": "from layerfs.cli.common import parse_size\n"
                         "parse_size(42)\n",
    "cache/_wrong.py": "from layerfs.cli.main import no_such_command\n",
    "layerfs/cli/_wrong.py": "from layerfs.node.reads.chunkcache import ChunkCache\n"
                       "ChunkCache.no_such_method\n",
}


def copy_of_project(dest: Path) -> Path:
    """The four folders and pyproject.toml, copied to ``dest``."""
    for folder in ("layerfs", *(p.name for p in mapped_folders(ROOT).values())):
        shutil.copytree(ROOT / folder, dest / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_mypy_flags_wrong_imports_and_calls_across_folders(tmp_path):
    root = copy_of_project(tmp_path / "project")
    for name, code in WRONG_MODULES.items():
        (root / name).write_text(code)
    proc = mypy(root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    for name in WRONG_MODULES:
        flagged = f"{SHADOW}/{PACKAGE}/{name.removeprefix(PACKAGE + '/')}"
        assert flagged in out, f"{name} not flagged:\n{out}"
    assert 'Module "layerfs.builder.layer" has no attribute "no_such_builder"' in out
    assert 'Argument 1 to "parse_size" has incompatible type "int"' in out
