"""Files a VMM maps as guest memory: pmem drives and, later, guest RAM.

A virtio-pmem device (QEMU's ``virtio-pmem-pci`` over a
``memory-backend-file``, Firecracker's and cloud-hypervisor's ``pmem``) maps
its backing file into the guest's physical memory, so a guest that mounts
EROFS on it with ``dax=always`` reads the host's page cache of that file
directly: one host copy of a layer for every guest that maps the same file,
and nothing in the guests' own page caches. The VMMs want the file's size to
be a multiple of 2 MiB (:data:`PMEM_ALIGN`, the device's alignment), which a
layer's blob is not: a :class:`PmemFile` is a blob file seen through a
padded size, reads past the blob's end answering zeros. The FUSE mount shows
them under ``ROOT/fuse/pmem/`` (a name of their own, so a pmem file has its
own inode and page cache: a vm with private pmem gets files no other vm
maps). The blob file underneath is the lazy one: a page the guest touches is
a FUSE read, fetched from the store on a miss like any layer read.

A layer's meta image is a local file; its pmem copy (:func:`padded_copy`) is
the image with its size rounded up the same way (a sparse tail of zeros).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..reads.blobfiles import BLOB_KIND, BlobFile, Buffer, joined, stable_inode, zeros

PMEM_ALIGN = 2 << 20  # the VMMs' alignment of a pmem device's size


def pmem_size(size: int) -> int:
    """``size`` rounded up to a whole, non-zero number of :data:`PMEM_ALIGN`."""
    return max(PMEM_ALIGN, -(-size // PMEM_ALIGN) * PMEM_ALIGN)


@dataclass(eq=False)
class PmemFile:
    """A blob file padded to a pmem size; reads past the blob's end are zeros."""

    name: str
    blob: BlobFile
    size: int
    inode: int

    async def read(self, off: int, size: int) -> Buffer:
        end = min(off + size, self.size)
        if off >= end:
            return b""
        parts = await self.blob.read_parts(off, end - off) if off < self.blob.size else []
        short = end - off - sum(len(p) for p in parts)
        return joined(parts + [zeros(short)] if short else parts)


class PmemDirectory:
    """The pmem files the FUSE mount shows under ``pmem/``, by name and inode;
    reference counted like the blob files (several vms may map one)."""

    def __init__(self) -> None:
        self.by_name: dict[str, PmemFile] = {}
        self.by_inode: dict[int, PmemFile] = {}
        self.users: dict[str, int] = {}

    def add(self, name: str, blob: BlobFile) -> PmemFile:
        found = self.by_name.get(name)
        if found is None:
            found = PmemFile(name, blob, pmem_size(blob.size), stable_inode(f"pmem/{name}",
                                                                             BLOB_KIND))
            self.by_name[name] = found
            self.by_inode[found.inode] = found
        self.users[name] = self.users.get(name, 0) + 1
        return found

    def remove(self, name: str) -> None:
        left = self.users.get(name, 0) - 1
        if left > 0:
            self.users[name] = left
            return
        self.users.pop(name, None)
        found = self.by_name.pop(name, None)
        if found is not None:
            self.by_inode.pop(found.inode, None)


def like_parent(path: Path) -> None:
    """Directory ``path`` made if need be, with its parent's group and mode
    (``ROOT/meta``'s: the FUSE group may traverse it, nobody else)."""
    path.mkdir(exist_ok=True)
    st = path.parent.stat()
    os.chown(path, 0, st.st_gid)
    os.chmod(path, st.st_mode & 0o777)


def padded_copy(source: Path, target: Path) -> int:
    """Worker thread: ``source`` copied to ``target`` (made whole, then
    renamed) with its size rounded up to the pmem alignment; that size. A
    copy already there of the right size is kept (meta images never change)."""
    size = pmem_size(os.stat(source).st_size)
    try:
        if os.stat(target).st_size == size:
            return size
    except FileNotFoundError:
        pass
    like_parent(target.parent)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.copyfile(source, tmp)
    with open(tmp, "rb+") as f:
        f.truncate(size)
        os.fsync(f.fileno())
    os.chmod(tmp, 0o444)
    os.rename(tmp, target)
    return size
