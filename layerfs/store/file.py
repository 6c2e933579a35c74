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

Whoever can write the store is not trusted by its readers: below the root
directory (the operator's path, followed) every object, folder and temporary
file is reached through descriptors, by ``openat2(2)`` with no symlink on the
way (layerfs/safeopen.py) or ``O_NOFOLLOW`` per name, never by a path the
kernel resolves again. A read looks at its key through an ``O_PATH``
descriptor first and opens only a regular file, without blocking: a symlink
(at the key or on the way), a FIFO, a device or a socket is an integrity error
naming only its kind, a directory a missing object; neither is listed,
``head`` says there is no object and ``refresh`` makes none young (a put
then replaces it). Writes create folders with ``mkdirat`` and refuse a
symlinked one, so a planted link never steers a root writer out of the store.

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
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ..errors import (
    AccessDenied,
    IntegrityError,
    NoAnswerInTime,
    ObjectUnavailable,
    StoreError,
    StoreUnreachable,
    TransientStoreError,
    UsageError,
)
from ..safeopen import DIR_FLAGS, NotRegular, lookup, open_dir, open_error, open_regular
from .base import BLOB_PREFIX, TEMP_MARK, ObjectInfo, RetryPolicy, Store, check_key

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
    if exc.errno in (errno.ELOOP, errno.EXDEV) or isinstance(exc, NotRegular):
        return open_error(exc)
    code = exc.errno or 0
    text = DENIED.get(code) or (os.strerror(code) if code else str(exc))
    return text[:1].lower() + text[1:]


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _read_back(dir_fd: int, name: str) -> bytes:
    """What a reader sees at ``name`` in ``dir_fd`` now (a regular file, no symlink)."""
    with open(open_regular(dir_fd, name), "rb", buffering=0) as f:
        return f.read()


def _holds(dir_fd: int, name: str, data: bytes | memoryview, whole: bool) -> bool:
    """Whether ``name`` in ``dir_fd`` holds ``data`` now (``whole``: its bytes, else its size)."""
    if whole:
        return _read_back(dir_fd, name) == data
    return lookup(dir_fd, name).st_size == memoryview(data).nbytes


def _split(key: str) -> tuple[str, str]:
    """A key's folder (``""`` at the top) and last name."""
    folder, _, name = key.rpartition("/")
    return folder, name


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
        where = str(self.root / key) if key else str(self.root)
        detail = _describe(exc)
        culprit = str(exc.filename or where)
        if culprit.startswith("/") and culprit != where and TEMP_MARK not in culprit:
            detail = f"{culprit}: {detail}"
        message = f"cannot {action} {where}: {detail}"
        if code in DENIED:
            return AccessDenied(message)
        if code in UNAVAILABLE:
            return ObjectUnavailable(message)
        if code in UNREACHABLE:
            return StoreUnreachable(message)
        return StoreError(message)

    def _hostile(self, exc: OSError, key: str) -> StoreError | IntegrityError:
        """The error of a read that met something other than an object: a
        symlink (at the key or on the way), a FIFO, a device or a socket is
        corrupt (one line, naming only its kind), a directory a missing object."""
        if isinstance(exc, NotRegular) and stat.S_ISDIR(exc.mode):
            self._check_root()
            return self.missing(key)
        if isinstance(exc, NotRegular) or exc.errno in (errno.ELOOP, errno.EXDEV):
            return IntegrityError(str(self.root / key), _describe(exc))
        return self._error(exc, key, "read", reading=True)

    # -- descriptors: the root followed (the operator's path), nothing below it --
    @contextmanager
    def _root_fd(self) -> Iterator[int]:
        """A descriptor of the root directory, for the duration of one call."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextmanager
    def _folder(self, folder: str, create: bool = False) -> Iterator[int]:
        """A descriptor of ``folder`` below the root, reached without following a
        symlink (ELOOP) or leaving the root; ``create``: made first where missing."""
        if create:
            self._make_root()
        with self._root_fd() as root:
            fd = self._make_dirs(root, folder) if create else open_dir(root, folder)
        try:
            yield fd
        finally:
            os.close(fd)

    # -- reads --
    def _get(self, key: str, start: int | None, end: int | None) -> bytes:
        first = start or 0
        if first < 0 or (end is not None and end < 0):
            raise ValueError(f"bad range [{start}, {end}) for {key}")
        try:
            with self._root_fd() as root:
                fd = open_regular(root, key)
            with open(fd, "rb", buffering=0) as f:
                if end is None:
                    f.seek(first)
                    return f.read()
                return os.pread(f.fileno(), max(0, end - first), first)
        except OSError as exc:
            raise self._hostile(exc, key) from exc

    def _head(self, key: str) -> ObjectInfo | None:
        try:
            with self._root_fd() as root:
                st = lookup(root, key)
        except OSError as exc:
            if exc.errno in NOT_AN_OBJECT or exc.errno in (errno.ELOOP, errno.EXDEV):
                self._check_root()
                return None  # nothing, or a symlink on the way: no object
            raise self._error(exc, key, "stat", reading=True) from exc
        if not stat.S_ISREG(st.st_mode):
            return None  # a symlink, a directory, a FIFO, a device: no object
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        self._check_root()
        folder, start = _split(prefix)
        try:
            with self._folder(folder) as fd:
                yield from self._walk(fd, folder + "/" if folder else "", start, temps=False)
        except (FileNotFoundError, NotADirectoryError):
            self._check_root()
            return
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EXDEV):
                raise IntegrityError(str(self.root / folder), _describe(exc)) from exc
            raise self._error(exc, prefix, "list", reading=False) from exc

    def _walk(self, dir_fd: int, key_prefix: str, start: str, temps: bool) -> Iterator[ObjectInfo]:
        """Regular files under ``dir_fd`` whose first name component starts with
        ``start``: the objects, or (``temps``) the temporary files. Symlinks are
        neither listed nor followed, subdirectories opened with ``O_NOFOLLOW``."""
        with os.scandir(dir_fd) as it:
            entries = list(it)
        for entry in entries:
            if not entry.name.startswith(start):
                continue
            key = key_prefix + entry.name
            temp = entry.name.startswith(TEMP_MARK)
            if entry.is_dir(follow_symlinks=False) and not temp:
                try:
                    sub = os.open(entry.name, DIR_FLAGS | os.O_NONBLOCK, dir_fd=dir_fd)
                except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                    continue  # gone, or swapped, while we listed
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        continue  # swapped for a symlink: not followed
                    raise
                try:
                    yield from self._walk(sub, key + "/", "", temps)
                finally:
                    os.close(sub)
            elif temp == temps and entry.is_file(follow_symlinks=False):
                info = self._entry_info(entry, key)
                if info is not None:
                    yield info

    @staticmethod
    def _entry_info(entry: os.DirEntry[str], key: str) -> ObjectInfo | None:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # deleted while we listed
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def _temporaries(self) -> Iterator[ObjectInfo]:
        self._check_root()
        try:
            with self._folder("") as fd:
                yield from self._walk(fd, "", "", temps=True)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._error(exc, "", "list temporary files in", reading=False) from exc

    def _temporary_key(self, key: str) -> tuple[str, str]:
        folder, name = _split(key)
        if not name.startswith(TEMP_MARK) or "\0" in name:
            raise ValueError(f"not a temporary file key: {key!r}")
        if folder:
            check_key(folder)
        return folder, name

    def _delete_temporary(self, key: str) -> None:
        folder, name = self._temporary_key(key)
        self._unlink(folder, name, key)

    def _unlink(self, folder: str, name: str, key: str) -> None:
        """Remove ``name`` from ``folder`` (a symlink there is removed, not followed);
        nothing to remove, or a symlink on the way, is not an error."""
        try:
            with self._folder(folder) as fd:
                os.unlink(name, dir_fd=fd)
        except OSError as exc:
            if exc.errno in NOT_AN_OBJECT or exc.errno in (errno.ELOOP, errno.EXDEV):
                return
            raise self._error(exc, key, "delete", reading=False) from exc

    # -- writes (each bounded by the store's timeout: Store._bounded) --
    def _no_answer(self, what: str, timeout: float) -> NoAnswerInTime:
        return NoAnswerInTime(f"cannot {what}: no answer from the file system at {self.root}"
                              f" in time ({timeout:g}s without progress)")

    def _refresh(self, key: str) -> bool:
        """``utime`` of a regular file at ``key`` (never of a symlink's target);
        False if there is none (a symlink or a FIFO there is no object: a put
        replaces it)."""
        folder, name = _split(key)
        try:
            with self._folder(folder) as fd:
                if not stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    return False
                os.utime(name, dir_fd=fd, follow_symlinks=False)
        except OSError as exc:
            if exc.errno in NOT_AN_OBJECT or exc.errno in (errno.ELOOP, errno.EXDEV):
                self._check_root()
                return False
            raise self._error(exc, key, "refresh", reading=False) from exc
        return True

    def _put(self, key: str, data: bytes | memoryview) -> None:
        folder, name = _split(key)
        try:
            with self._folder(folder, create=True) as fd:
                temp = self._write_temp(fd, data)
                try:
                    os.replace(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
                except BaseException:
                    _unlink_quietly(fd, temp)
                    raise
                os.fsync(fd)
                same = _holds(fd, name, data, whole=not key.startswith(BLOB_PREFIX))
        except OSError as exc:
            raise self._error(exc, key, "write", reading=False) from exc
        if not same:
            raise TransientStoreError(f"wrote {self.root / key} but read back other bytes"
                                      " (a concurrent writer, or a torn write on a shared"
                                      " file system)")

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        """Hard-link a temporary file to the key; True only if the key then
        holds ``data`` (a shared file system whose ``link(2)`` let another
        client's create win too shows here as other bytes, and this call lost).
        Anything at the key (a symlink too) is there already: this call lost."""
        folder, name = _split(key)
        try:
            with self._folder(folder, create=True) as fd:
                if _entry_exists(fd, name):  # a client whose link(2) ignores others' files
                    return False
                temp = self._write_temp(fd, data)
                try:
                    os.link(temp, name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    return False
                finally:
                    _unlink_quietly(fd, temp)
                os.fsync(fd)
                return _read_back(fd, name) == data
        except OSError as exc:
            raise self._error(exc, key, "write", reading=False) from exc

    def _delete(self, key: str) -> None:
        folder, name = _split(key)
        self._unlink(folder, name, key)

    @staticmethod
    def _write_temp(dir_fd: int, data: bytes | memoryview) -> str:
        """The name of a new fsynced file in ``dir_fd`` holding ``data``."""
        temp = f"{TEMP_MARK}{secrets.token_hex(8)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temp, flags, FILE_MODE, dir_fd=dir_fd)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(dir_fd, temp)
            raise
        os.close(fd)
        return temp

    def _make_root(self) -> None:
        """Create the root directory and missing parents (the operator's path),
        fsyncing each new entry's parent; only if the store need not exist."""
        directory = self.root
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
            _fsync_path(new.parent)

    @staticmethod
    def _make_dirs(root: int, folder: str) -> int:
        """A descriptor of ``folder`` below ``root``, each missing component
        created (and its parent fsynced), none followed if it is a symlink."""
        fd = os.dup(root)
        try:
            for part in folder.split("/") if folder else ():
                try:
                    os.mkdir(part, dir_fd=fd)
                    os.fsync(fd)
                except FileExistsError:
                    pass
                sub = open_dir(fd, part)  # ELOOP if a symlink
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        return fd


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _entry_exists(dir_fd: int, name: str) -> bool:
    """Whether ``dir_fd`` has an entry ``name`` (of any kind, symlinks not followed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _unlink_quietly(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
