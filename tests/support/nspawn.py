"""A throwaway container with systemd as its PID 1 (``systemd-nspawn --boot``),
for the tests of the systemd units.

Its root file system is an overlay over the host's own ``/`` (the host has
systemd installed), with the upper layer on a tmpfs of its own: nothing to
download and nothing written to the host, built and booted in a few seconds.
What the container boots is trimmed in that upper layer: ``basic.target``
(no host services from ``multi-user.target``), a private network (only
``lo``: the container's units never touch the host's interfaces), and the
manager's log at debug level, so that the journal shows every notification a
service sends. Commands run in it through ``nsenter`` into the namespaces of
its PID 1.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from layerfs.mounts import mounts_under

NSPAWN = "systemd-nspawn"
SYSTEMD = Path("/lib/systemd/systemd")


class Container:
    """One container: ``write`` files into its root, ``boot``, ``run`` commands
    in it, ``close`` (power off, unmount, remove)."""

    def __init__(self, binds: list[tuple[Path, str]], readonly: list[Path]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="layerfs-nspawn-", dir="/tmp"))
        self.root = self.dir / "root"
        self.layers = self.dir / "layers"
        self.binds, self.readonly = binds, readonly
        self.proc: subprocess.Popen | None = None
        self.leader = 0
        self.boot_seconds = 0.0
        self.console = self.dir / "console.log"
        self.root.mkdir()
        self.layers.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "layers", str(self.layers)],
                       check=True)
        (self.layers / "upper").mkdir()
        (self.layers / "work").mkdir()
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir=/,upperdir={self.layers}/upper,workdir={self.layers}/work",
                        str(self.root)], check=True)
        self.write("etc/systemd/system/default.target",
                   link="/lib/systemd/system/basic.target")
        self.write("etc/systemd/system.conf.d/50-debug.conf",
                   "[Manager]\nLogLevel=debug\nLogTarget=journal\n")
        self.write("etc/fstab", "")
        # what the host's / holds for its own services must not run here
        for unit in ("systemd-networkd.service", "networking.service", "ssh.service",
                     "systemd-timesyncd.service", "apt-daily.timer",
                     "apt-daily-upgrade.timer", "e2scrub_all.timer", "fstrim.timer",
                     "man-db.timer", "dpkg-db-backup.timer", "getty.target"):
            self.write(f"etc/systemd/system/{unit}", link="/dev/null")

    def write(self, path: str, text: str = "", link: str | None = None,
              mode: int = 0o644) -> Path:
        """A file (or a symlink) at ``path`` in the container's root."""
        target = self.root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        if link is not None:
            target.symlink_to(link)
        else:
            target.write_text(text)
            target.chmod(mode)
        return target

    def boot(self, timeout: float = 60.0) -> None:
        """Boot it and wait until its manager has started everything it was asked to."""
        argv = [NSPAWN, "--quiet", "--boot", f"--directory={self.root}",
                f"--machine=lfs{os.getpid()}", "--register=no",
                # no unit of its own where the host has no systemd to make one
                *([] if Path("/run/systemd/system").is_dir() else ["--keep-unit"]),
                "--private-network", "--capability=all", "--resolv-conf=off",
                "--timezone=off", "--link-journal=no", "--console=read-only",
                "--bind=/dev/fuse", "--bind=/dev/loop-control"]
        argv += [f"--bind={dev}" for dev in sorted(Path("/dev").glob("loop[0-9]*"))]
        argv += [f"--bind={host}:{inside}" for host, inside in self.binds]
        argv += [f"--bind-ro={path}" for path in self.readonly]
        with open(self.console, "wb") as console:
            # /sys writable, as on a node: the daemon sets the layer mounts' readahead
            env = {**os.environ, "SYSTEMD_NSPAWN_API_VFS_WRITABLE": "1"}
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=console,
                                         stderr=subprocess.STDOUT, env=env)
        started = time.monotonic()
        deadline = started + timeout
        while not self.leader:
            if self.proc.poll() is not None:
                raise AssertionError(f"systemd-nspawn exited {self.proc.returncode}:\n"
                                     f"{self.console_log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the container did not start:\n{self.console_log()}")
            self.leader = container_init(self.proc.pid)
            time.sleep(0.05)
        while True:
            state = self.run("systemctl", "is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                self.boot_seconds = time.monotonic() - started
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the container's systemd is {state!r}:\n"
                                     f"{self.run('systemctl', '--failed', check=False).stdout}"
                                     f"\n{self.console_log()}")
            time.sleep(0.1)

    def nsenter(self) -> list[str]:
        return ["nsenter", f"--target={self.leader}", "--mount", "--uts", "--ipc", "--net",
                "--pid", "--cgroup", "--root", "--wd"]

    def run(self, *argv: str, check: bool = True,
            timeout: float = 120.0) -> subprocess.CompletedProcess:
        """Run ``argv`` in the container, as root; its output as text."""
        proc = subprocess.run([*self.nsenter(), *argv], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} in the container: exit {proc.returncode}\n"
                                 f"{proc.stdout}{proc.stderr}")
        return proc

    def popen(self, *argv: str, **kw) -> subprocess.Popen:
        return subprocess.Popen([*self.nsenter(), *argv], stdin=subprocess.DEVNULL, **kw)

    def console_log(self) -> str:
        return self.console.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        """Power it off (SIGTERM to systemd-nspawn: the container's manager halts),
        killed if that takes over 30 s; then unmount and remove its root."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        for point in mounts_under(self.dir):  # deepest first
            subprocess.run(["umount", "-l", point], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


def container_init(nspawn_pid: int) -> int:
    """The host pid of the container's PID 1: the descendant of systemd-nspawn
    that is pid 1 in its own pid namespace (0 while there is none yet)."""
    todo = [nspawn_pid]
    while todo:
        pid = todo.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        nspid = next((line.split()[1:] for line in status.splitlines()
                      if line.startswith("NSpid:")), [])
        if len(nspid) > 1 and nspid[-1] == "1":
            return pid
        todo += [int(c) for c in children]
    return 0


def unavailable() -> str | None:
    """Why no container can be booted here, or None."""
    if shutil.which(NSPAWN) is None:
        return "systemd-nspawn is not installed (Debian package systemd-container)"
    if not SYSTEMD.exists():
        return f"no systemd on this host ({SYSTEMD}) to boot in a container"
    if not Path("/dev/fuse").exists():
        return "no /dev/fuse"
    return None
