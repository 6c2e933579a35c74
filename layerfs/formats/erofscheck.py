"""Structural check of a layer's EROFS meta image before the kernel mounts it.

A meta image is digest-checked against its manifest, but the manifest may come
from anyone who can write to the store, and a malformed image reaches kernel
code that was never meant to face hostile input. :func:`check_meta_image`
accepts only the subset of EROFS that :mod:`layerfs.formats.erofs` writes:

* superblock: magic, a correct checksum, 4 KiB blocks, ``meta_blkaddr`` 0,
  exactly the features ``CHUNKED_FILE | DEVICE_TABLE`` (no compression, no
  unknown compat bit), one extra device, zero reserved bytes, ``blocks``
  matching the image length;
* device table: one slot, the blob's size in blocks at most (the blob size is
  the chunk table's), ``mapped_blkaddr`` 0, zero reserved bytes;
* every inode reachable from the root, each inside the image and at or past the
  inode area, with inode and xattrs in one block, known ``i_format`` bits and a
  known data layout for its file type; no two records (inode, xattrs, inline
  tail or chunk indexes, data blocks) overlapping each other or block 0's
  superblock and device table; unique inode numbers, ``inos`` the count;
* directories: dirent arrays and names inside their blocks, names of 1..255
  bytes without ``/`` or NUL, sorted, ``.`` and ``..`` naming the directory and
  its parent, file types matching the inodes, no directory reached twice (so
  the tree has no cycles), ``nlink`` = 2 + subdirectories;
* chunk-based files: the chunk size of the layer, indexes present and inside
  the image, each a hole or a device-1 extent inside the blob;
* symlinks: a target of 1..4095 bytes without NUL; devices, fifos and sockets
  of size 0;
* xattrs: header reserved bytes zero, shared ids inside the shared area, every
  entry of a known prefix and inside its area, the inline area used exactly.

A failure is one :class:`~layerfs.errors.BadMetaImage` naming the layer and
the first problem found. The check is a pure function of the bytes.

The rules run twice over, in two implementations: compiled
(``_erofscheck.c``, ~2 ms for a Debian base image's 6,674 inodes, against
65-90 ms here) for the verdict, and :class:`_Checker` below, which is the
reference and names the problem. An image the compiled check accepts is
accepted; one it refuses is given to :class:`_Checker` for the message, and
if that one accepts it (the two disagree: a flaw in one of them) the image is
refused all the same. tests/test_erofscheck.py holds both to the same verdict
on fuzzed mutants (and, in CI, the compiled one under ASan and UBSan).

Where the compiled module was not built (a checkout used without ``make
deps``), the reference check alone gives the verdict: the same rules, slower,
with one warning per process.
"""

from __future__ import annotations

import logging
import stat
import struct
from collections import deque
from dataclasses import dataclass

from ..errors import BadMetaImage
from .erofs import (
    BLKBITS,
    BLOCK,
    CHUNK_FORMAT_INDEXES,
    COMPACT_SIZE,
    DIRENT_SIZE,
    EXTENDED_SIZE,
    FEATURE_COMPAT_SB_CHKSUM,
    FEATURE_INCOMPAT_CHUNKED_FILE,
    FEATURE_INCOMPAT_DEVICE_TABLE,
    FILE_TYPES,
    LAYOUT_CHUNK_BASED,
    LAYOUT_FLAT_INLINE,
    LAYOUT_FLAT_PLAIN,
    MAGIC,
    NULL_ADDR,
    SB_OFFSET,
    crc32c,
)

try:
    from . import _erofscheck
except ImportError:  # not built: the reference check alone (check_meta_image warns once)
    _erofscheck = None  # type: ignore[assignment]

