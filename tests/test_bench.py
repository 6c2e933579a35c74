"""Every benchmark is a module of the ``bench`` package: it runs as
``python -m bench.NAME`` from the project root (and shows its ``--help``
there), and the helpers it shares are imported from the package, never from
``tests/`` or through a patched ``sys.path``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
HELPERS = {"__init__", "daemons"}  # imported by the scripts, not run
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in HELPERS)
# what the tests keep to themselves (bench/ may use harness/, not these)
TEST_MODULES = {p.stem for p in (ROOT / "tests").glob("*.py")}


def test_every_script_shows_its_help():
    procs = {name: subprocess.Popen([sys.executable, "-m", f"bench.{name}", "--help"],
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for name in SCRIPTS}
    failed = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0 or "usage:" not in out:
            failed[name] = f"exit {proc.returncode}: {err.strip()[-500:]}"
    assert not failed, failed
    assert len(SCRIPTS) >= 15


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.stem)
def test_imports_only_packages(path):
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported.add(node.module.split(".")[0])
    assert not imported & TEST_MODULES, f"{path.name} imports from tests/"
    assert "sys.path" not in path.read_text(), f"{path.name} patches sys.path"


def test_helpers_import():
    proc = subprocess.run([sys.executable, "-c", "import bench.daemons, harness.seaweedcluster, "
                           "harness.registryserver, harness.ociimages"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
