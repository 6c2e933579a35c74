"""EROFS meta image writer (uncompressed, chunk-based data on device 1).

Serialises a :class:`~layerfs.tree.FileTree` into an EROFS image whose
regular files either live inline in the image (small files) or are
CHUNK_BASED with chunk indexes that address device 1, the layer's data blob.
Layout of the image:

* block 0: superblock at byte 1024, device table right after it;
* the inode area from byte 1280 on (``meta_blkaddr`` = 0, so the root nid is
  40): each inode with its xattrs and its inline tail or chunk indexes, in
  depth-first order with children sorted by name, never crossing a block
  boundary when the record fits in one block;
* full directory / symlink blocks that did not fit inline;
* the shared xattr area (xattrs that at least two inodes carry).

The output depends only on the tree: the same tree gives the same bytes.
"""

from __future__ import annotations

import hashlib
import stat
import struct
from collections import Counter
from dataclasses import dataclass, field

from ..tree import HOLE, FileTree, FsNode

BLOCK = 4096
BLKBITS = 12
MAGIC = 0xE0F5E1E2
SB_OFFSET = 1024
DEVT_SLOTOFF = (SB_OFFSET + 128) // 128  # device table right after the superblock
INODE_START = DEVT_SLOTOFF * 128 + 128  # one device slot
NULL_ADDR = 0xFFFFFFFF

FEATURE_COMPAT_SB_CHKSUM = 0x1
FEATURE_INCOMPAT_CHUNKED_FILE = 0x4
FEATURE_INCOMPAT_DEVICE_TABLE = 0x8

LAYOUT_FLAT_PLAIN = 0
LAYOUT_FLAT_INLINE = 2
LAYOUT_CHUNK_BASED = 4
CHUNK_FORMAT_INDEXES = 0x20

COMPACT_SIZE = 32
EXTENDED_SIZE = 64
DIRENT_SIZE = 12

FILE_TYPES = {
    stat.S_IFREG: 1,
    stat.S_IFDIR: 2,
    stat.S_IFCHR: 3,
    stat.S_IFBLK: 4,
    stat.S_IFIFO: 5,
    stat.S_IFSOCK: 6,
    stat.S_IFLNK: 7,
}

# (full-name prefix, index); exact names first so they win over "system."
XATTR_PREFIXES: list[tuple[bytes, int, bool]] = [
    (b"system.posix_acl_access", 2, True),
    (b"system.posix_acl_default", 3, True),
    (b"user.", 1, False),
    (b"trusted.", 4, False),
    (b"security.", 6, False),
]


# Extended inodes and the superblock hold seconds as a u64 that the kernel reads as
# signed (two's complement, like mkfs.erofs): any s64 time, before 1970 included.
MTIME_MIN, MTIME_MAX = -(2**63), 2**63 - 1
U64 = 2**64 - 1
ID_LIMIT = 2**32  # uid and gid of an extended inode
DEV_MAJOR_LIMIT, DEV_MINOR_LIMIT = 2**12, 2**20  # i_u holds a 32-bit new_encode_dev


class ErofsError(ValueError):
    """The tree holds something EROFS cannot represent."""


def clamp_mtime(seconds: int, nanoseconds: int) -> tuple[int, int]:
    """The nearest time an inode can hold (nanoseconds within their second)."""
    if seconds < MTIME_MIN:
        return MTIME_MIN, 0
    if seconds > MTIME_MAX:
        return MTIME_MAX, 999_999_999
    return seconds, min(max(nanoseconds, 0), 999_999_999)


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _crc32c_table() -> list[int]:
    poly = 0x82F63B78  # CRC-32C (Castagnoli), reflected
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ poly if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C of ``data`` (initial ~0, final xor ~0), continuing ``crc``; the
    superblock checksum is this of the superblock's block with the xor undone."""
    crc ^= 0xFFFFFFFF
    table = _CRC32C_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def split_xattr_name(name: bytes) -> tuple[int, bytes]:
    """Full xattr name → (EROFS prefix index, name suffix)."""
    for prefix, index, exact in XATTR_PREFIXES:
        if exact and name == prefix:
            return index, b""
        if not exact and name.startswith(prefix):
            if len(name) == len(prefix):
                raise ErofsError(f"empty xattr name after prefix {name!r}")
            return index, name[len(prefix) :]
    raise ErofsError(f"xattr {name.decode(errors='replace')!r} has no EROFS prefix")


