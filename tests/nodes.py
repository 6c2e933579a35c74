"""A node daemon started for a test: a real ``layerfs daemon`` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from layerfs.node.control import call, wait_ready
from layerfs.node.daemon import mounts_under

LAYERFS = [sys.executable, "-m", "layerfs.tools.main"]


class NodeDaemon:
    def __init__(self, root: Path, store_args: list[str], cache_size: str = "1G",
                 read_timeout: float = 5.0) -> None:
        self.root = root
        self.store_args = store_args
        self.cache_size = cache_size
        self.read_timeout = read_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path = root.parent / f"{root.name}-daemon.log"

    def start(self, timeout: float = 30.0) -> NodeDaemon:
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the daemon owns it
        self.proc = subprocess.Popen(
            [*LAYERFS, "daemon", "--root", str(self.root), *self.store_args,
             "--cache-size", self.cache_size, "--read-timeout", str(self.read_timeout),
             "--log-level", "info"], stdout=log, stderr=log)
        log.close()
        proc = self.proc
        if not wait_ready(self.root, lambda: proc.poll() is None, timeout):
            raise AssertionError(f"daemon did not start:\n{self.log()}")
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def request(self, op: str, **kw) -> dict:
        return call(self.root, {"op": op, **kw}, timeout=120)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cut = args.index("--") if "--" in args else len(args)  # options go before `--`
        argv = [*LAYERFS, *args[:cut], "--root", str(self.root), *args[cut:]]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"layerfs {' '.join(args)}: {proc.stderr}\n{self.log()}")
        return proc

    def stop(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self.proc = None
        return code

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.proc = None

    def cleanup(self) -> list[str]:
        """Stop if running; return the mounts left under ROOT (and detach them)."""
        if self.proc is not None:
            try:
                self.stop()
            except subprocess.TimeoutExpired:
                self.kill()
        left = mounts_under(self.root)
        for point in left:
            subprocess.run(["umount", "-l", point], check=False)
        return left


def wait_gone(path: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(path)