SUPERBLOCK = struct.Struct("<IIIBBHQQIIII16s16sIHHH38s")
DEVICE_SLOT = struct.Struct("<64sII56s")
COMPACT = struct.Struct("<HHHHIIIIHHI")
EXTENDED = struct.Struct("<HHHHQIIIIQII16s")
DIRENT = struct.Struct("<QHBB")
CHUNK_INDEX = struct.Struct("<HHI")
U16 = struct.Struct("<H")
XATTR_HEAD = struct.Struct("<IB7s")
XATTR_ENTRY = struct.Struct("<BBH")

FEATURE_COMPAT_MTIME = 0x2
KNOWN_COMPAT = FEATURE_COMPAT_SB_CHKSUM | FEATURE_COMPAT_MTIME
WANTED_INCOMPAT = FEATURE_INCOMPAT_CHUNKED_FILE | FEATURE_INCOMPAT_DEVICE_TABLE
XATTR_INDEXES = {1, 2, 3, 4, 6}
ACL_INDEXES = {2, 3}
MAX_NAME = 255
MAX_SYMLINK = BLOCK - 1
CHUNK_BLKBITS_MASK = 0x1F
RESERVED_AREA = SB_OFFSET + 128 + 128  # superblock and the one device slot, block 0
MODE_TYPES = {fmt: ftype for fmt, ftype in FILE_TYPES.items()}
FTYPES = frozenset(MODE_TYPES.values())

log = logging.getLogger(__name__)
_fallback_warned = False


class _Bad(Exception):
    """One structural problem (turned into BadMetaImage at the top)."""


@dataclass(frozen=True)
class ImageShape:
    """What a checked meta image holds."""

    inodes: int
    dirs: int
    regular: int
    chunk_indexes: int
    blocks: int


@dataclass(frozen=True)
class _Super:
    root_nid: int
    inos: int
    blocks: int
    xattr_blkaddr: int
    dev_blocks: int


class _Inode:
    """One inode as read (a plain class with slots: a check makes thousands)."""

    __slots__ = ("nid", "pos", "mode", "layout", "size", "i_u", "ino", "nlink", "isize",
                 "xattr_size", "fmt", "body")

    def __init__(self, nid: int, pos: int, mode: int, layout: int, size: int, i_u: int,
                 ino: int, nlink: int, isize: int, xattr_size: int) -> None:
        self.nid, self.pos, self.mode, self.layout, self.size = nid, pos, mode, layout, size
        self.i_u, self.ino, self.nlink, self.isize = i_u, ino, nlink, isize
        self.xattr_size = xattr_size
        self.fmt = mode & 0o170000  # the file type bits of mode
        self.body = pos + isize + xattr_size  # byte offset just past the inode and its xattrs


def check_meta_image(image: bytes, blob_size: int, chunk_size: int, what: str) -> ImageShape:
    """Check ``image`` as described in the module docstring; BadMetaImage if it fails."""
    if _erofscheck is None:
        return _reference_verdict(image, blob_size, chunk_size, what)
    try:  # bytes(): an immutable copy of a mutable buffer (the check runs without the GIL)
        shape = _erofscheck.check(bytes(image), blob_size, chunk_size)
    except OverflowError:  # a size outside [0, 2^64): the reference says which
        shape = None
    if shape is not None:
        return ImageShape(*shape)
    try:
        reference_check(image, blob_size, chunk_size)
    except _Bad as exc:
        raise BadMetaImage(what, str(exc)) from None
    raise BadMetaImage(what, "refused by the compiled check, passed by the reference one")


def _reference_verdict(image: bytes, blob_size: int, chunk_size: int, what: str) -> ImageShape:
    """The verdict of the reference check alone, for a build without the compiled one."""
    global _fallback_warned
    if not _fallback_warned:
        _fallback_warned = True
        log.warning("the compiled check of meta images (layerfs.formats._erofscheck) is not "
                    "built; checking them in Python, 30-40 times slower (make deps builds it)")
    try:
        return reference_check(image, blob_size, chunk_size)
    except _Bad as exc:
        raise BadMetaImage(what, str(exc)) from None
    except struct.error as exc:  # a record cut short by the end of the image
        raise BadMetaImage(what, f"a record past the image end ({exc})") from None


