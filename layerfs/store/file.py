"""The file store: objects as files under a root directory (``file:///path``).

Also what runs on shared POSIX file systems (3FS, NFS). Writes are atomic: the
bytes go to a temporary file in the target directory (named ``.tmp~<random>``,
never listed as an object), are fsynced, and are renamed (``put``) or
hard-linked (``put_if_absent``) into place, after which the directory is
fsynced. A writer killed mid-way leaves its temporary file behind:
``list_temporaries`` finds those for gc. ``refresh`` is ``utime(2)``.

Errors: ENOENT on a read is a missing object, EACCES/EPERM/EROFS access
denied, EIO/EAGAIN/ESTALE an unavailable object (retried), and the errors of a
network mount that lost its server (ETIMEDOUT, ENOTCONN, ...) an unreachable
store (retried). A write that does not return within the store's timeout
(a hung mount) is left blocked in its thread and fails as an unreachable store.

A root directory that does not exist is a new store to a writer (its first
write creates it), but to a store opened with ``must_exist`` (the node
daemon, the commands that only read) it is an unreachable store, for every
call: a store directory moved away, deleted or not mounted is not an empty
store, and nothing is written at its old place.

A shared file system may not keep the promises of ``link(2)`` and
``rename(2)`` between its clients (two clients both "create" a key, a reader
sees a torn file), so every write reads the object back and compares:
``put_if_absent`` wins only if the key holds its bytes afterwards, and a
``put`` whose read-back differs is a transient error (retried). A blob is
named by its digest and verified by every reader, so its read-back compares
only the size. ``layerfs store
check`` (layerfs/store/check.py) runs the races that show whether a mount is
safe to share.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ..errors import (
    AccessDenied,
    NoAnswerInTime,
    ObjectUnavailable,
    StoreError,
    StoreUnreachable,
    TransientStoreError,
    UsageError,
)
from .base import BLOB_PREFIX, TEMP_MARK, ObjectInfo, RetryPolicy, Store, check_key, check_prefix

DENIED = {errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
          errno.EROFS: "read-only file system"}  # fmt: skip
UNAVAILABLE = {errno.EIO, errno.EAGAIN, errno.EINTR, errno.ESTALE, errno.EBUSY}
UNREACHABLE = {errno.ETIMEDOUT, errno.ENOTCONN, errno.EHOSTDOWN, errno.EHOSTUNREACH,
               errno.ECONNREFUSED, errno.ECONNABORTED, errno.ECONNRESET}  # a network mount
NOT_AN_OBJECT = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR}
FILE_MODE = 0o644


def path_from_url(url: str) -> Path:
    """``file:///a/b`` (or ``file://localhost/a/b``) → ``/a/b``."""
    parts = urlsplit(url)
    if parts.scheme != "file" or parts.netloc not in ("", "localhost"):
        raise UsageError(f"not a local file URL: {url!r} (expected file:///absolute/path)")
    if not parts.path.startswith("/"):
        raise UsageError(f"file store URL needs an absolute path: {url!r}")
    return Path(unquote(parts.path))


