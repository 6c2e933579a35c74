"""Real microVM guests for the test suite and the benchmarks: QEMU (TCG) on
the drives ``vm up`` hands out.

* **Kernel.** Debian's cloud kernel (the package ``linux-image-cloud-amd64``
  depends on), fetched once with ``apt-get download`` and kept with the
  modules a guest needs (:data:`GUEST_MODULES`: virtio-mmio and virtio-pci,
  virtio-blk, virtio-pmem, EROFS, overlayfs and what they depend on: the
  cloud kernel has them as modules; ext4 is built in) in
  :data:`CACHE_DIR`, outside any checkout; fetched again when that list
  changes. Concurrent fetches (test workers)
  take a lock; a cached kernel is used without asking APT again.
* **Initramfs.** A newc cpio archive made here: the host's static busybox,
  those modules, and an ``/init`` that mounts ``/proc``, ``/sys`` and
  ``/dev``, loads the modules and runs the caller's script.
* **Machine.** ``qemu-system-x86_64 -M microvm -accel tcg`` (``q35`` for
  pmem drives, which are PCI only): this machine's
  ``/dev/kvm`` runs only PVM guest kernels at speed, so guests are emulated.
  ``tsc_early_khz`` on the command line: under TCG the TSC calibration can
  fail and hang the guest silently. microvm's virtio-mmio devices are
  described by ACPI (kept on). The serial console is the guest's stdin and
  stdout: :class:`Guest` reads its lines, waits for patterns and writes lines.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR = Path(os.environ.get("LAYERFS_GUEST_CACHE", "/var/cache/layerfs-tests"))
KERNEL_PACKAGE = "linux-image-cloud-amd64"  # a metapackage: depends on the kernel's own
# loaded with what they depend on: virtio-mmio (microvm) and virtio-pci (q35) transports,
# block and pmem drives, EROFS and overlayfs (a guest stacks the layers it mounted)
GUEST_MODULES = ("virtio_mmio", "virtio_pci", "virtio_blk", "virtio_pmem", "nd_pmem", "erofs",
                 "overlay")
QEMU = "qemu-system-x86_64"
QEMU_MACHINE = ["-accel", "tcg", "-cpu", "max", "-smp", "1", "-nodefaults",
                "-no-reboot", "-nographic", "-serial", "stdio"]
# no_timer_check: under TCG on a loaded host the kernel's check of the IO-APIC timer can
# fail and panic a q35 guest ("IO-APIC + timer doesn't work!")
KERNEL_ARGS = "console=ttyS0 tsc_early_khz=2000000 no_timer_check panic=-1 quiet loglevel=4"
BOOT_TIMEOUT = 90.0  # seconds from start to the first line of the caller's script
END = "GUEST-END"  # what /init prints after the caller's script, before powering off


class GuestUnavailable(Exception):
    """What a guest needs cannot be had on this machine (no QEMU, no kernel)."""


@dataclass(frozen=True)
class GuestKernel:
    """A cached kernel and its modules, in load order."""

    version: str
    vmlinuz: Path
    modules: list[Path]


def qemu_or_none() -> str | None:
    return shutil.which(QEMU)


# -- the kernel --

def guest_kernel(cache_dir: Path = CACHE_DIR) -> GuestKernel:
    """The cached guest kernel, fetched first if there is none
    (:class:`GuestUnavailable` if APT cannot get it)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        kernel = cached_kernel(cache_dir)
        if kernel is None:
            fetch_kernel(cache_dir)
            kernel = cached_kernel(cache_dir)
        if kernel is None:
            raise GuestUnavailable(f"no kernel in {cache_dir} after a fetch")
        return kernel


def wanted() -> str:
    return "\n".join(GUEST_MODULES) + "\n"


def cached_kernel(cache_dir: Path) -> GuestKernel | None:
    """The newest complete kernel in the cache (one has a ``modules.order``)
    kept with today's :data:`GUEST_MODULES` (its ``modules.wanted``)."""
    found = sorted(p.parent for p in cache_dir.glob("kernel-*/modules.order")
                   if (p.parent / "modules.wanted").exists()
                   and (p.parent / "modules.wanted").read_text() == wanted())
    if not found:
        return None
    home = found[-1]
    order = (home / "modules.order").read_text().split()
    return GuestKernel(home.name.removeprefix("kernel-"), home / "vmlinuz",
                       [home / "modules" / f"{name}.ko" for name in order])


