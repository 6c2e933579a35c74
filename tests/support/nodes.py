"""A node daemon started for a test: a real ``layerfs daemon`` process.

Every daemon's log is checked: a WARNING or ERROR record (or a traceback) the
test did not declare fails it. A test declares what it provokes with the
marker ``@pytest.mark.daemon_log("regex", ...)``; a daemon that outlives one
test (a module fixture's) declares its own with :meth:`NodeDaemon.expect_log`.
"""

from __future__ import annotations

import logging
import re
import subprocess
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

from harness.daemonproc import LAYERFS, DaemonProcess
from layerfs.node.control import wait_ready

# every NodeDaemon made so far (the conftest checks their logs after each test)
DAEMONS: weakref.WeakSet[NodeDaemon] = weakref.WeakSet()
# the log patterns the running test declared with its daemon_log marker
TEST_EXPECTS: list[re.Pattern[str]] = []


class NodeDaemon(DaemonProcess):
    """A daemon with short timeouts, and the CLI pointed at its root.

    Its layers are read lazily through FUSE whatever their size
    (``--fetch-whole-below 0 --no-kernel-reads``: the path most tests
    exercise, and VM drives and disks always) unless ``whole_below`` or
    ``kernel_reads`` say otherwise (tests/test_localblobs.py,
    tests/test_partialblobs.py)."""

    def __init__(self, root: Path, store_args: list[str], cache_size: str = "1G",
                 read_timeout: float = 5.0, whole_below: str = "0",
                 kernel_reads: bool = False) -> None:
        super().__init__(root, store_args, cache_size, read_timeout)
        self.fixed_args = ["--fetch-whole-below", whole_below,
                           "--kernel-reads" if kernel_reads else "--no-kernel-reads"]
        self.expected: list[re.Pattern[str]] = []
        self.log_checked = 0  # the log's bytes already checked
        DAEMONS.add(self)

    def start(self, timeout: float = 30.0) -> NodeDaemon:
        super().start(timeout)
        return self

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cut = args.index("--") if "--" in args else len(args)  # options go before `--`
        argv = [*LAYERFS, *args[:cut], "--root", str(self.root), *args[cut:]]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"layerfs {' '.join(args)}: {proc.stderr}\n{self.log()}")
        return proc

    def kill(self) -> None:
        """SIGKILL; the next start takes the FUSE connection over from the keeper,
        or, with no keeper left, detaches the mounts the kill left (a warning each)."""
        super().kill()
        self.expect_log(r"WARNING layerfs\.node\.daemon\.service: unmounted stale ")

    def expect_log(self, *patterns: str) -> NodeDaemon:
        """Allow WARNING/ERROR records matching any of these regexes, for good."""
        self.expected += [re.compile(p) for p in patterns]
        return self

    def unexpected_log(self) -> list[str]:
        """The problem records logged since the last check that neither this
        daemon nor the running test expects; marks them checked."""
        records, self.log_checked = self.log_problems(self.log_checked)
        allowed = self.expected + TEST_EXPECTS
        return [r for r in records if not any(p.search(r) for p in allowed)]

    def check_log(self) -> None:
        """Fail (AssertionError) if :meth:`unexpected_log` finds anything."""
        unexpected = self.unexpected_log()
        if unexpected:
            raise AssertionError(unexpected_report(self, unexpected))

    def cleanup(self) -> list[str]:
        """Stop, detach what is left mounted (returned), then check the log."""
        left = super().cleanup()
        self.check_log()
        return left


def up_lazy(node: NodeDaemon, sid: str, env: str = "e@1") -> Path:
    """``layerfs up ENV --id SID --prefetch none`` on ``node``: the rootfs."""
    return Path(node.cli("up", env, "--id", sid, "--prefetch", "none").stdout.strip())


def serving(daemon: NodeDaemon) -> Iterator[NodeDaemon]:
    """A fixture's life of ``daemon`` (``yield from serving(...)``): started,
    handed to the test, and cleaned up after it with nothing left mounted."""
    daemon.start()
    try:
        yield daemon
    finally:
        assert daemon.cleanup() == [], "mounts left behind"


def unexpected_report(daemon: NodeDaemon, records: list[str]) -> str:
    shown = "\n".join(records[:20])
    more = f"\n... and {len(records) - 20} more" if len(records) > 20 else ""
    return (f"daemon at {daemon.root} logged {len(records)} unexpected record(s) "
            f"(declare them with @pytest.mark.daemon_log):\n{shown}{more}")


def unexpected_records(records: list[logging.LogRecord],
                       allowed: list[re.Pattern[str]]) -> list[str]:
    """A test process's own WARNING-or-worse records that no allowed pattern matches."""
    lines = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in records
             if r.levelno >= logging.WARNING]
    return [line for line in lines if not any(p.search(line) for p in allowed)]


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def take_over(node: NodeDaemon) -> None:
    old = node.proc
    assert old is not None
    node.extra_args = ["--takeover"]
    node.start()  # returns once a daemon answers: maybe still the old one
    assert old.wait(60) == 0  # the old daemon exits by itself, cleanly
    proc = node.proc
    assert wait_ready(node.root, lambda: proc.poll() is None, 60), node.log()[-4000:]
    node.extra_args = []


def wait_for_log(node: NodeDaemon, pattern: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, node.log()):
        assert time.monotonic() < deadline, f"no {pattern!r} in:\n{node.log()[-3000:]}"
        time.sleep(0.2)
