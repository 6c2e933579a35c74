"""mount(2) and umount2(2) through libc.

util-linux ``mount`` turns a file source into a loop device; EROFS file-backed
mounts need the syscall itself: source = the meta image file, ``device=`` the
blob file. Layer and sandbox mounts are ``nosuid,nodev`` (:data:`SAFE_FLAGS`):
a layer may ship setuid-root programs and device nodes, and neither may work.

Overlays are mounted with the new mount API (:func:`mount_overlay`:
``fsopen``, one ``fsconfig`` per option and per lower layer, ``fsmount``,
``move_mount``), so that the number of layers is not bounded by the page that
mount(2)'s option string must fit in; only the kernel's own limit of
:data:`MAX_LOWER_LAYERS` lowers remains. A kernel without the API (ENOSYS), or
whose overlayfs lacks ``lowerdir+`` (6.5 to 6.7), gets mount(2) with the option
string, as long as it fits a page.

What is mounted where is read from ``/proc/self/mountinfo`` by
:func:`mount_table` alone; :func:`mounts_under` and :func:`fs_type` answer from it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
SAFE_FLAGS = MS_NOSUID | MS_NODEV  # on every mount of layer content
MNT_DETACH = 2
MAX_LOWER_LAYERS = 500  # overlayfs's OVL_MAX_STACK: lower layers one overlay may have
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")  # mount(2) copies this much of its data (NUL included)
BDI = "/sys/class/bdi"
_bdi_lock = threading.Lock()  # one EROFS mount at a time while its bdi is found

log = logging.getLogger(__name__)
_readahead_warned = False  # one warning per process

MOUNTINFO = "/proc/self/mountinfo"
FUSECTL = "/sys/fs/fuse/connections"  # fusectl: each FUSE connection's settings
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


# the new mount API (linux/mount.h); these syscall numbers are the same on every
# architecture but alpha (the table was unified before they were added)
SYS_MOVE_MOUNT, SYS_FSOPEN, SYS_FSCONFIG, SYS_FSMOUNT = 429, 430, 431, 432
FSOPEN_CLOEXEC = FSMOUNT_CLOEXEC = 1
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_CREATE = 6
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 1, 2, 4
MOVE_MOUNT_F_EMPTY_PATH = 4
AT_FDCWD = -100
_MS_TO_ATTR = ((MS_RDONLY, MOUNT_ATTR_RDONLY), (MS_NOSUID, MOUNT_ATTR_NOSUID),
               (MS_NODEV, MOUNT_ATTR_NODEV))
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


@dataclass(frozen=True)
class Overlay:
    """An overlayfs mount: its lower directories top first, and its writable
    ``upper``/``work`` (both or neither); ``options`` are further
    ``key=value`` options, in order."""

    lowers: list[str]
    upper: str = ""
    work: str = ""
    options: tuple[tuple[str, str], ...] = ()

    def settings(self) -> list[tuple[str, str]]:
        """The fsconfig string settings that make this overlay, in order."""
        out = [("source", "overlay")]
        out += [("lowerdir+", lower) for lower in self.lowers]
        if self.upper:
            out += [("upperdir", self.upper), ("workdir", self.work)]
        return out + list(self.options)

    def option_string(self) -> str:
        """mount(2)'s data for this overlay (bounded by one page)."""
        parts = ["lowerdir=" + ":".join(self.lowers)]
        if self.upper:
            parts += [f"upperdir={self.upper}", f"workdir={self.work}"]
        return ",".join(parts + [f"{key}={value}" for key, value in self.options])


class _OldKernel(Exception):
    """The kernel lacks the new mount API (ENOSYS) or overlayfs's ``lowerdir+``."""

    def __init__(self, err: int, why: str) -> None:
        super().__init__(err, why)
        self.errno = err
        self.why = why


def mount_overlay(overlay: Overlay, target: str, flags: int = SAFE_FLAGS) -> None:
    """Mount ``overlay`` on ``target`` with the mount flags ``flags`` (MS_*)
    through the new mount API, or with mount(2) where the kernel lacks it
    (``fsopen``: ENOSYS) or lacks overlayfs's ``lowerdir+`` (Linux 6.5 to 6.7:
    the first one is EINVAL), if the option string fits mount(2)'s page. A
    refusal is an OSError that carries the kernel's own words."""
    try:
        _mount_overlay_api(overlay, target, flags)
        return
    except _OldKernel as old:
        data = overlay.option_string()
        if len(os.fsencode(data)) >= PAGE_SIZE:
            raise OSError(old.errno, f"mount overlay on {target}: {old.why}, and the options "
                                     f"of its {len(overlay.lowers)} lower directories do not "
                                     f"fit mount(2)'s {PAGE_SIZE} bytes") from None
    mount("overlay", target, "overlay", flags, data)


