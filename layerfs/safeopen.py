"""Opening paths under a directory that may be hostile: ``openat2(2)``
(through ctypes: Python has no binding) from a descriptor of the directory,
with the ``RESOLVE_*`` flags that keep the walk where it belongs
(``RESOLVE_IN_ROOT``: symlinks resolve inside; ``RESOLVE_BENEATH`` with
``RESOLVE_NO_SYMLINKS``: no symlink anywhere on the way, no escape by ``..``),
and :func:`open_regular` (beneath a directory) and :func:`open_regular_path`,
which open a file that must be a regular one without blocking on a FIFO
(:func:`open_regular` looks first through an ``O_PATH`` descriptor, so a
device node or a FIFO is never opened at all), and :func:`open_dir`, a
directory beneath a directory with no symlink on the way.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat

SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # a directory, not a link
PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC  # a look at what is there, opening nothing
STRICT = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS

_libc = ctypes.CDLL(None, use_errno=True)  # libc, already loaded: no `ldconfig -p` run


class OpenHow(ctypes.Structure):
    """``struct open_how`` of openat2(2)."""

    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    """``openat2(dir_fd, path, {flags, mode, resolve})``: a descriptor, or
    OSError. Where the call is missing (ENOSYS: an older kernel, or a seccomp
    filter that does not know it, such as systemd-nspawn's), the strict walk
    (``STRICT``) is done name by name instead (:func:`walk_strict`)."""
    number = SYS_OPENAT2.get(os.uname().machine)
    if number is None:
        err = errno.ENOSYS
    else:
        how = OpenHow(flags=flags, mode=mode, resolve=resolve)
        fd = _libc.syscall(number, dir_fd, os.fsencode(path), ctypes.byref(how),
                           ctypes.sizeof(how))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
    if err == errno.ENOSYS and resolve == STRICT:
        return walk_strict(dir_fd, path, flags, mode)
    raise OSError(err, os.strerror(err), path)


def walk_strict(dir_fd: int, path: str, flags: int, mode: int = 0) -> int:
    """What ``openat2`` with ``STRICT`` opens, name by name: each directory on
    the way opened ``O_NOFOLLOW | O_DIRECTORY`` from the one before (a symlink
    there: ENOTDIR), the last name ``O_NOFOLLOW`` (a symlink: ELOOP, or with
    ``O_PATH`` the link itself, as openat2 gives it), no absolute path and no
    ``..`` (EXDEV)."""
    names = [n for n in path.split("/") if n not in ("", ".")]
    if path.startswith("/") or ".." in names:
        raise OSError(errno.EXDEV, "the path leaves the directory", path)
    if not names:
        return os.open(".", flags, mode, dir_fd=dir_fd)
    opened: list[int] = []
    try:
        at = dir_fd
        for name in names[:-1]:
            at = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC,
                         dir_fd=at)
            opened.append(at)
        return os.open(names[-1], flags | os.O_NOFOLLOW, mode, dir_fd=at)
    finally:
        for each in opened:
            os.close(each)


class NotRegular(OSError):
    """The path names something other than a regular file (``mode``: what it is)."""

    mode = 0


def not_regular(mode: int, path: str) -> NotRegular:
    """The :class:`NotRegular` error of ``path``, whose fstat mode is ``mode``."""
    exc = NotRegular(errno.EINVAL, f"not a regular file ({describe_mode(mode)})", path)
    exc.mode = mode
    return exc


def lookup(dir_fd: int, path: str) -> os.stat_result:
    """What ``path`` beneath ``dir_fd`` is (no symlink on the way, none
    followed at the end), seen through an ``O_PATH`` descriptor: nothing is
    opened, so a FIFO or a device node costs nothing and blocks nothing."""
    fd = openat2(dir_fd, path, PATH_FLAGS, STRICT)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def open_regular(dir_fd: int, path: str) -> int:
    """A blocking read-only descriptor of the regular file ``path`` beneath
    ``dir_fd``, no symlink on the way (ELOOP/EXDEV otherwise). Looked at first
    through ``O_PATH`` (:func:`lookup`: a FIFO or a device is refused without
    being opened), then opened with ``O_NONBLOCK`` (a FIFO swapped in between
    does not hang the open), checked again with fstat (:class:`NotRegular`)
    and switched back to blocking reads."""
    mode = lookup(dir_fd, path).st_mode
    if not stat.S_ISREG(mode):
        raise not_regular(mode, path)
    return _regular(openat2(dir_fd, path, READ_FLAGS, STRICT), path)


def open_dir(dir_fd: int, path: str) -> int:
    """A read-only descriptor of the directory ``path`` beneath ``dir_fd``
    (``""`` or ``"."``: ``dir_fd`` itself, duplicated), no symlink on the way;
    ENOTDIR if it is something else (a FIFO there is not opened)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC
    return openat2(dir_fd, path or ".", flags, STRICT)  # a symlink: ELOOP (O_NOFOLLOW: ENOTDIR)


def open_regular_path(path: str) -> int:
    """A blocking read-only descriptor of the regular file ``path`` (a path the
    user gave: symlinks are followed), opened without blocking on a FIFO."""
    return _regular(os.open(path, READ_FLAGS), path)


def _regular(fd: int, path: str) -> int:
    """``fd`` if it is a regular file, switched to blocking reads; else closed
    and :class:`NotRegular`."""
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(mode, path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def describe_mode(mode: int) -> str:
    """What kind of file ``mode`` is, in a word or two."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "an unknown kind of file"


def open_error(exc: OSError) -> str:
    """A short reason for a failed strict open: a symlink or an escape is named as such."""
    if exc.errno in (errno.ELOOP, errno.EXDEV):
        return "a symlink or a path leaving the directory (refused)"
    if isinstance(exc, NotRegular):
        return exc.strerror or "not a regular file"
    return (exc.strerror or str(exc)).lower()