def xattr_entry(name: bytes, value: bytes) -> bytes:
    """One on-disk xattr entry (header, name suffix, value), padded to 4."""
    index, suffix = split_xattr_name(name)
    if len(suffix) > 255 or len(value) > 0xFFFF:
        raise ErofsError(f"xattr {name!r} too long")
    raw = struct.pack("<BBH", len(suffix), index, len(value)) + suffix + value
    return raw + b"\0" * (round_up(len(raw), 4) - len(raw))


def inline_xattr_size(xattrs: dict[bytes, bytes]) -> int:
    """Size of an inode's xattr area if none of its xattrs are shared."""
    if not xattrs:
        return 0
    return 12 + sum(len(xattr_entry(k, v)) for k, v in xattrs.items())


def max_inline_file(xattrs: dict[bytes, bytes]) -> int:
    """Largest regular file that is sure to fit inline beside its inode."""
    return BLOCK - EXTENDED_SIZE - inline_xattr_size(xattrs) - 1


@dataclass(eq=False)
class _Slot:
    """Layout facts of one inode, found in the first pass."""

    node: FsNode
    ino: int
    extended: bool = False
    layout: int = LAYOUT_FLAT_PLAIN
    xattr_body: bytes = b""  # header + shared ids + inline entries
    data: bytes = b""  # the whole data of a dir / symlink / inline file
    tail: bytes = b""  # inline part of ``data``
    plain: bytes = b""  # block part of ``data``
    data_blkaddr: int = 0
    nid: int = 0
    dirents: list[tuple[bytes, FsNode]] = field(default_factory=list)

    @property
    def isize(self) -> int:
        return EXTENDED_SIZE if self.extended else COMPACT_SIZE

    def record_size(self) -> int:
        base = self.isize + len(self.xattr_body)
        if self.layout == LAYOUT_CHUNK_BASED:
            return round_up(base, 8) + 8 * len(self.node.chunks)
        return base + len(self.tail)


def dir_blocks(entries: list[tuple[bytes, int, int]]) -> list[bytes]:
    """Directory data blocks; ``entries`` are (name, nid, file_type), sorted."""
    blocks: list[list[tuple[bytes, int, int]]] = [[]]
    used = 0
    for ent in entries:
        need = DIRENT_SIZE + len(ent[0])
        if used + need > BLOCK:
            blocks.append([])
            used = 0
        blocks[-1].append(ent)
        used += need
    out = []
    for blk in blocks:
        nameoff = DIRENT_SIZE * len(blk)
        heads, names = [], []
        for name, nid, ftype in blk:
            heads.append(struct.pack("<QHBB", nid, nameoff, ftype, 0))
            names.append(name)
            nameoff += len(name)
        out.append(b"".join(heads) + b"".join(names))
    return out