def _mount_overlay_api(overlay: Overlay, target: str, flags: int) -> None:
    fs = _syscall(SYS_FSOPEN, b"overlay", ctypes.c_uint(FSOPEN_CLOEXEC))
    if fs < 0:
        err = ctypes.get_errno()
        if err == errno.ENOSYS:
            raise _OldKernel(err, "no new mount API")
        raise OSError(err, f"fsopen overlay for {target}: {os.strerror(err)}")
    try:
        first_lower = True
        for key, value in overlay.settings():
            try:
                _fs_call(fs, target, f"{key} {value}", SYS_FSCONFIG, ctypes.c_int(fs),
                         ctypes.c_uint(FSCONFIG_SET_STRING), key.encode(),
                         os.fsencode(value), ctypes.c_int(0))
            except OSError as exc:
                if key == "lowerdir+" and first_lower and exc.errno == errno.EINVAL:
                    raise _OldKernel(exc.errno, "no lowerdir+ in overlayfs") from None
                raise
            first_lower = first_lower and key != "lowerdir+"
        _fs_call(fs, target, "create", SYS_FSCONFIG, ctypes.c_int(fs),
                 ctypes.c_uint(FSCONFIG_CMD_CREATE), None, None, ctypes.c_int(0))
        attrs = sum(attr for flag, attr in _MS_TO_ATTR if flags & flag)
        mnt = _fs_call(fs, target, "fsmount", SYS_FSMOUNT, ctypes.c_int(fs),
                       ctypes.c_uint(FSMOUNT_CLOEXEC), ctypes.c_uint(attrs))
    finally:
        os.close(fs)
    try:
        _fs_call(-1, target, "move_mount", SYS_MOVE_MOUNT, ctypes.c_int(mnt), b"",
                 ctypes.c_int(AT_FDCWD), os.fsencode(target),
                 ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH))
    finally:
        os.close(mnt)


def _fs_call(fs: int, target: str, step: str, *args: object) -> int:
    """syscall(*args); on failure an OSError naming the step and, from the fs
    context ``fs`` (-1: none), the kernel's messages."""
    rc = _syscall(*args)
    if rc >= 0:
        return rc
    err = ctypes.get_errno()
    said = "; ".join(kernel_messages(fs)) if fs >= 0 else ""
    raise OSError(err, f"mount overlay on {target}: {step}: {os.strerror(err)}"
                       + (f" ({said})" if said else ""))


def kernel_messages(fs: int) -> list[str]:
    """The messages the kernel left in the fs context ``fs`` (``e overlay: ...``
    lines: e error, w warning, i info), oldest first; reading takes them."""
    out: list[str] = []
    while len(out) < 16:
        try:
            line = os.read(fs, 1024)
        except OSError:  # ENODATA: none left
            break
        out.append(line.decode(errors="replace").strip())
    return out


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
    """A readahead window is a tuning: where /sys cannot be written (a
    container's read-only /sys), the mount keeps the kernel's default and one
    warning says so. An entry gone already (ENOENT), or going as it is
    written (ENODEV: its device unregistered), was another process's mount,
    made and unmounted while ours was (the lock is this process's): not ours."""
    global _readahead_warned
    try:
        with open(f"{BDI}/{bdi}/read_ahead_kb", "w") as f:
            f.write(str(max(nbytes // 1024, 4)))
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno == errno.ENODEV:
            return
        if not _readahead_warned:
            _readahead_warned = True
            log.warning("cannot set the readahead window of EROFS mounts (%s): the kernel's "
                        "default is used", exc.strerror or exc)


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


def set_fuse_background(path: str, requests: int) -> None:
    """Let the FUSE connection mounted at ``path`` have ``requests``
    background requests (readahead and direct reads of the kernel's own,
    EROFS's and loop devices') in flight at once, not the kernel's default
    12: each waits for its own store read, so 12 would cap a node's misses
    however many cores and store connections it has. Set through fusectl
    (mounted on ``FUSECTL`` first if it is not); the congestion threshold
    goes to three quarters of it."""
    target = os.path.abspath(path)
    devs = [m.device for m in mount_table() if m.point == target]
    if not devs:
        raise OSError(errno.ENOENT, f"nothing mounted on {target}")
    major, minor = (int(n) for n in devs[-1].split(":"))
    conn = Path(FUSECTL) / str(major << 20 | minor)  # the kernel's own dev_t, as fusectl names it
    if not conn.is_dir() and not any(m.fstype == "fusectl" for m in mount_table()):
        mount("fusectl", FUSECTL, "fusectl", SAFE_FLAGS | MS_NOEXEC, "")
    (conn / "max_background").write_text(f"{requests}\n")
    (conn / "congestion_threshold").write_text(f"{max(1, requests * 3 // 4)}\n")


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
