"""mount(2) and umount2(2) through libc.

util-linux ``mount`` turns a file source into a loop device; EROFS file-backed
mounts need the syscall itself: source = the meta image file, ``device=`` the
blob file. Layer and sandbox mounts are ``nosuid,nodev`` (:data:`SAFE_FLAGS`):
a layer may ship setuid-root programs and device nodes, and neither may work.

What is mounted where is read from ``/proc/self/mountinfo`` by
:func:`mount_table` alone; :func:`mounts_under` and :func:`fs_type` answer from it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
SAFE_FLAGS = MS_NOSUID | MS_NODEV  # on every mount of layer content
MNT_DETACH = 2
BDI = "/sys/class/bdi"
_bdi_lock = threading.Lock()  # one EROFS mount at a time while its bdi is found

MOUNTINFO = "/proc/self/mountinfo"
_ESCAPE = re.compile(rb"\\([0-7]{3})")  # mountinfo escapes space, tab, newline, backslash as octal

_libc = ctypes.CDLL(None, use_errno=True)  # libc, already loaded: no `ldconfig -p` run


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    rc = _libc.mount(
        os.fsencode(source), os.fsencode(target), fstype.encode(), ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} {source} on {target}: {os.strerror(err)}")


def umount(target: str, lazy: bool = False) -> None:
    rc = _libc.umount2(os.fsencode(target), MNT_DETACH if lazy else 0)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


def mount_erofs(meta_image: str, blob: str | None, target: str, *, directio: bool = False,
                readahead: int = 0) -> None:
    """File-backed EROFS mount of ``meta_image`` with ``blob`` as device 1.

    ``directio``: EROFS reads the blob with O_DIRECT, so the blob file keeps no
    page cache of its own and is read exactly where EROFS needs it (no
    readahead past the end of a file into its neighbours); kernels without the
    option mount without it. ``readahead``: the new mount's readahead window in
    bytes (its ``erofs-N`` entry in /sys/class/bdi, found by the entry that
    appears with the mount).
    """
    data = f"device={blob}" if blob else ""
    flags = MS_RDONLY | SAFE_FLAGS
    with _bdi_lock:
        before = _erofs_bdis() if readahead else set()
        if directio:
            try:
                mount(meta_image, target, "erofs", flags, data + ",directio")
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                mount(meta_image, target, "erofs", flags, data)
        else:
            mount(meta_image, target, "erofs", flags, data)
        new = _erofs_bdis() - before if readahead else set()
    for name in new:
        _write_readahead(name, readahead)


def _erofs_bdis() -> set[str]:
    return {name for name in os.listdir(BDI) if name.startswith("erofs-")}


def _write_readahead(bdi: str, nbytes: int) -> None:
    with open(f"{BDI}/{bdi}/read_ahead_kb", "w") as f:
        f.write(str(max(nbytes // 1024, 4)))


def set_readahead(path: str, nbytes: int) -> None:
    """Set the kernel readahead window of the file system mounted at ``path``
    (its ``/sys/class/bdi`` entry); files opened afterwards read ahead that far.
    The device comes from mountinfo: a stat of a FUSE mount point would wait for
    its daemon."""
    target = os.path.abspath(path)  # no realpath: it would stat the mount point
    devs = [m.device for m in mount_table() if m.point == target]
    if not devs:
        raise OSError(errno.ENOENT, f"nothing mounted on {target}")
    _write_readahead(devs[-1], nbytes)


@dataclass(frozen=True)
class MountEntry:
    """One line of mountinfo: what is mounted where."""

    device: str  # major:minor
    point: str  # the mount point, escapes decoded
    fstype: str


def mount_table() -> list[MountEntry]:
    """The mounts of this process's mount namespace, in mount order."""
    with open(MOUNTINFO, "rb") as f:
        return [_entry(line.split()) for line in f]


def _entry(fields: list[bytes]) -> MountEntry:
    point = _ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), fields[4])
    fstype = fields[fields.index(b"-") + 1]
    return MountEntry(fields[2].decode(), point.decode(errors="surrogateescape"),
                      fstype.decode(errors="replace"))


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below ``root``, deepest first."""
    base = str(root.resolve())
    found = {m.point for m in mount_table() if m.point == base or m.point.startswith(base + "/")}
    return sorted(found, key=lambda p: (-p.count("/"), p))


def fs_type(path: Path) -> str:
    """The type of the file system ``path`` lies on."""
    best, kind = "", "unknown file system"
    target = str(path.resolve())
    for m in mount_table():
        inside = target == m.point or target.startswith(m.point.rstrip("/") + "/")
        if inside and len(m.point) >= len(best):
            best, kind = m.point, m.fstype
    return kind
