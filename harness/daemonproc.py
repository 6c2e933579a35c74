"""A ``layerfs daemon`` run as a child process: start, ask, stop, clean up.

Used by the test suite and the benchmarks, which drive real daemons.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from layerfs.node.control import call_raw, wait_ready
from layerfs.node.daemon.service import mounts_under

LAYERFS = [sys.executable, "-m", "layerfs.cli.main"]
# a log record's first line: "2026-01-01 12:00:00,123 LEVEL logger: message"
LOG_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (?P<level>[A-Z]+) ")
PROBLEM_LEVELS = frozenset({"WARNING", "ERROR", "CRITICAL"})
# lines outside a log record that are problems: a traceback, a CLI error line
STRAY_STARTS = ("Traceback ", "Exception ", "layerfs: error: ")


def detach_mounts(path: Path) -> list[str]:
    """Lazily unmount whatever is mounted at or below ``path``; return the list."""
    left = mounts_under(path) if path.exists() else []
    for point in left:
        subprocess.run(["umount", "-l", point], check=False)
    return left


class DaemonProcess:
    """One daemon on ``root`` with its log in ``log_path``."""

    def __init__(self, root: Path, store_args: list[str], cache_size: str = "1G",
                 read_timeout: float = 30.0, log_path: Path | None = None,
                 request_timeout: float = 120.0) -> None:
        self.root = root
        self.store_args = store_args
        self.cache_size = cache_size
        self.read_timeout = read_timeout
        self.log_path = log_path or root.parent / f"{root.name}-daemon.log"
        self.request_timeout = request_timeout
        self.proc: subprocess.Popen | None = None
        self.fixed_args: list[str] = []  # `layerfs daemon` options of every start
        self.extra_args: list[str] = []  # more `layerfs daemon` options
        self.command = LAYERFS  # the program run as `layerfs`

    def start(self, timeout: float = 60.0) -> DaemonProcess:
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.command, "daemon", "--root", str(self.root), *self.store_args,
                 "--cache-size", self.cache_size, "--read-timeout", str(self.read_timeout),
                 "--log-level", "info", *self.fixed_args, *self.extra_args],
                stdout=log, stderr=log)
        proc = self.proc
        if not wait_ready(self.root, lambda: proc.poll() is None, timeout):
            raise RuntimeError(f"daemon did not start:\n{self.log()[-4000:]}")
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_problems(self, start: int = 0) -> tuple[list[str], int]:
        """The WARNING, ERROR and CRITICAL records (each with its continuation
        lines, a traceback), CLI error lines and stray tracebacks the log holds
        from byte ``start`` on, and the offset its end; only whole lines."""
        if not self.log_path.exists():
            return [], start
        with open(self.log_path, "rb") as f:
            f.seek(start)
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]
        return problem_records(whole.decode(errors="replace")), start + len(whole)

    def request(self, op: str, **kw: Any) -> dict:
        """The daemon's answer to request ``op`` with fields ``kw``, as JSON
        (sent as given, so that tests can send what a client would not)."""
        return call_raw(self.root, {"op": op, **kw}, timeout=self.request_timeout)

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM and wait (SIGKILL if it takes longer); the exit code."""
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(30)
        self.proc = None
        return code

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.proc = None

    def cleanup(self) -> list[str]:
        """Stop if running; return the mounts left under ROOT (and detach them)."""
        self.stop()
        return detach_mounts(self.root)

    def proc_status(self) -> dict:
        """Peak and current RSS and CPU seconds (all threads) of the daemon so far."""
        assert self.proc is not None
        pid = self.proc.pid
        fields = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                fields[key] = int(value.split()[0]) * 1024
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
        return {"peak_rss_bytes": fields.get("VmHWM", 0), "rss_bytes": fields.get("VmRSS", 0),
                "cpu_s": round(cpu, 2)}


def problem_records(text: str) -> list[str]:
    """The records of a daemon log that are not INFO or DEBUG (see
    :meth:`DaemonProcess.log_problems`); a line outside any record is one when
    it starts a traceback or is a CLI error line."""
    records: list[list[str]] = []
    keep = False
    for line in text.splitlines():
        match = LOG_RECORD.match(line)
        if match:
            keep = match["level"] in PROBLEM_LEVELS
            if keep:
                records.append([line])
        elif line.startswith(STRAY_STARTS) and not (keep and line.startswith("Traceback ")):
            keep = True
            records.append([line])
        elif keep:
            records[-1].append(line)
    return ["\n".join(lines) for lines in records]
