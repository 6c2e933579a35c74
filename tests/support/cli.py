"""The ``layerfs`` command as the tests run it: a process per call."""

from __future__ import annotations

import subprocess
import sys


def layerfs(*args: str, check: bool = True, env: dict | None = None,
            stdin: bytes | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "layerfs.cli.main", *args],
                          capture_output=True, text=True, timeout=120, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"layerfs {' '.join(args)} failed: {proc.stderr}")
    return proc


def one_line_error(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("layerfs: error: "), proc.stderr
    return lines[0]
