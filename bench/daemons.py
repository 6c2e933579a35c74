"""What the benchmarks share about the daemons they run: a numbered log per
daemon, stopping one with a check of its exit code and of mounts left under
its root, stopping every daemon still running at the end, scanning the logs
for problems, and dropping the kernel's page cache between timed steps.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from harness.daemonproc import DaemonProcess, detach_mounts

PROBLEM_WORDS = ("ERROR", "WARNING", "Traceback", "Exception")


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def print_footer(logs: dict, oddities: list[str], total: str) -> None:
    """The end of a benchmark's report: the daemons' log scan (its first problem
    lines), the oddities seen, the total time."""
    print(f"daemon logs: {logs['logs']} runs, {logs['problem_lines']} warning/error lines")
    for line in logs["first"][:5]:
        print(f"  {line}")
    for odd in oddities:
        print(f"oddity: {odd}")
    print(f"total {total}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (a daemon), all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def clear_dir(path: Path, oddities: list[str]) -> Path:
    """Detach what is mounted under ``path`` (noting it) and remove it."""
    left = detach_mounts(path)
    if left:
        oddities.append(f"mounts left under {path}: {left}")
    shutil.rmtree(path, ignore_errors=True)
    return path


class DaemonRuns:
    """The daemons of one benchmark run, their logs under ``work/logs``; what
    looks wrong (an exit code, leftover mounts) is appended to ``oddities``."""

    def __init__(self, work: Path, oddities: list[str], cache_size: str,
                 read_timeout: float = 60.0, request_timeout: float = 1800.0,
                 daemon_args: list[str] | None = None) -> None:
        self.work = work
        self.daemon_args = daemon_args or []  # more options for every daemon
        self.oddities = oddities
        self.cache_size = cache_size
        self.read_timeout = read_timeout
        self.request_timeout = request_timeout
        self.logs: list[Path] = []
        self.running: list[DaemonProcess] = []
        shutil.rmtree(work / "logs", ignore_errors=True)

    def start(self, root: Path, tag: str, store_args: list[str]) -> DaemonProcess:
        log = self.work / "logs" / f"{len(self.logs) + 1:03d}-{tag}.log"
        log.unlink(missing_ok=True)
        self.logs.append(log)
        node = DaemonProcess(root, store_args, self.cache_size,
                             self.read_timeout, log, request_timeout=self.request_timeout)
        node.extra_args = list(self.daemon_args)  # after the defaults: they win (--log-level)
        self.running.append(node)
        return node.start()

    @staticmethod
    def add_arguments(ap: Any) -> None:
        ap.add_argument("--miss-span", default=None,
                        help="the daemons' --miss-span (default: the daemon's own)")
        ap.add_argument("--kernel-reads", action="store_true",
                        help="the daemons mount larger layers over partial blob files "
                             "(--kernel-reads; default: over FUSE files)")
        ap.add_argument("--layer-readahead", default=None,
                        help="the daemons' --layer-readahead (default: the daemon's own)")

    @staticmethod
    def options(args: Any) -> list[str]:
        """The daemon options the command line asked for."""
        span = ["--miss-span", args.miss_span] if args.miss_span is not None else []
        ahead = ["--layer-readahead", args.layer_readahead] if args.layer_readahead else []
        return span + ahead + (["--kernel-reads"] if args.kernel_reads else [])

    def finish(self, node: DaemonProcess, remove_root: bool = False) -> None:
        """Stop ``node``; detach what it left mounted; remove its root if asked."""
        code = node.stop()
        if node in self.running:
            self.running.remove(node)
        if code != 0:
            self.oddities.append(f"daemon exited {code}; see {node.log_path}")
        left = detach_mounts(node.root)
        if left:
            self.oddities.append(f"mounts left under {node.root} after the daemon stopped: "
                                 f"{left}")
        if remove_root:
            shutil.rmtree(node.root, ignore_errors=True)

    def stop_all(self) -> None:
        for node in list(self.running):
            node.stop()
            self.running.remove(node)

    def scan_logs(self) -> dict:
        lines = []
        for log in self.logs:
            if log.exists():
                lines += [f"{log.name}: {ln}" for ln in log.read_text(errors="replace").splitlines()
                          if any(w in ln for w in PROBLEM_WORDS)]
        return {"logs": len(self.logs), "problem_lines": len(lines), "first": lines[:20]}
