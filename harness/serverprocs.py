"""What every server a test or a benchmark starts needs: a child that dies with
the process that started it, the tail of its log, and a stop by pid (SIGTERM,
then SIGKILL)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from pathlib import Path

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child before exec: get SIGKILL if the test process dies without cleaning up."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def log_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a server's log, for a failure message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop_process(process: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the server's pid, SIGKILL it if it lingers past ``timeout``, and reap it."""
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout)
