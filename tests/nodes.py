"""A node daemon started for a test: a real ``layerfs daemon`` process."""

from __future__ import annotations

import subprocess
from pathlib import Path

from layerfs.node.process import LAYERFS, DaemonProcess


class NodeDaemon(DaemonProcess):
    """A daemon with short timeouts, and the CLI pointed at its root."""

    def __init__(self, root: Path, store_args: list[str], cache_size: str = "1G",
                 read_timeout: float = 5.0) -> None:
        super().__init__(root, store_args, cache_size, read_timeout)

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
