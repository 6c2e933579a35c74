"""Reading a layer's EROFS meta image back into a :class:`~layerfs.tree.FileTree`,
or looking single paths up in it (:class:`MetaLookup`).

The inverse of :mod:`layerfs.formats.erofs` for the subset it writes: every
inode becomes an :class:`~layerfs.tree.FsNode` with its mode, owner, mtime,
xattrs (inline and shared), symlink target, device numbers, inline data or
chunk addresses (blob block per chunk, or :data:`~layerfs.tree.HOLE`), and a
hard-linked inode is one node under all of its names. Nothing is mounted, so
this works without privileges.

The image must already have passed :func:`layerfs.formats.erofscheck.check_meta_image`
(as :meth:`layerfs.refstore.RefStore.meta_image` does): the reader trusts its
structure and only asserts what the checker guarantees.
"""

from __future__ import annotations

import stat
import struct
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..tree import HOLE, FileTree, FsNode
from .erofs import (
    BLKBITS,
    BLOCK,
    CHUNK_FORMAT_INDEXES,
    DEVT_SLOTOFF,
    LAYOUT_CHUNK_BASED,
    LAYOUT_FLAT_INLINE,
    NULL_ADDR,
    SB_OFFSET,
)
from .erofscheck import (
    CHUNK_BLKBITS_MASK,
    CHUNK_INDEX,
    COMPACT,
    DEVICE_SLOT,
    DIRENT,
    EXTENDED,
    SUPERBLOCK,
    XATTR_ENTRY,
    XATTR_HEAD,
)

# EROFS xattr prefix index → the full-name prefix it stands for
XATTR_PREFIX_NAMES = {
    1: b"user.",
    2: b"system.posix_acl_access",
    3: b"system.posix_acl_default",
    4: b"trusted.",
    6: b"security.",
}


@dataclass
class MetaTree:
    """What a meta image describes: its tree and the blob it addresses."""

    tree: FileTree
    chunk_size: int  # bytes per chunk of chunk-based files (0: the image has none)
    blob_blocks: int  # size of device 1, the data blob, in 4 KiB blocks


def decode_rdev(i_u: int) -> tuple[int, int]:
    """EROFS (Linux ``new_encode_dev``) device number → (major, minor)."""
    return (i_u & 0xFFF00) >> 8, (i_u & 0xFF) | ((i_u >> 12) & 0xFFF00)


def signed_seconds(stored: int) -> int:
    """A u64 time field as the kernel reads it: two's complement, so before 1970 too."""
    return stored - (1 << 64) if stored >> 63 else stored


def read_meta_image(image: bytes) -> MetaTree:
    """The tree of a checked meta image (see the module docstring)."""
    return _Reader(memoryview(image)).run()


@dataclass
class _Raw:
    """One inode's fields as stored."""

    nid: int
    mode: int
    layout: int
    size: int
    i_u: int
    nlink: int
    uid: int
    gid: int
    mtime: int
    mtime_ns: int
    body: int  # byte offset just past the inode and its xattrs
    xattr_start: int
    icount: int


