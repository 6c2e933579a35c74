"""Files an export writes, by descriptor: a destination directory may be
someone else's (an existing image layout whose ``blobs/sha256`` is a symlink
to ``/etc``), so every directory on the way is opened with
``O_DIRECTORY|O_NOFOLLOW`` from its parent's descriptor and every file made
relative to one (``O_EXCL`` temporaries, ``renameat``); a symlink where the
export writes is refused, never followed.

Temporaries are named ``PREFIX.tmp-<pid>-<random>`` and their creator holds
an ``flock`` on them while it lives; :func:`remove_stale_temps` removes the ones
whose lock is free and whose pid is gone (a pid still alive may be the creator
between creating and locking, or a reused pid: left alone), so a killed export
leaves nothing behind the next export to the same place does not remove.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import shutil
import stat
import tarfile
from collections.abc import Callable
from typing import BinaryIO

from layerfs.errors import DestinationExists
from layerfs.safeopen import DIR_FLAGS

TEMP_MARK = ".tmp-"
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
PROBE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def temp_name(prefix: str) -> str:
    """``PREFIX.tmp-<pid>-<random>``: recognisable by :func:`remove_stale_temps`."""
    return f"{prefix}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(6)}"


def open_dir(parent_fd: int, name: str, where: str, create: bool = False) -> int:
    """A descriptor of the directory ``name`` in ``parent_fd`` (made when
    missing and ``create``); a symlink or a non-directory is refused."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as exc:
        raise _not_a_directory(where, name, exc) from None
    try:
        os.mkdir(name, 0o755, dir_fd=parent_fd)
    except FileExistsError:
        pass  # made meanwhile: opened below like any other
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        raise _not_a_directory(where, name, exc) from None


def _not_a_directory(where: str, name: str, exc: OSError) -> Exception:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return DestinationExists(where, f"{name} is a symlink or not a directory (refused)")
    return exc


def check_regular_or_missing(dir_fd: int, name: str, where: str) -> bool:
    """Whether ``name`` exists in ``dir_fd``; anything but a regular file is refused."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise DestinationExists(where, f"{name} is a symlink or not a regular file (refused)")
    return True


def locked(fd: int) -> int:
    """``fd`` with an exclusive flock held (while the descriptor is open)."""
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def new_temp_file(dir_fd: int, prefix: str = "") -> tuple[int, str]:
    """A new locked temporary file (mode 0644) in ``dir_fd``: its descriptor and name."""
    name = temp_name(prefix)
    fd = os.open(name, NEW_FILE_FLAGS, 0o644, dir_fd=dir_fd)
    os.fchmod(fd, 0o644)
    return locked(fd), name


def new_temp_dir(dir_fd: int, prefix: str) -> tuple[int, str]:
    """A new locked temporary directory (mode 0700) in ``dir_fd``: its descriptor and name."""
    name = temp_name(prefix)
    os.mkdir(name, 0o700, dir_fd=dir_fd)
    return locked(os.open(name, DIR_FLAGS, dir_fd=dir_fd)), name


def write_atomic(dir_fd: int, name: str, data: bytes) -> None:
    """``name`` in ``dir_fd`` replaced by ``data`` (a temporary renamed over it)."""
    fd, tmp = new_temp_file(dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        remove_quietly(dir_fd, tmp)
        raise


def remove_quietly(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(dir_fd: int, prefix: str = "") -> list[str]:
    """Remove the temporaries ``PREFIX.tmp-<pid>-<random>`` in ``dir_fd`` that
    are this user's, unlocked, and whose pid is gone; their names."""
    pattern = re.compile(re.escape(prefix + TEMP_MARK) + r"([0-9]+)-[0-9a-f]+")
    removed = []
    for name in os.listdir(dir_fd):
        match = pattern.fullmatch(name)
        if match and not _pid_alive(int(match.group(1))) and _remove_if_stale(dir_fd, name):
            removed.append(name)
    return removed


def _remove_if_stale(dir_fd: int, name: str) -> bool:
    try:
        fd = os.open(name, PROBE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return False  # gone, or a symlink: not one of ours
    try:
        st = os.fstat(fd)
        is_dir = stat.S_ISDIR(st.st_mode)
        if st.st_uid != os.geteuid() or not (is_dir or stat.S_ISREG(st.st_mode)):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its exporter is alive
        if is_dir:
            shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
        else:
            remove_quietly(dir_fd, name)
        return True
    finally:
        os.close(fd)


# -- a layout directory as a tar, read by descriptor --

def tar_directory(dir_fd: int, names: list[str], out: BinaryIO,
                  entry: Callable[[tarfile.TarInfo], tarfile.TarInfo]) -> None:
    """A PAX tar of the ``names`` in ``dir_fd`` (directories with what they
    hold, sorted), each entry passed through ``entry``; symlinks are refused."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            _add(tar, dir_fd, name, name, entry)


def _add(tar: tarfile.TarFile, dir_fd: int, name: str, arcname: str,
         entry: Callable[[tarfile.TarInfo], tarfile.TarInfo]) -> None:
    fd = os.open(name, PROBE_FLAGS, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        info = tarfile.TarInfo(arcname)
        info.mtime = int(st.st_mtime)
        if stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
            tar.addfile(entry(info))
            for child in sorted(os.listdir(fd)):
                _add(tar, fd, child, f"{arcname}/{child}", entry)
            return
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", arcname)
        info.size = st.st_size
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        with os.fdopen(os.dup(fd), "rb") as f:
            tar.addfile(entry(info), f)
    finally:
        os.close(fd)