def _describe(exc: OSError) -> str:
    code = exc.errno or 0
    text = DENIED.get(code) or (os.strerror(code) if code else str(exc))
    return text[:1].lower() + text[1:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _read_back(path: Path) -> bytes:
    """What a reader sees at ``path`` now."""
    with open(path, "rb", buffering=0) as f:
        return f.read()


def _holds(path: Path, data: bytes | memoryview, whole: bool) -> bool:
    """Whether ``path`` holds ``data`` now (``whole``: its bytes, else its size)."""
    if whole:
        return _read_back(path) == data
    return os.stat(path).st_size == memoryview(data).nbytes


class FileStore(Store):
    """A store in a local or shared POSIX directory; thread and process safe."""

    def __init__(self, root: str | os.PathLike[str], retry: RetryPolicy | None = None,
                 must_exist: bool = False) -> None:
        self.root = Path(os.path.abspath(root))
        self.url = "file://" + str(self.root)
        self.must_exist = must_exist  # a missing root is unreachable, not a new store
        if retry is not None:
            self.retry = retry

    @classmethod
    def from_url(cls, url: str, retry: RetryPolicy | None = None,
                 must_exist: bool = False) -> FileStore:
        return cls(path_from_url(url), retry, must_exist)

    def _check_root(self) -> None:
        """StoreUnreachable if the store must exist and its root directory does not."""
        if self.must_exist and not os.path.isdir(self.root):
            raise StoreUnreachable(f"{self.root} does not exist or is not a directory "
                                   "(moved, deleted or not mounted)")

    def __repr__(self) -> str:
        return f"FileStore({str(self.root)!r})"

    # -- errors --
    def _error(self, exc: OSError, key: str, action: str, reading: bool) -> StoreError:
        """Map an OSError met while doing ``action`` on ``key`` to a store error."""
        code = exc.errno
        if reading and code in NOT_AN_OBJECT:
            self._check_root()
            return self.missing(key)
        where = str(self.root / key)
        detail = _describe(exc)
        culprit = str(exc.filename or where)
        if culprit != where and TEMP_MARK not in culprit:
            detail = f"{culprit}: {detail}"
        message = f"cannot {action} {where}: {detail}"
        if code in DENIED:
            return AccessDenied(message)
        if code in UNAVAILABLE:
            return ObjectUnavailable(message)
        if code in UNREACHABLE:
            return StoreUnreachable(message)
        return StoreError(message)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    # -- reads --
    def _get(self, key: str, start: int | None, end: int | None) -> bytes:
        path = self._path(key)
        first = start or 0
        if first < 0 or (end is not None and end < 0):
            raise ValueError(f"bad range [{start}, {end}) for {key}")
        try:
            with open(path, "rb", buffering=0) as f:
                if end is None:
                    f.seek(first)
                    return f.read()
                return os.pread(f.fileno(), max(0, end - first), first)
        except OSError as exc:
            raise self._error(exc, key, "read", reading=True) from exc

    def _head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        try:
            st = os.stat(path)
        except OSError as exc:
            if exc.errno in NOT_AN_OBJECT:
                self._check_root()
                return None
            raise self._error(exc, key, "stat", reading=True) from exc
        if not stat.S_ISREG(st.st_mode):
            return None
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        self._check_root()
        folder, _, start = prefix.rpartition("/")
        base = self.root / folder if folder else self.root
        try:
            yield from self._walk(base, folder + "/" if folder else "", start)
        except OSError as exc:
            raise self._error(exc, prefix, "list", reading=False) from exc

    def _walk(self, directory: Path, key_prefix: str, start: str) -> Iterator[ObjectInfo]:
        """Objects under ``directory`` whose first name component starts with ``start``."""
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            if not entry.name.startswith(start) or entry.name.startswith(TEMP_MARK):
                continue
            key = key_prefix + entry.name
            if entry.is_dir(follow_symlinks=False):
                yield from self._walk(Path(entry.path), key + "/", "")
            elif entry.is_file():
                info = self._entry_info(entry, key)
                if info is not None:
                    yield info

    @staticmethod
    def _entry_info(entry: os.DirEntry[str], key: str) -> ObjectInfo | None:
        try:
            st = entry.stat()
        except FileNotFoundError:  # deleted while we listed
            return None
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def _temporaries(self) -> Iterator[ObjectInfo]:
        self._check_root()
        try:
            yield from self._walk_temporaries(self.root, "")
        except OSError as exc:
            raise self._error(exc, "", "list temporary files in", reading=False) from exc

    def _walk_temporaries(self, directory: Path, key_prefix: str) -> Iterator[ObjectInfo]:
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            key = key_prefix + entry.name
            if entry.name.startswith(TEMP_MARK):
                if entry.is_file(follow_symlinks=False):
                    info = self._entry_info(entry, key)
                    if info is not None:
                        yield info
            elif entry.is_dir(follow_symlinks=False):
                yield from self._walk_temporaries(Path(entry.path), key + "/")

    def _temporary_path(self, key: str) -> Path:
        folder, _, name = key.rpartition("/")
        if not name.startswith(TEMP_MARK) or "\0" in name:
            raise ValueError(f"not a temporary file key: {key!r}")
        return (self.root / check_key(folder) if folder else self.root) / name

    def _delete_temporary(self, key: str) -> None:
        try:
            self._temporary_path(key).unlink()
        except OSError as exc:
            if exc.errno in NOT_AN_OBJECT:
                return
            raise self._error(exc, key, "delete", reading=False) from exc

    # -- writes (each bounded by the store's timeout: Store._bounded) --
    def _no_answer(self, what: str, timeout: float) -> NoAnswerInTime:
        return NoAnswerInTime(f"cannot {what}: no answer from the file system at {self.root}"
                              f" in time ({timeout:g}s without progress)")

    def _refresh(self, key: str) -> bool:
        path = self._path(key)
        try:
            os.utime(path)
        except OSError as exc:
            if exc.errno in NOT_AN_OBJECT:
                self._check_root()
                return False
            raise self._error(exc, key, "refresh", reading=False) from exc
        return True

    def _put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        try:
            self._make_dirs(path.parent)
            temp = self._write_temp(path.parent, data)
            try:
                os.replace(temp, path)
            except BaseException:
                temp.unlink(missing_ok=True)
                raise
            _fsync_dir(path.parent)
            same = _holds(path, data, whole=not key.startswith(BLOB_PREFIX))
        except OSError as exc:
            raise self._error(exc, key, "write", reading=False) from exc
        if not same:
            raise TransientStoreError(f"wrote {path} but read back other bytes"
                                      " (a concurrent writer, or a torn write on a shared"
                                      " file system)")

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        """Hard-link a temporary file to the key; True only if the key then
        holds ``data`` (a shared file system whose ``link(2)`` let another
        client's create win too shows here as other bytes, and this call lost)."""
        path = self._path(key)
        try:
            if path.exists():  # a client whose link(2) ignores other clients' files
                return False
            self._make_dirs(path.parent)
            temp = self._write_temp(path.parent, data)
            try:
                os.link(temp, path)
            except FileExistsError:
                return False
            finally:
                temp.unlink(missing_ok=True)
            _fsync_dir(path.parent)
            return _read_back(path) == data
        except OSError as exc:
            raise self._error(exc, key, "write", reading=False) from exc

    def _delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except OSError as exc:
            if exc.errno in NOT_AN_OBJECT:
                return
            raise self._error(exc, key, "delete", reading=False) from exc

    def _write_temp(self, directory: Path, data: bytes | memoryview) -> Path:
        """A new fsynced file in ``directory`` holding ``data``."""
        temp = directory / f"{TEMP_MARK}{secrets.token_hex(8)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return temp

    def _make_dirs(self, directory: Path) -> None:
        """Create ``directory`` and missing parents, fsyncing each new entry's parent;
        the root only if the store need not exist."""
        if directory.is_dir():
            return
        self._check_root()
        missing: list[Path] = []
        while not directory.exists():
            missing.append(directory)
            if directory.parent == directory:
                break
            directory = directory.parent
        for new in reversed(missing):
            try:
                new.mkdir()
            except FileExistsError:
                if not new.is_dir():
                    raise
                continue
            _fsync_dir(new.parent)
