"""A throwaway containerd (Debian's 1.6) for tests that take it as the reference.

:func:`running_containerd` starts ``containerd`` on its own root, state and
socket under a test directory (no network, the CRI plugin and the snapshotters
and plugins that need more than a plain directory disabled) and stops it by
its pid. :class:`ContainerdServer` drives it with ``ctr --address``: import an
image archive (OCI layout or docker-archive tar) and unpack it with the
overlayfs snapshotter, mount an image's unpacked tree read-only.

``extra_config`` is appended to the generated ``config.toml``, for tests that
add plugins (a proxy snapshotter, say).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from harness.serverprocs import die_with_parent, log_tail, stop_process, wait_ready

START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
CTR_TIMEOUT = 120.0
NAMESPACE = "layerfs-test"
SNAPSHOTTER = "overlayfs"
DISABLED_PLUGINS = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.opt",
                    "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
                    "io.containerd.tracing.processor.v1.otlp"]
UNPACKED = re.compile(r"^unpacking (\S+) \(sha256:[0-9a-f]{64}\)\.\.\.done$", re.M)


def find_containerd() -> str | None:
    return shutil.which("containerd") if shutil.which("ctr") else None


def config_text(directory: Path, extra_config: str = "") -> str:
    disabled = ", ".join(f'"{p}"' for p in DISABLED_PLUGINS)
    return (f'version = 2\nroot = "{directory / "root"}"\nstate = "{directory / "state"}"\n'
            f"disabled_plugins = [{disabled}]\n\n"
            f'[grpc]\n  address = "{directory / "containerd.sock"}"\n'
            f'[ttrpc]\n  address = "{directory / "containerd.sock.ttrpc"}"\n'
            '[debug]\n  address = ""\n[metrics]\n  address = ""\n' + extra_config)


@dataclass
class ContainerdServer:
    """A running containerd and the ``ctr`` that talks to it."""

    directory: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def address(self) -> Path:
        return self.directory / "containerd.sock"

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(["ctr", "--address", str(self.address), "--namespace", NAMESPACE,
                               *args], capture_output=True, text=True, timeout=CTR_TIMEOUT)
        if check and proc.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)}: {proc.stderr.strip()}")
        return proc

    def import_image(self, archive: Path, check: bool = True
                     ) -> subprocess.CompletedProcess[str]:
        """``ctr image import`` (unpacked with the overlayfs snapshotter)."""
        return self.ctr("image", "import", "--snapshotter", SNAPSHOTTER, str(archive),
                        check=check)

    def imported_names(self, proc: subprocess.CompletedProcess[str]) -> list[str]:
        """The image names an import unpacked."""
        return UNPACKED.findall(proc.stdout)

    @contextmanager
    def mounted(self, image: str, target: Path) -> Iterator[Path]:
        """The image's unpacked tree mounted read-only at ``target``."""
        target.mkdir(parents=True, exist_ok=True)
        self.ctr("image", "mount", "--snapshotter", SNAPSHOTTER, image, str(target))
        try:
            yield target
        finally:
            self.ctr("image", "unmount", "--rm", str(target))

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def wait_ready(self) -> None:
        wait_ready(self.process, self.answers, "containerd", self.log_tail, START_TIMEOUT,
                   self.stop)

    def answers(self) -> bool:
        return self.address.exists() and self.ctr("version", check=False).returncode == 0

    def stop(self) -> None:
        """SIGTERM containerd's pid (SIGKILL if it lingers)."""
        stop_process(self.process, STOP_TIMEOUT)


def start_containerd(binary: str, directory: Path, extra_config: str = "") -> ContainerdServer:
    """Start containerd with its files under ``directory`` and wait until it answers."""
    directory.mkdir(parents=True, exist_ok=True)
    config_path = directory / "config.toml"
    config_path.write_text(config_text(directory, extra_config))
    log_path = directory / "containerd.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [binary, "--config", str(config_path)], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=directory, preexec_fn=die_with_parent,  # noqa: PLW1509
        )
    server = ContainerdServer(directory, process, log_path)
    server.wait_ready()
    return server


@contextmanager
def running_containerd(directory: Path, extra_config: str = "") -> Iterator[ContainerdServer]:
    """A containerd for the ``with`` block (a module-scoped fixture's body)."""
    binary = find_containerd()
    if binary is None:
        raise RuntimeError("containerd is not installed (make deps installs it)")
    server = start_containerd(binary, directory, extra_config)
    try:
        yield server
    finally:
        server.stop()