class ErofsWriter:
    """Builds the meta image of one layer from its tree."""

    def __init__(self, tree: FileTree, blob_blocks: int, chunk_bits: int) -> None:
        if not 12 <= chunk_bits <= 12 + 31:
            raise ErofsError(f"chunk size 2^{chunk_bits} out of range")
        self.tree = tree
        self.blob_blocks = blob_blocks
        self.chunk_bits = chunk_bits
        self.slots: list[_Slot] = []
        self.by_node: dict[int, _Slot] = {}
        self.parent: dict[int, FsNode] = {}
        self.shared_ids: dict[tuple[bytes, bytes], int] = {}
        self.shared_area = b""
        self.build_time = (0, 0)

    # -- pass 1: collect inodes, count links, choose shared xattrs --
    def _collect(self) -> None:
        stack: list[tuple[FsNode, FsNode]] = [(self.tree.root, self.tree.root)]
        while stack:
            node, parent = stack.pop()
            if id(node) in self.by_node:
                self.by_node[id(node)].node.links += 1
                continue
            node.links = 1
            slot = _Slot(node, ino=len(self.slots) + 1)
            self.slots.append(slot)
            self.by_node[id(node)] = slot
            if node.is_dir:
                self.parent[id(node)] = parent
                assert node.children is not None
                kids = sorted(node.children.items())
                slot.dirents = kids
                stack.extend((child, node) for _, child in reversed(kids))

    def _choose_build_time(self) -> None:
        times = Counter((s.node.mtime, s.node.mtime_ns) for s in self.slots)
        best = max(times.values())
        self.build_time = min(t for t, n in times.items() if n == best)

    def _choose_shared_xattrs(self) -> None:
        counts = Counter(kv for s in self.slots for kv in s.node.xattrs.items())
        shared = sorted(kv for kv, n in counts.items() if n >= 2)
        area = bytearray()
        for kv in shared:
            entry = xattr_entry(*kv)
            room = BLOCK - len(area) % BLOCK
            if len(entry) <= BLOCK and len(entry) > room:
                area += b"\0" * room
            self.shared_ids[kv] = len(area) // 4
            area += entry
        self.shared_area = bytes(area)

    def _nlink(self, node: FsNode) -> int:
        if node.is_dir:
            assert node.children is not None
            return 2 + sum(1 for c in node.children.values() if c.is_dir)
        return node.links

    def _plan(self, slot: _Slot) -> None:
        node = slot.node
        ids = [self.shared_ids[kv] for kv in sorted(node.xattrs.items()) if kv in self.shared_ids]
        own = [xattr_entry(*kv) for kv in sorted(node.xattrs.items()) if kv not in self.shared_ids]
        if ids or own:
            if len(ids) > 255:
                raise ErofsError("more than 255 shared xattrs on one inode")
            head = struct.pack("<IB7x", 0, len(ids)) + b"".join(struct.pack("<I", i) for i in ids)
            slot.xattr_body = head + b"".join(own)
        fmt = stat.S_IFMT(node.mode)
        if fmt == stat.S_IFDIR:
            size = self._dir_size(slot)
        elif fmt == stat.S_IFLNK:
            slot.data = node.target
            size = len(node.target)
        elif fmt == stat.S_IFREG:
            size = node.size
            if node.inline is not None:
                slot.data = node.inline
            else:
                slot.layout = LAYOUT_CHUNK_BASED
        else:
            size = 0
        slot.extended = not (
            node.uid < 0x10000
            and node.gid < 0x10000
            and self._nlink(node) < 0x10000
            and size < 2**32
            and (node.mtime, node.mtime_ns) == self.build_time
        )
        if slot.layout != LAYOUT_CHUNK_BASED:
            self._split_tail(slot, size)

    def _dir_size(self, slot: _Slot) -> int:
        # nids are not known yet, but sizes only depend on names
        names = [b".", b".."] + [name for name, _ in slot.dirents]
        blocks = dir_blocks(sorted((n, 0, 0) for n in names))
        return BLOCK * (len(blocks) - 1) + len(blocks[-1])

    def _split_tail(self, slot: _Slot, size: int) -> None:
        if size == 0:
            slot.layout = LAYOUT_FLAT_PLAIN
            return
        tail_len = size - (size - 1) // BLOCK * BLOCK
        base = slot.isize + len(slot.xattr_body)
        if tail_len < BLOCK and base + tail_len <= BLOCK:
            slot.layout = LAYOUT_FLAT_INLINE
            slot.tail = b"x" * tail_len  # placeholder; real bytes set in pass 2
        else:
            slot.layout = LAYOUT_FLAT_PLAIN
        if slot.node.is_reg and slot.layout != LAYOUT_FLAT_INLINE:
            raise ErofsError("inline file does not fit beside its inode")

    # -- placement --
    def _place(self) -> int:
        """Assign nids; returns the end of the inode area in bytes."""
        pos = INODE_START
        for slot in self.slots:
            rec = slot.record_size()
            head = slot.isize + len(slot.xattr_body)
            fits = rec if rec <= BLOCK else head
            if pos % BLOCK + fits > BLOCK:
                pos = round_up(pos, BLOCK)
            slot.nid = pos // 32
            pos = round_up(pos + rec, 32)
        return pos

    def _data_size(self, slot: _Slot) -> int:
        size = self._size(slot)
        if slot.layout == LAYOUT_FLAT_INLINE:
            return (size - 1) // BLOCK * BLOCK
        if slot.layout == LAYOUT_FLAT_PLAIN:
            return round_up(size, BLOCK)
        return 0

    def _size(self, slot: _Slot) -> int:
        node = slot.node
        if node.is_dir:
            return self._dir_size(slot)
        if stat.S_ISLNK(node.mode):
            return len(node.target)
        if node.is_reg:
            return node.size
        return 0

    # -- pass 2: bytes --
    def _fill_data(self, slot: _Slot) -> None:
        node = slot.node
        if node.is_dir:
            parent = self.parent[id(node)]
            ents = [(b".", slot.nid, 2), (b"..", self.by_node[id(parent)].nid, 2)]
            for name, child in slot.dirents:
                ftype = FILE_TYPES[stat.S_IFMT(child.mode)]
                ents.append((name, self.by_node[id(child)].nid, ftype))
            blocks = dir_blocks(sorted(ents))
            slot.data = b"".join(b.ljust(BLOCK, b"\0") for b in blocks[:-1]) + blocks[-1]
        size = len(slot.data)
        if slot.layout == LAYOUT_FLAT_INLINE:
            cut = (size - 1) // BLOCK * BLOCK
            slot.plain, slot.tail = slot.data[:cut], slot.data[cut:]
        elif slot.layout == LAYOUT_FLAT_PLAIN:
            slot.plain = slot.data

    def _i_u(self, slot: _Slot) -> int:
        node = slot.node
        fmt = stat.S_IFMT(node.mode)
        if fmt in (stat.S_IFCHR, stat.S_IFBLK):
            major, minor = node.rdev_major, node.rdev_minor
            return (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)
        if slot.layout == LAYOUT_CHUNK_BASED:
            return (self.chunk_bits - BLKBITS) | CHUNK_FORMAT_INDEXES
        if fmt in (stat.S_IFIFO, stat.S_IFSOCK):
            return 0
        return slot.data_blkaddr

    def _inode_bytes(self, slot: _Slot) -> bytes:
        node = slot.node
        size = len(slot.data) if slot.layout != LAYOUT_CHUNK_BASED else node.size
        if not (node.is_dir or node.is_reg or stat.S_ISLNK(node.mode)):
            size = 0
        icount = 0 if not slot.xattr_body else (len(slot.xattr_body) - 12) // 4 + 1
        i_format = (slot.layout << 1) | int(slot.extended)
        nlink = self._nlink(node)
        mode = node.mode & 0xFFFF
        if slot.extended:
            return struct.pack(
                "<HHHHQIIIIQII16x", i_format, icount, mode, 0, size, self._i_u(slot),
                slot.ino, node.uid, node.gid, node.mtime & U64, node.mtime_ns, nlink,
            )
        return struct.pack(
            "<HHHHIIIIHHI", i_format, icount, mode, nlink, size, 0, self._i_u(slot),
            slot.ino, node.uid, node.gid, 0,
        )

    def _record(self, slot: _Slot) -> bytes:
        out = self._inode_bytes(slot) + slot.xattr_body
        if slot.layout == LAYOUT_CHUNK_BASED:
            out += b"\0" * (round_up(len(out), 8) - len(out))
            idx = []
            for addr in slot.node.chunks:
                if addr == HOLE:
                    idx.append(struct.pack("<HHI", 0, 0, NULL_ADDR))
                else:
                    idx.append(struct.pack("<HHI", 0, 1, addr))
            out += b"".join(idx)
        else:
            out += slot.tail
        return out

    def _check_node(self, slot: _Slot) -> None:
        node = slot.node
        if clamp_mtime(node.mtime, node.mtime_ns) != (node.mtime, node.mtime_ns):
            raise ErofsError(f"mtime {node.mtime}.{node.mtime_ns:09d} out of range")
        if slot.layout == LAYOUT_CHUNK_BASED:
            want = -(-node.size // (1 << self.chunk_bits))
            if len(node.chunks) != want:
                raise ErofsError(f"file of {node.size} bytes has {len(node.chunks)} chunks")
        if node.is_dir:
            for name in node.children or {}:
                if not name or len(name) > 255 or b"/" in name or b"\0" in name:
                    raise ErofsError(f"invalid file name {name!r}")
                if name in (b".", b".."):
                    raise ErofsError(f"invalid file name {name!r}")

    def build(self) -> bytes:
        """The whole meta image."""
        self._collect()
        self._choose_build_time()
        self._choose_shared_xattrs()
        for slot in self.slots:
            self._check_node(slot)
            self._plan(slot)
        inode_end = self._place()
        block = round_up(inode_end, BLOCK) // BLOCK
        for slot in self.slots:
            data_len = self._data_size(slot)
            if data_len:
                slot.data_blkaddr = block
                block += data_len // BLOCK
        xattr_blkaddr = block if self.shared_area else 0
        block += round_up(len(self.shared_area), BLOCK) // BLOCK
        img = bytearray(block * BLOCK)
        for slot in self.slots:
            self._fill_data(slot)
            rec = self._record(slot)
            assert len(rec) == slot.record_size(), (len(rec), slot.record_size())
            off = slot.nid * 32
            img[off : off + len(rec)] = rec
            if slot.plain:
                start = slot.data_blkaddr * BLOCK
                img[start : start + len(slot.plain)] = slot.plain
        if self.shared_area:
            start = xattr_blkaddr * BLOCK
            img[start : start + len(self.shared_area)] = self.shared_area
        self._superblock(img, block, xattr_blkaddr)
        return bytes(img)

    def _superblock(self, img: bytearray, blocks: int, xattr_blkaddr: int) -> None:
        root_nid = self.by_node[id(self.tree.root)].nid
        if root_nid > 0xFFFF:
            raise ErofsError("root inode beyond nid 65535")
        uuid = hashlib.sha256(img).digest()[:16]
        dev = struct.pack("<64sII56x", b"", self.blob_blocks, 0)
        img[DEVT_SLOTOFF * 128 : DEVT_SLOTOFF * 128 + 128] = dev
        sb = struct.pack(
            "<IIIBBHQQIIII16s16sIHHH38x",
            MAGIC, 0, FEATURE_COMPAT_SB_CHKSUM, BLKBITS, 0, root_nid, len(self.slots),
            self.build_time[0] & U64, self.build_time[1], blocks, 0, xattr_blkaddr, uuid, b"",
            FEATURE_INCOMPAT_CHUNKED_FILE | FEATURE_INCOMPAT_DEVICE_TABLE, 0, 1, DEVT_SLOTOFF,
        )
        assert len(sb) == 128
        img[SB_OFFSET : SB_OFFSET + 128] = sb
        checksum = crc32c(bytes(img[SB_OFFSET:BLOCK])) ^ 0xFFFFFFFF
        img[SB_OFFSET + 4 : SB_OFFSET + 8] = struct.pack("<I", checksum)


def write_meta_image(tree: FileTree, blob_blocks: int, chunk_bits: int) -> bytes:
    return ErofsWriter(tree, blob_blocks, chunk_bits).build()