def kernel_package() -> str:
    """The kernel package the cloud metapackage depends on (after an
    ``apt-get update`` if APT does not know it yet)."""
    for attempt in range(2):
        proc = subprocess.run(["apt-cache", "depends", KERNEL_PACKAGE], capture_output=True,
                              text=True)
        found = re.findall(r"Depends: (linux-image-\S+)", proc.stdout)
        if found:
            return found[0]
        if attempt == 0:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, check=False)
    raise GuestUnavailable(f"APT knows no {KERNEL_PACKAGE}: {proc.stderr.strip()}")


def fetch_kernel(cache_dir: Path) -> None:
    """Download the kernel package, unpack it, and keep the kernel and the
    guest's modules in ``cache_dir/kernel-VERSION`` (made whole, then renamed)."""
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise GuestUnavailable("no apt-get or dpkg-deb to fetch a guest kernel")
    package = kernel_package()
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".fetch-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)  # apt's download user writes here where it can
        proc = subprocess.run(["apt-get", "download", "-q", package], cwd=work,
                              capture_output=True, text=True)
        debs = list(work.glob("*.deb"))
        if proc.returncode != 0 or not debs:
            raise GuestUnavailable(f"apt-get download {package}: {proc.stderr.strip()}")
        tree = work / "x"
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(tree)], check=True)
        vmlinuz = next(tree.glob("boot/vmlinuz-*"))
        version = vmlinuz.name.removeprefix("vmlinuz-")
        found = {p.name.removesuffix(".ko").replace("-", "_"): p
                 for p in (tree / "lib" / "modules" / version).rglob("*.ko")}
        order = module_order(GUEST_MODULES, found)
        home = work / f"kernel-{version}"
        (home / "modules").mkdir(parents=True)
        shutil.copy(vmlinuz, home / "vmlinuz")
        for name in order:
            shutil.copy(found[name], home / "modules" / f"{name}.ko")
        (home / "modules.wanted").write_text(wanted())
        (home / "modules.order").write_text("\n".join(order) + "\n")
        shutil.rmtree(cache_dir / home.name, ignore_errors=True)  # kept with other modules
        os.rename(home, cache_dir / home.name)


def module_depends(path: Path) -> list[str]:
    """The modules a ``.ko`` file depends on (its modinfo ``depends=``)."""
    data = path.read_bytes()
    match = re.search(rb"(?:^|\0)depends=([^\0]*)\0", data)
    if match is None:
        return []
    return [d.decode().replace("-", "_") for d in match.group(1).split(b",") if d]


def module_order(wanted: tuple[str, ...], found: dict[str, Path]) -> list[str]:
    """``wanted`` and what they depend on, each after its dependencies; a
    module the kernel does not have as a file is built in (skipped)."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order or name not in found:
            return
        for dep in module_depends(found[name]):
            visit(dep)
        order.append(name)

    for name in wanted:
        visit(name)
    return order


# -- the initramfs --

INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in {modules}; do insmod /lib/modules/$m.ko || echo "GUEST-ERROR insmod $m"; done
n=0
while [ ! -e /dev/vda ] && [ $n -lt 100 ]; do sleep 0.1; n=$((n + 1)); done
echo GUEST-START
sh /script.sh
echo "{end} $?"
sync
poweroff -f
"""