class _Reader:
    def __init__(self, img: memoryview) -> None:
        self.img = img
        (_magic, _sum, _compat, _bits, _ext, self.root_nid, _inos, self.build_time,
         self.build_time_ns, _blocks, _meta, self.xattr_blkaddr, _uuid, _vol, _incompat,
         _algs, _devs, _slotoff, _res) = SUPERBLOCK.unpack_from(img, SB_OFFSET)
        self.build_time = signed_seconds(self.build_time)
        self.blob_blocks = DEVICE_SLOT.unpack_from(img, DEVT_SLOTOFF * 128)[1]
        self.nodes: dict[int, FsNode] = {}
        self.chunk_size = 0

    def run(self) -> MetaTree:
        root = self._node(self.root_nid)
        stack = [(self.root_nid, root)]
        while stack:
            nid, node = stack.pop()
            assert node.children is not None
            for name, child_nid in self._dirents(self._raw(nid)):
                known = self.nodes.get(child_nid)
                child = known if known is not None else self._node(child_nid)
                node.children[name] = child
                if child.is_dir and known is None:
                    stack.append((child_nid, child))
        return MetaTree(FileTree(root), self.chunk_size, self.blob_blocks)

    # -- inodes --
    def _raw(self, nid: int) -> _Raw:
        pos = nid * 32
        i_format = struct.unpack_from("<H", self.img, pos)[0]
        if i_format & 1:
            (_f, icount, mode, _r, size, i_u, _ino, uid, gid, mtime, mtime_ns, nlink,
             _r2) = EXTENDED.unpack_from(self.img, pos)
            mtime, isize = signed_seconds(mtime), EXTENDED.size
        else:
            (_f, icount, mode, nlink, size, _r, i_u, _ino, uid, gid,
             _r2) = COMPACT.unpack_from(self.img, pos)
            mtime, mtime_ns, isize = self.build_time, self.build_time_ns, COMPACT.size
        xattr_size = 0 if icount == 0 else 12 + 4 * (icount - 1)
        return _Raw(nid, mode, i_format >> 1, size, i_u, nlink, uid, gid, mtime, mtime_ns,
                    pos + isize + xattr_size, pos + isize, icount)

    def _node(self, nid: int) -> FsNode:
        raw = self._raw(nid)
        node = FsNode(mode=raw.mode, uid=raw.uid, gid=raw.gid, mtime=raw.mtime,
                      mtime_ns=raw.mtime_ns, xattrs=self._xattrs(raw))
        fmt = stat.S_IFMT(raw.mode)
        if fmt == stat.S_IFDIR:
            node.children = {}
        elif fmt == stat.S_IFLNK:
            node.target = self._flat_data(raw)
        elif fmt == stat.S_IFREG:
            node.size = raw.size
            node.links = raw.nlink
            if raw.layout == LAYOUT_CHUNK_BASED:
                node.chunks = self._chunks(raw)
            else:
                node.inline = self._flat_data(raw)
        elif fmt in (stat.S_IFCHR, stat.S_IFBLK):
            node.rdev_major, node.rdev_minor = decode_rdev(raw.i_u)
        if not node.is_dir:
            node.links = raw.nlink
        self.nodes[nid] = node
        return node

    def _flat_data(self, raw: _Raw) -> bytes:
        """The data of a flat (plain or inline-tail) inode."""
        nblocks = -(-raw.size // BLOCK)
        pieces = []
        for i in range(nblocks):
            length = min(BLOCK, raw.size - i * BLOCK)
            if raw.layout == LAYOUT_FLAT_INLINE and i == nblocks - 1:
                start = raw.body
            else:
                start = (raw.i_u + i) * BLOCK
            pieces.append(bytes(self.img[start : start + length]))
        return b"".join(pieces)

    def _chunks(self, raw: _Raw) -> list[int]:
        assert raw.i_u & CHUNK_FORMAT_INDEXES
        chunk_size = 1 << (BLKBITS + (raw.i_u & CHUNK_BLKBITS_MASK))
        self.chunk_size = chunk_size
        count = -(-raw.size // chunk_size)
        start = -(-raw.body // 8) * 8
        end = start + CHUNK_INDEX.size * count
        return [HOLE if blkaddr == NULL_ADDR else blkaddr
                for _advise, _dev, blkaddr in CHUNK_INDEX.iter_unpack(self.img[start:end])]

    # -- directories --
    def _dirents(self, raw: _Raw) -> list[tuple[bytes, int]]:
        return list(_block_dirents(self._flat_data(raw)))

    # -- xattrs --
    def _xattrs(self, raw: _Raw) -> dict[bytes, bytes]:
        if not raw.icount:
            return {}
        shared = XATTR_HEAD.unpack_from(self.img, raw.xattr_start)[1]
        out: dict[bytes, bytes] = {}
        ids_at = raw.xattr_start + XATTR_HEAD.size
        for k in range(shared):
            xid = struct.unpack_from("<I", self.img, ids_at + 4 * k)[0]
            self._entry(self.xattr_blkaddr * BLOCK + 4 * xid, out)
        pos = ids_at + 4 * shared
        while pos < raw.body:
            pos = self._entry(pos, out)
        return out

    def _entry(self, pos: int, out: dict[bytes, bytes]) -> int:
        """Read the xattr entry at ``pos`` into ``out``; returns where it ends."""
        name_len, index, value_size = XATTR_ENTRY.unpack_from(self.img, pos)
        at = pos + XATTR_ENTRY.size
        name = XATTR_PREFIX_NAMES[index] + bytes(self.img[at : at + name_len])
        out[name] = bytes(self.img[at + name_len : at + name_len + value_size])
        return at + -(-(name_len + value_size) // 4) * 4


class MetaLookup:
    """Path lookups in a layer's meta image through ``read(offset, length)``
    (a ``pread`` of the file), without reading its whole tree: only the
    inodes and directories on the way, each directory listed once (the last
    ``LISTED_MAX`` kept). Symlinks are followed inside the image, as the
    kernel would inside the layer's root.

    It is handed checked images, but each lookup is bounded anyway (a
    hint's cost must not depend on what a layer's author chose):
    ``MAX_STEPS`` components walked, ``MAX_LINKS`` symlinks followed,
    directories of at most ``MAX_DIR`` bytes listed, files of at most
    ``MAX_CHUNKS`` chunks; past a bound the path is not found. A damaged
    image may raise ``struct.error`` or ``ValueError``: the caller's to
    catch."""

    LISTED_MAX = 64  # directory listings kept
    MAX_LINKS = 8  # symlinks followed in one lookup (then: not found, as ELOOP)
    MAX_STEPS = 64  # path components walked in one lookup, symlinks' included
    MAX_DIR = 1 << 20  # bytes of a directory listed at most
    MAX_CHUNKS = 1 << 16  # chunks of a file at most

    def __init__(self, read: Callable[[int, int], bytes]) -> None:
        self.read = read
        self.root_nid = SUPERBLOCK.unpack(read(SB_OFFSET, SUPERBLOCK.size))[5]
        self.listed: dict[int, dict[bytes, int]] = {}

    def file_chunks(self, path: str) -> tuple[str, list[int]] | None:
        """The chunk-based regular file at absolute ``path``: the path it
        resolves to and its chunks' blob block addresses (``HOLE`` for a
        hole); None if there is none (or it is inline, or not a file)."""
        found = self._resolve(path)
        if found is None:
            return None
        where, (mode, layout, size, i_u, body) = found
        if stat.S_IFMT(mode) != stat.S_IFREG or layout != LAYOUT_CHUNK_BASED \
                or not i_u & CHUNK_FORMAT_INDEXES:
            return None
        chunk_size = 1 << (BLKBITS + (i_u & CHUNK_BLKBITS_MASK))
        count = -(-size // chunk_size)
        if count > self.MAX_CHUNKS:
            return None
        table = self.read(-(-body // 8) * 8, CHUNK_INDEX.size * count)
        if len(table) != CHUNK_INDEX.size * count:
            return None
        return where, [HOLE if blkaddr == NULL_ADDR else blkaddr
                       for _advise, _dev, blkaddr in CHUNK_INDEX.iter_unpack(table)]

    def _resolve(self, path: str) -> tuple[str, tuple[int, int, int, int, int]] | None:
        todo = deque(p for p in path.split("/") if p)
        stack: list[tuple[str, int]] = []  # (name, nid) of each directory below the root
        links = steps = 0
        raw = self._inode(self.root_nid)
        while todo:
            steps += 1
            if steps > self.MAX_STEPS:
                return None
            name = todo.popleft()
            if name == ".":
                continue
            if name == "..":
                if stack:
                    stack.pop()
                continue
            here = stack[-1][1] if stack else self.root_nid
            nid = self._listing(here).get(name.encode("utf-8", "surrogateescape"))
            if nid is None:
                return None
            raw = self._inode(nid)
            kind = stat.S_IFMT(raw[0])
            if kind == stat.S_IFLNK:
                links += 1
                if links > self.MAX_LINKS or raw[2] > BLOCK:
                    return None
                target = self._data(raw).decode("utf-8", "surrogateescape")
                if target.startswith("/"):
                    stack = []
                todo.extendleft(reversed([p for p in target.split("/") if p]))
                continue
            if todo and kind != stat.S_IFDIR:
                return None
            stack.append((name, nid))
        return "/" + "/".join(n for n, _ in stack), raw

    def _inode(self, nid: int) -> tuple[int, int, int, int, int]:
        """(mode, layout, size, i_u, where its data or chunk index starts)."""
        pos = nid * 32
        head = self.read(pos, EXTENDED.size)
        i_format = struct.unpack_from("<H", head)[0]
        if i_format & 1:
            _f, icount, mode, _r, size, i_u = EXTENDED.unpack(head)[:6]
            isize = EXTENDED.size
        else:
            _f, icount, mode, _n, size, _r, i_u = COMPACT.unpack_from(head)[:7]
            isize = COMPACT.size
        xattr_size = 0 if icount == 0 else 12 + 4 * (icount - 1)
        return mode, i_format >> 1, size, i_u, pos + isize + xattr_size

    def _data(self, raw: tuple[int, int, int, int, int]) -> bytes:
        """A flat (plain or inline-tail) inode's data."""
        _mode, layout, size, i_u, body = raw
        nblocks = -(-size // BLOCK)
        pieces = []
        for i in range(nblocks):
            length = min(BLOCK, size - i * BLOCK)
            inline = layout == LAYOUT_FLAT_INLINE and i == nblocks - 1
            pieces.append(self.read(body if inline else (i_u + i) * BLOCK, length))
        return b"".join(pieces)

    def _listing(self, nid: int) -> dict[bytes, int]:
        listing = self.listed.get(nid)
        if listing is None:
            raw = self._inode(nid)
            listing = {}
            if stat.S_IFMT(raw[0]) == stat.S_IFDIR and raw[2] <= self.MAX_DIR:
                listing = dict(_block_dirents(self._data(raw)))
            if len(self.listed) >= self.LISTED_MAX:
                del self.listed[next(iter(self.listed))]
            self.listed[nid] = listing
        return listing


def _block_dirents(data: bytes) -> Iterator[tuple[bytes, int]]:
    """A directory's (name, nid) entries, but ``.`` and ``..``, block by block."""
    for at in range(0, len(data), BLOCK):
        block = data[at : at + BLOCK]
        first = DIRENT.unpack_from(block, 0)[1]
        heads = [DIRENT.unpack_from(block, k * 12) for k in range(min(first, BLOCK) // 12)]
        for k, (nid, nameoff, _ftype, _r) in enumerate(heads):
            end = heads[k + 1][1] if k + 1 < len(heads) else len(block)
            name = block[nameoff:end]
            if k + 1 == len(heads):
                name = name.split(b"\0", 1)[0]
            if name not in (b".", b".."):
                yield name, nid
