"""What every server a test or a benchmark starts needs: a child that dies with
the process that started it, the tail of its log, a wait until it answers, and
a stop by pid (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable
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


def wait_ready(process: subprocess.Popen[bytes], ready: Callable[[], bool], what: str,
               tail: Callable[[], str], timeout: float, stop: Callable[[], None],
               interval: float = 0.1) -> None:
    """Return once ``ready()``; a RuntimeError with the log's ``tail()`` if the
    server exits first, or (after ``stop()``) if it is not ready in ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode} during start;"
                               f" log tail:\n{tail()}")
        if ready():
            return
        time.sleep(interval)
    stop()
    raise RuntimeError(f"{what} did not answer within {timeout:.0f}s; log tail:\n{tail()}")


def stop_process(process: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the server's pid, SIGKILL it if it lingers past ``timeout``, and reap it."""
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout)