def reference_check(image: bytes, blob_size: int, chunk_size: int) -> ImageShape:
    """The rules in Python alone: an ImageShape, or _Bad naming the first problem."""
    return _Checker(memoryview(image), blob_size, chunk_size).run()


class _Checker:
    def __init__(self, img: memoryview, blob_size: int, chunk_size: int) -> None:
        self.img = img
        self.blob_blocks = -(-blob_size // BLOCK)
        self.chunk_size = chunk_size
        # (start, end, what, its number): ``what.format(number)`` names it in an error
        self.regions: list[tuple[int, int, str, int]] = [(0, RESERVED_AREA, "superblock", 0)]
        self.shared_seen: set[int] = set()
        self.inos: set[int] = set()
        self.chunk_indexes = 0
        self.sb: _Super

    # -- superblock and device table --
    def run(self) -> ImageShape:
        self.sb = self._superblock()
        dirs, regular, inodes = self._walk()
        if inodes != self.sb.inos:
            raise _Bad(f"superblock says {self.sb.inos} inodes, the tree has {inodes}")
        self._no_overlaps()
        return ImageShape(inodes, dirs, regular, self.chunk_indexes, self.sb.blocks)

    def _superblock(self) -> _Super:
        img = self.img
        if len(img) < BLOCK or len(img) % BLOCK:
            raise _Bad(f"size {len(img)} is not a positive multiple of {BLOCK}")
        (magic, checksum, compat, blkszbits, extslots, root_nid, inos, _time, time_ns, blocks,
         meta_blkaddr, xattr_blkaddr, _uuid, _volume, incompat, compr_algs, extra_devices,
         devt_slotoff, reserved) = SUPERBLOCK.unpack_from(img, SB_OFFSET)
        if magic != MAGIC:
            raise _Bad("bad superblock magic")
        if compat & ~KNOWN_COMPAT or not compat & FEATURE_COMPAT_SB_CHKSUM:
            raise _Bad(f"feature_compat {compat:#x} (only SB_CHKSUM and MTIME are allowed)")
        body = bytearray(img[SB_OFFSET:BLOCK])
        body[4:8] = b"\0\0\0\0"
        if crc32c(bytes(body)) ^ 0xFFFFFFFF != checksum:
            raise _Bad("superblock checksum mismatch")
        if incompat != WANTED_INCOMPAT:
            raise _Bad(f"feature_incompat {incompat:#x} (want CHUNKED_FILE|DEVICE_TABLE)")
        if blkszbits != BLKBITS or extslots or compr_algs or meta_blkaddr:
            raise _Bad("block size, sb_extslots, compression or meta_blkaddr not as written")
        if any(reserved) or time_ns >= 10**9:
            raise _Bad("nonzero reserved superblock bytes or bad build_time_nsec")
        if blocks * BLOCK != len(img):
            raise _Bad(f"superblock says {blocks} blocks, the image has {len(img) // BLOCK}")
        if xattr_blkaddr >= blocks or inos == 0 or inos > len(img) // COMPACT_SIZE:
            raise _Bad("xattr_blkaddr or inode count out of range")
        if extra_devices != 1 or devt_slotoff * 128 != SB_OFFSET + 128:
            raise _Bad("not exactly one extra device right after the superblock")
        return _Super(root_nid, inos, blocks, xattr_blkaddr, self._device_slot(devt_slotoff))

    def _device_slot(self, slotoff: int) -> int:
        _tag, dev_blocks, mapped, reserved = DEVICE_SLOT.unpack_from(self.img, slotoff * 128)
        if mapped or any(reserved):
            raise _Bad("device table slot has mapped_blkaddr or reserved bytes set")
        if dev_blocks > self.blob_blocks:
            raise _Bad(f"device 1 of {dev_blocks} blocks is larger than the blob "
                       f"({self.blob_blocks} blocks)")
        return int(dev_blocks)

    # -- the tree --
    def _walk(self) -> tuple[int, int, int]:
        """Breadth-first from the root; returns (dirs, regular files, inodes)."""
        root = self._inode(self.sb.root_nid)
        if root.fmt != stat.S_IFDIR:
            raise _Bad("root inode is not a directory")
        seen: dict[int, _Inode] = {root.nid: root}
        links: dict[int, int] = {}
        todo: deque[tuple[_Inode, int]] = deque([(root, root.nid)])
        dirs = regular = 0
        while todo:
            node, parent = todo.popleft()
            dirs += 1
            subdirs = 0
            for name, nid, ftype in self._dirents(node):
                if name in (b".", b".."):
                    if nid != (node.nid if name == b"." else parent):
                        raise _Bad(f"{name!r} of directory nid {node.nid} points at nid {nid}")
                    continue
                child = seen.get(nid)
                if child is None:
                    child = self._inode(nid)
                    seen[nid] = child
                    if child.fmt == stat.S_IFDIR:
                        todo.append((child, node.nid))
                    elif child.fmt == stat.S_IFREG:
                        regular += 1
                elif child.fmt == stat.S_IFDIR:
                    raise _Bad(f"directory nid {nid} reached twice (a cycle or a linked dir)")
                if MODE_TYPES[child.fmt] != ftype:
                    raise _Bad(f"dirent {name!r} has file type {ftype}, its inode another")
                links[nid] = links.get(nid, 0) + 1
                subdirs += child.fmt == stat.S_IFDIR
            if node.nlink != 2 + subdirs:
                raise _Bad(f"directory nid {node.nid} has nlink {node.nlink}, "
                           f"{2 + subdirs} expected")
        for nid, count in links.items():
            node = seen[nid]
            if node.fmt != stat.S_IFDIR and node.nlink != count:
                raise _Bad(f"inode nid {nid} has nlink {node.nlink} but {count} names")
        return dirs, regular, len(seen)

    # -- one inode --
    def _inode(self, nid: int) -> _Inode:
        img = self.img
        pos = nid * 32
        if pos < RESERVED_AREA or pos + COMPACT_SIZE > len(img):
            raise _Bad(f"nid {nid} outside the inode area")
        i_format = U16.unpack_from(img, pos)[0]
        if i_format & ~0xF:
            raise _Bad(f"nid {nid}: unknown i_format bits {i_format:#x}")
        layout = i_format >> 1
        if i_format & 1:
            if pos + EXTENDED_SIZE > len(img):
                raise _Bad(f"nid {nid}: extended inode past the image end")
            (_f, icount, mode, reserved, size, i_u, ino, _uid, _gid, _mtime, mtime_ns, nlink,
             reserved2) = EXTENDED.unpack_from(img, pos)
            if reserved or any(reserved2) or mtime_ns >= 10**9:
                raise _Bad(f"nid {nid}: reserved inode bytes or mtime_nsec out of range")
            isize = EXTENDED_SIZE
        else:
            (_f, icount, mode, nlink, size, reserved, i_u, ino, _uid, _gid,
             reserved2) = COMPACT.unpack_from(img, pos)
            if reserved or reserved2:
                raise _Bad(f"nid {nid}: reserved inode bytes set")
            isize = COMPACT_SIZE
        xattr_size = 0 if icount == 0 else 12 + 4 * (icount - 1)
        node = _Inode(nid, pos, mode, layout, size, i_u, ino, nlink, isize, xattr_size)
        if pos % BLOCK + isize + xattr_size > BLOCK:
            raise _Bad(f"nid {nid}: inode and xattrs cross a block boundary")
        if ino == 0 or ino > self.sb.inos or ino in self.inos:
            raise _Bad(f"nid {nid}: inode number {ino} out of range or repeated")
        self.inos.add(ino)
        if nlink == 0:
            raise _Bad(f"nid {nid}: nlink 0")
        if mode & 0o170000 not in MODE_TYPES:
            raise _Bad(f"nid {nid}: unknown file type in mode {mode:#o}")
        if xattr_size:
            self._xattrs(node)
        self._data(node)
        return node

    def _data(self, node: _Inode) -> None:
        """Check the layout and data extent of one inode and record its regions."""
        fmt = node.fmt
        if fmt == stat.S_IFREG and node.layout == LAYOUT_CHUNK_BASED:
            self._chunks(node)
        elif fmt in (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK):
            if node.layout not in (LAYOUT_FLAT_PLAIN, LAYOUT_FLAT_INLINE):
                raise _Bad(f"nid {node.nid}: data layout {node.layout}")
            if fmt == stat.S_IFDIR and node.size == 0:
                raise _Bad(f"directory nid {node.nid} is empty (no . and ..)")
            if fmt == stat.S_IFLNK and not 0 < node.size <= MAX_SYMLINK:
                raise _Bad(f"symlink nid {node.nid} of {node.size} bytes")
            if fmt == stat.S_IFREG and node.size and node.layout != LAYOUT_FLAT_INLINE:
                raise _Bad(f"regular file nid {node.nid} with data blocks in the meta image")
            if fmt == stat.S_IFREG and node.size >= BLOCK:
                raise _Bad(f"inline regular file nid {node.nid} of {node.size} bytes")
            self._flat(node)
            if fmt == stat.S_IFLNK and b"\0" in b"".join(self._pieces(node)):
                raise _Bad(f"symlink nid {node.nid}: target with NUL")
        else:
            if node.size or node.layout != LAYOUT_FLAT_PLAIN:
                raise _Bad(f"special file nid {node.nid} with a size or a data layout")
            if fmt in (stat.S_IFIFO, stat.S_IFSOCK) and node.i_u:
                raise _Bad(f"fifo or socket nid {node.nid} with i_u set")
            self._region(node.pos, node.body, "nid {}", node.nid)

    def _flat(self, node: _Inode) -> None:
        nblocks = -(-node.size // BLOCK)
        if node.layout == LAYOUT_FLAT_INLINE:
            if node.size == 0:
                raise _Bad(f"nid {node.nid}: inline layout with size 0")
            tail = node.size - (nblocks - 1) * BLOCK
            if node.body % BLOCK + tail > BLOCK or node.body + tail > len(self.img):
                raise _Bad(f"nid {node.nid}: inline tail crosses its block")
            self._region(node.pos, node.body + tail, "nid {}", node.nid)
            nblocks -= 1
        else:
            self._region(node.pos, node.body, "nid {}", node.nid)
        if nblocks:
            if node.i_u == 0 or node.i_u + nblocks > self.sb.blocks:
                raise _Bad(f"nid {node.nid}: data blocks outside the image")
            self._region(node.i_u * BLOCK, (node.i_u + nblocks) * BLOCK, "data of {}", node.nid)
        elif node.layout == LAYOUT_FLAT_PLAIN and node.i_u:
            raise _Bad(f"nid {node.nid}: empty file with a block address")

    def _chunks(self, node: _Inode) -> None:
        fmt = node.i_u
        chunk_bits = BLKBITS + (fmt & CHUNK_BLKBITS_MASK)
        if fmt & ~(CHUNK_BLKBITS_MASK | CHUNK_FORMAT_INDEXES) or not fmt & CHUNK_FORMAT_INDEXES:
            raise _Bad(f"nid {node.nid}: chunk format {fmt:#x}")
        if 1 << chunk_bits != self.chunk_size:
            raise _Bad(f"nid {node.nid}: chunk size 2^{chunk_bits}, the layer's is "
                       f"{self.chunk_size}")
        count = -(-node.size // self.chunk_size)
        start = -(-node.body // 8) * 8
        end = start + CHUNK_INDEX.size * count
        if end > len(self.img):
            raise _Bad(f"nid {node.nid}: chunk indexes past the image end")
        self._region(node.pos, max(end, node.body), "nid {}", node.nid)
        chunk_blocks = self.chunk_size // BLOCK
        for i, (advise, device, blkaddr) in enumerate(
                CHUNK_INDEX.iter_unpack(self.img[start:end])):
            if advise:
                raise _Bad(f"nid {node.nid}: chunk {i} has advise bits")
            if blkaddr == NULL_ADDR:
                if device:
                    raise _Bad(f"nid {node.nid}: hole chunk {i} names device {device}")
                continue
            length = min(chunk_blocks, -(-(node.size - i * self.chunk_size) // BLOCK))
            if device != 1 or blkaddr + length > self.sb.dev_blocks:
                raise _Bad(f"nid {node.nid}: chunk {i} at device {device} block {blkaddr} "
                           f"is outside the blob")
        self.chunk_indexes += count

    # -- directories --
    def _dirents(self, node: _Inode) -> list[tuple[bytes, int, int]]:
        """Every (name, nid, file type) of a directory, checked and sorted."""
        out: list[tuple[bytes, int, int]] = []
        for block in self._pieces(node):
            out.extend(self._dir_block(node.nid, block))
        names = [name for name, _, _ in out]
        if any(a >= b for a, b in zip(names, names[1:], strict=False)):
            raise _Bad(f"directory nid {node.nid}: names not sorted or repeated")
        if b"." not in names or b".." not in names:
            raise _Bad(f"directory nid {node.nid} lacks . or ..")
        return out

    def _pieces(self, node: _Inode) -> list[memoryview]:
        """A flat inode's data, block by block (the last one maybe inline)."""
        nblocks = -(-node.size // BLOCK)
        blocks = []
        for i in range(nblocks):
            length = min(BLOCK, node.size - i * BLOCK)
            if node.layout == LAYOUT_FLAT_INLINE and i == nblocks - 1:
                start = node.body
            else:
                start = (node.i_u + i) * BLOCK
            blocks.append(self.img[start : start + length])
        return blocks

    def _dir_block(self, nid: int, block: memoryview) -> list[tuple[bytes, int, int]]:
        """A directory block's (name, nid, file type) entries: checked in bulk,
        and entry by entry (:meth:`_dir_block_entries`) only to name a problem."""
        size = len(block)
        if size >= DIRENT_SIZE:
            first = DIRENT.unpack_from(block, 0)[1]
            if first % DIRENT_SIZE == 0 and DIRENT_SIZE <= first < size:
                heads = list(DIRENT.iter_unpack(block[:first]))
                offs = [nameoff for _, nameoff, _, _ in heads]
                raw = bytes(block)
                last = raw[offs[-1]:].split(b"\0", 1)[0]
                spans = [b - a for a, b in zip(offs, offs[1:], strict=False)]
                inner = raw[offs[0]:offs[-1]]
                if (offs[0] >= first and offs[-1] < size and all(0 < n <= MAX_NAME for n in spans)
                        and 0 < len(last) <= MAX_NAME and b"/" not in inner
                        and b"\0" not in inner and b"/" not in last
                        and not any(reserved for _, _, _, reserved in heads)
                        and all(ftype in FTYPES for _, _, ftype, _ in heads)):
                    names = [raw[a:b] for a, b in zip(offs, offs[1:], strict=False)] + [last]
                    return [(name, child, ftype) for name, (child, _, ftype, _)
                            in zip(names, heads, strict=True)]
        return self._dir_block_entries(nid, block)

    def _dir_block_entries(self, nid: int, block: memoryview) -> list[tuple[bytes, int, int]]:
        if len(block) < DIRENT_SIZE:
            raise _Bad(f"directory nid {nid}: a block too short for a dirent")
        first = DIRENT.unpack_from(block, 0)[1]
        if first % DIRENT_SIZE or not DIRENT_SIZE <= first < len(block):
            raise _Bad(f"directory nid {nid}: first nameoff {first}")
        heads = [DIRENT.unpack_from(block, k * DIRENT_SIZE) for k in range(first // DIRENT_SIZE)]
        out = []
        for k, (child, nameoff, ftype, reserved) in enumerate(heads):
            end = heads[k + 1][1] if k + 1 < len(heads) else len(block)
            if not first <= nameoff < end <= len(block) or reserved:
                raise _Bad(f"directory nid {nid}: dirent {k} name out of bounds")
            name = bytes(block[nameoff:end])
            if k + 1 == len(heads):
                name = name.split(b"\0", 1)[0]
            if not 0 < len(name) <= MAX_NAME or b"/" in name or b"\0" in name:
                raise _Bad(f"directory nid {nid}: bad name {name[:64]!r}")
            if ftype not in FTYPES:
                raise _Bad(f"directory nid {nid}: dirent {name!r} of file type {ftype}")
            out.append((name, child, ftype))
        return out

    # -- xattrs --
    def _xattrs(self, node: _Inode) -> None:
        img = self.img
        start = node.pos + node.isize
        _reserved, shared, reserved = XATTR_HEAD.unpack_from(img, start)
        if _reserved or any(reserved):
            raise _Bad(f"nid {node.nid}: xattr header reserved bytes set")
        pos = start + XATTR_HEAD.size + 4 * shared
        if pos > node.body:
            raise _Bad(f"nid {node.nid}: {shared} shared xattr ids overflow the xattr area")
        for k in range(shared):
            xid = struct.unpack_from("<I", img, start + XATTR_HEAD.size + 4 * k)[0]
            self._shared_xattr(node.nid, xid)
        while pos < node.body:
            pos = self._xattr_entry(node.nid, pos, node.body)

    def _shared_xattr(self, nid: int, xid: int) -> None:
        if not self.sb.xattr_blkaddr:
            raise _Bad(f"nid {nid}: shared xattr id without a shared xattr area")
        pos = self.sb.xattr_blkaddr * BLOCK + 4 * xid
        if pos + XATTR_ENTRY.size > len(self.img):
            raise _Bad(f"nid {nid}: shared xattr id {xid} outside the image")
        if xid not in self.shared_seen:
            self.shared_seen.add(xid)
            end = self._xattr_entry(nid, pos, len(self.img))
            self._region(pos, end, "shared xattr {}", xid)

    def _xattr_entry(self, nid: int, pos: int, limit: int) -> int:
        """Check the xattr entry at ``pos`` (ending by ``limit``); returns where it ends."""
        if pos + XATTR_ENTRY.size > limit:
            raise _Bad(f"nid {nid}: xattr entry header past its area")
        name_len, index, value_size = XATTR_ENTRY.unpack_from(self.img, pos)
        if index not in XATTR_INDEXES or (name_len == 0) != (index in ACL_INDEXES):
            raise _Bad(f"nid {nid}: xattr prefix index {index} with a {name_len}-byte name")
        end = pos + XATTR_ENTRY.size + -(-(name_len + value_size) // 4) * 4
        if end > limit:
            raise _Bad(f"nid {nid}: xattr entry past its area")
        name = bytes(self.img[pos + XATTR_ENTRY.size : pos + XATTR_ENTRY.size + name_len])
        if b"\0" in name:
            raise _Bad(f"nid {nid}: xattr name with NUL")
        return end

    # -- overlaps --
    def _region(self, start: int, end: int, what: str, number: int) -> None:
        self.regions.append((start, end, what, number))

    def _no_overlaps(self) -> None:
        self.regions.sort()
        for (_, end, what, n), (start, _, other, m) in zip(self.regions, self.regions[1:],
                                                           strict=False):
            if start < end:
                raise _Bad(f"{what.format(n)} overlaps {other.format(m)}")