class Cpio:
    """A newc cpio archive written as it is made (what the kernel unpacks as
    an initramfs)."""

    def __init__(self, path: Path) -> None:
        self.f = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"") -> None:
        encoded = name.encode() + b"\0"
        fields = [self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0]
        header = b"070701" + b"".join(b"%08X" % v for v in fields)
        self.ino += 1
        self.f.write(header + encoded + b"\0" * (-(len(header) + len(encoded)) % 4))
        self.f.write(data + b"\0" * (-len(data) % 4))

    def directory(self, name: str) -> None:
        self._entry(name, stat.S_IFDIR | 0o755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | mode, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def close(self) -> None:
        self._entry("TRAILER!!!", 0)
        self.f.close()


def busybox() -> Path:
    """The host's static busybox (Debian's busybox-static)."""
    for candidate in ("/bin/busybox", "/usr/bin/busybox"):
        path = Path(candidate)
        if path.exists():
            return path
    raise GuestUnavailable("no busybox (Debian busybox-static)")


def make_initramfs(path: Path, kernel: GuestKernel, script: str) -> Path:
    """An initramfs at ``path`` whose /init loads the modules and runs ``script``."""
    cpio = Cpio(path)
    for d in ("bin", "dev", "proc", "sys", "mnt", "newroot", "tmp", "lib", "lib/modules"):
        cpio.directory(d)
    cpio.file("bin/busybox", busybox().read_bytes(), 0o755)
    cpio.symlink("bin/sh", "busybox")
    for module in kernel.modules:
        cpio.file(f"lib/modules/{module.name}", module.read_bytes())
    names = " ".join(m.name.removesuffix(".ko") for m in kernel.modules)
    cpio.file("init", INIT.format(modules=names, end=END).encode(), 0o755)
    cpio.file("script.sh", script.encode(), 0o755)
    cpio.close()
    return path


# -- the machine --

def qemu_argv(kernel: GuestKernel, initramfs: Path, drive_args: list[str],
              memory_mb: int = 512, kernel_args: str = "", machine: str = "microvm",
              memory_args: list[str] | None = None, extra: list[str] | None = None
              ) -> list[str]:
    """QEMU's command line: ``machine`` (microvm; ``q35`` for pmem drives),
    ``-m memory_mb`` or ``memory_args`` (a maxmem for pmem drives), the
    kernel, the initramfs and the drives."""
    qemu = qemu_or_none()
    if qemu is None:
        raise GuestUnavailable(f"no {QEMU} (Debian qemu-system-x86)")
    return [qemu, "-M", machine, *QEMU_MACHINE, *(memory_args or ["-m", str(memory_mb)]),
            "-kernel", str(kernel.vmlinuz), "-initrd", str(initramfs),
            "-append", f"{KERNEL_ARGS} {kernel_args}".strip(), *drive_args, *(extra or [])]


class Guest:
    """A running guest: its serial console's lines (kept, and written to
    ``log_path``), patterns waited for, lines sent."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.argv = argv
        self.log_path = log_path
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line came (time.monotonic())
        self.started = time.monotonic()
        self._cond = threading.Condition()
        self._log = open(log_path, "w")  # noqa: SIM115 (closed when the console ends)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            now = time.monotonic()
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            self._log.write(f"{now - self.started:8.3f} {line}\n")
            self._log.flush()
            with self._cond:
                self.lines.append(line)
                self.times.append(now)
                self._cond.notify_all()
        with self._cond:
            self._log.close()
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = BOOT_TIMEOUT, start: int = 0
                 ) -> tuple[int, re.Match[str]]:
        """The first line from ``start`` on that matches ``pattern`` (its
        index and match); AssertionError with the console's tail if none
        comes within ``timeout`` or the guest ends first."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        i = start
        with self._cond:
            while True:
                while i < len(self.lines):
                    match = regex.search(self.lines[i])
                    if match:
                        return i, match
                    i += 1
                left = deadline - time.monotonic()
                ended = self._log.closed
                if left <= 0 or ended:
                    tail = "\n".join(self.lines[-40:])
                    why = "the guest ended" if ended else f"{timeout:.0f} s passed"
                    raise AssertionError(f"{why} before a line matching {pattern!r}; "
                                         f"console ({self.log_path}):\n{tail}")
                self._cond.wait(min(left, 1.0))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = BOOT_TIMEOUT) -> int:
        """Wait for the script's end line and for QEMU to exit (the guest
        powers off); the script's exit status."""
        _, match = self.wait_for(rf"^{END} (\d+)", timeout)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.stop()
        return int(match.group(1))

    def stop(self) -> None:
        """Kill QEMU if it still runs. One waiting on a FUSE file whose daemon
        is gone exits only once the connection is answered or aborted: it is
        left to that (no wait past 10 s)."""
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                return
        self._reader.join(10)

    def waiting_on_fuse(self) -> bool:
        """Whether a thread of QEMU waits for a FUSE answer (a drive's read or
        write is with the daemon, or waits for one to come back)."""
        for wchan in Path(f"/proc/{self.proc.pid}/task").glob("*/wchan"):
            try:
                if "fuse" in (name := wchan.read_text()) or name == "request_wait_answer":
                    return True
            except OSError:
                continue
        return False


@contextmanager
def running_guest(kernel: GuestKernel, script: str, drive_args: list[str], work: Path,
                  name: str = "guest", **qemu: object) -> Iterator[Guest]:
    """A guest running ``script`` on ``drive_args``, killed on the way out
    if it has not ended."""
    initramfs = make_initramfs(work / f"{name}.cpio", kernel, script)
    guest = Guest(qemu_argv(kernel, initramfs, drive_args, **qemu),  # type: ignore[arg-type]
                  work / f"{name}.log")
    try:
        yield guest
    finally:
        guest.stop()
