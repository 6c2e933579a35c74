"""The FUSE adapter: ``ROOT/fuse`` with ``blobs/<layer hex>`` read-only files,
``disks/<id>`` read-write writable disks and ``pmem/<name>`` the blobs padded
for a VMM to map (:mod:`.vms.pmem`).

Thin: every operation maps to :class:`~layerfs.node.reads.blobfiles.BlobDirectory`,
:class:`~layerfs.node.reads.blobfiles.BlobFile`,
:class:`~layerfs.node.vms.disks.DiskManager` and
:class:`~layerfs.node.vms.diskfiles.WritableDisk`. :func:`fuse_errors` turns every
exception into an errno, since pyfuse3 lets any other exception end its main
loop. Blob contents are immutable, so entries and attributes get long
timeouts and opened files keep the kernel's page cache.

Who may open what: only root, and the members of the configured FUSE group
(``layerfs daemon --fuse-group``, for a VMM user; none by default). Every
file and directory is root's, with that group (or root's): directories 0550,
blobs 0440, disks 0660. The mount has ``default_permissions``, so the kernel
checks these modes against the caller's full credentials on every path walk
and open (cached entries included); ``open`` and ``opendir`` check the caller
again here (:meth:`NodeFS.check_caller`). The kernel's EROFS mounts and loop
devices open their blob or disk as root (the daemon's mount call, ``losetup``)
and read through that open file, so no read or write is checked again.

After a live restart the kernel still holds the inodes and open files (fh =
inode) the earlier daemon gave out, and queues its unanswered requests
again: a request for an inode not known yet waits until the daemon has
restored its blobs and disks (:attr:`NodeFS.restored`) instead of failing.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pyfuse3
import trio

from ...errors import LayerfsError
from ..reads.blobfiles import BlobDirectory, Buffer
from ..vms.disks import DiskManager
from ..vms.pmem import PmemDirectory

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

ROOT = pyfuse3.ROOT_INODE
BLOBS = 2
DISKS = 3
PMEM = 4
DIRS = {ROOT: {b"blobs": BLOBS, b"disks": DISKS, b"pmem": PMEM}, BLOBS: {}, DISKS: {}, PMEM: {}}
TIMEOUT = 3600.0
ROOT_UID = 0
DIR_MODE = 0o550
BLOB_MODE = 0o440
DISK_MODE = 0o660


def first_leaf(group: BaseExceptionGroup) -> BaseException:
    """The first exception of a (nested) group that is not itself a group."""
    first = group.exceptions[0]
    return first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def fuse_errors(fn: F) -> F:
    """Map any exception a handler raises to a FUSEError (EIO unless known)."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kw: Any) -> Any:
        try:
            return await fn(*args, **kw)
        except pyfuse3.FUSEError:
            raise
        except LayerfsError as exc:
            log.error("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None
        except OSError as exc:
            log.error("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except ExceptionGroup as group:  # concurrent parts of one read that all failed
            known, other = group.split(LayerfsError)
            if known is None or other is not None:
                log.exception("%s failed", fn.__name__)
            else:
                log.error("%s: %s", fn.__name__, first_leaf(known))
            raise pyfuse3.FUSEError(errno.EIO) from None
        except Exception:
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper  # type: ignore[return-value]


class NodeFS(pyfuse3.Operations):
    """``blobs/``: the layers' lazy blob files (read-only); ``disks/``: the
    writable disks (read-write)."""

    def __init__(self, blobs: BlobDirectory, disks: DiskManager,
                 fuse_group: int | None = None, pmem: PmemDirectory | None = None) -> None:
        super().__init__()
        self.blobs = blobs
        self.disks = disks
        self.pmem = pmem or PmemDirectory()
        self.fuse_group = fuse_group  # the gid that may open files besides root
        self.gid = 0 if fuse_group is None else fuse_group
        self.restored = trio.Event()  # set once the daemon has restored blobs and disks

    async def settle(self, inode: int) -> None:
        """Until the restore is done, an unknown inode may be one an earlier
        daemon gave out (see the module docstring): wait for it."""
        if self.restored.is_set() or inode in DIRS:
            return
        if (inode not in self.disks.by_inode and inode not in self.blobs.by_inode
                and inode not in self.pmem.by_inode):
            await self.restored.wait()

    async def check_caller(self, ctx: Any) -> None:
        """EACCES unless the caller is root or in the FUSE group (its primary
        gid, else its supplementary groups, read from /proc in a thread)."""
        if ctx.uid == ROOT_UID:
            return
        if self.fuse_group is not None:
            if ctx.gid == self.fuse_group:
                return
            if self.fuse_group in await trio.to_thread.run_sync(supplementary_groups, ctx.pid):
                return
        log.warning("refused uid %d gid %d (pid %d): not root or the FUSE group",
                    ctx.uid, ctx.gid, ctx.pid)
        raise pyfuse3.FUSEError(errno.EACCES)

    def _attrs(self, inode: int) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = inode
        attr.st_uid, attr.st_gid = ROOT_UID, self.gid
        attr.st_blksize = 4096
        attr.entry_timeout = attr.attr_timeout = TIMEOUT
        if inode in DIRS:
            attr.st_mode = stat.S_IFDIR | DIR_MODE
            attr.st_nlink = 2
            attr.entry_timeout = attr.attr_timeout = 1.0  # blob set changes
            return attr
        disk = self.disks.by_inode.get(inode)
        if disk is not None:
            attr.st_mode = stat.S_IFREG | DISK_MODE
            attr.st_nlink = 1
            attr.st_size = disk.size
            attr.st_blocks = (disk.size + 511) // 512
            attr.entry_timeout = attr.attr_timeout = 1.0
            return attr
        blob = self.blobs.by_inode.get(inode) or self.pmem.by_inode.get(inode)
        if blob is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        attr.st_mode = stat.S_IFREG | BLOB_MODE
        attr.st_nlink = 1
        attr.st_size = blob.size
        attr.st_blocks = (blob.size + 511) // 512
        return attr

    def _children(self, inode: int) -> list[tuple[bytes, int]]:
        if inode == BLOBS:
            return sorted((name.encode(), b.inode) for name, b in self.blobs.by_name.items())
        if inode == DISKS:
            return sorted((sid.encode(), d.inode)
                          for sid, d in self.disks.disks.items())
        if inode == PMEM:
            return sorted((name.encode(), p.inode) for name, p in self.pmem.by_name.items())
        if inode in DIRS:
            return sorted(DIRS[inode].items())
        raise pyfuse3.FUSEError(errno.ENOTDIR)

    @fuse_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None):
        if not self.restored.is_set() and name not in dict(self._children(parent_inode)):
            await self.restored.wait()
        for child_name, inode in self._children(parent_inode):
            if child_name == name:
                return self._attrs(inode)
        raise pyfuse3.FUSEError(errno.ENOENT)

    @fuse_errors
    async def getattr(self, inode: int, ctx: Any = None):
        await self.settle(inode)
        return self._attrs(inode)

    @fuse_errors
    async def opendir(self, inode: int, ctx: Any):
        await self.check_caller(ctx)
        self._children(inode)
        return inode

    @fuse_errors
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        for i, (name, inode) in enumerate(self._children(fh)[start_id:], start_id):
            if not pyfuse3.readdir_reply(token, name, self._attrs(inode), i + 1):
                break

    @fuse_errors
    async def releasedir(self, fh: int) -> None:
        return None

    @fuse_errors
    async def open(self, inode: int, flags: int, ctx: Any):
        await self.check_caller(ctx)
        await self.settle(inode)
        disk = self.disks.by_inode.get(inode)
        if disk is not None:
            return pyfuse3.FileInfo(fh=inode, keep_cache=disk.kernel_open())
        if inode not in self.blobs.by_inode and inode not in self.pmem.by_inode:
            raise pyfuse3.FUSEError(errno.EISDIR if inode in DIRS else errno.ENOENT)
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    @fuse_errors
    async def read(self, fh: int, off: int, size: int) -> Buffer:  # type: ignore[override]
        await self.settle(fh)
        disk = self.disks.by_inode.get(fh)
        if disk is not None:
            return await disk.read(off, size)
        blob = self.blobs.by_inode.get(fh) or self.pmem.by_inode.get(fh)
        if blob is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        return await blob.read(off, size)

    @fuse_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        await self.settle(fh)
        disk = self.disks.by_inode.get(fh)
        if disk is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        return await disk.write(off, buf, through_kernel=True)

    @fuse_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.settle(fh)
        disk = self.disks.by_inode.get(fh)
        if disk is not None:
            await disk.flush()

    @fuse_errors
    async def flush(self, fh: int) -> None:
        await self.settle(fh)
        disk = self.disks.by_inode.get(fh)
        if disk is not None:
            await disk.flush()

    @fuse_errors
    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any):
        await self.settle(inode)
        disk = self.disks.by_inode.get(inode)
        if fields.update_size and (disk is None or attr.st_size != disk.size):
            raise pyfuse3.FUSEError(errno.EPERM)  # disks and blobs have a fixed size
        return self._attrs(inode)

    @fuse_errors
    async def release(self, fh: int) -> None:
        return None

    @fuse_errors
    async def statfs(self, ctx: Any):
        st = pyfuse3.StatvfsData()
        st.f_bsize = st.f_frsize = 4096
        total = sum(b.size for b in self.blobs.by_inode.values())
        st.f_blocks = total // 4096
        st.f_bfree = st.f_bavail = 0
        st.f_files = len(self.blobs.by_inode) + len(DIRS)
        st.f_ffree = st.f_favail = 0
        st.f_namemax = 255
        return st


def supplementary_groups(pid: int) -> set[int]:
    """The groups of process ``pid`` (empty if it is gone or unknown)."""
    if pid <= 0:
        return set()
    try:
        return set(pyfuse3.get_sup_groups(pid))
    except (OSError, ValueError):
        return set()
