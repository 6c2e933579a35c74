"""OverlayBD LSMT block layers: header/trailer, index entries, sealed files.

Layout notes are in ``docs/formats.md``. A sealed layer written here is::

    header (4096: flags header|data|sealed, index_offset 0)
    data   (from byte 4096: the disk image itself at offset 4096 + disk offset,
            zero ranges left as holes, so chunking it keeps disk offsets aligned)
    index  (sorted 16-byte entries, padded with INVALID_OFFSET entries to a
            multiple of 256; ``index_size`` counts the padding too)
    trailer (the last 4096 bytes: flags data|sealed, the real index offset/size)

Offsets and lengths in entries are in 512-byte sectors.
"""

from __future__ import annotations

import bisect
import struct
import uuid as uuidlib
from dataclasses import dataclass

from ..errors import LayerfsError

SECTOR = 512
HT_SPACE = 4096
MAGIC0 = b"LSMT\0\1\2\0"
MAGIC1 = bytes.fromhex("657E63D29444084CA2D2C8EC4FCFAE8A")
HT = struct.Struct("<8s16sIIQQQ37s37sHBB256s")
HT_SIZE = 390
FLAG_HEADER, FLAG_DATA, FLAG_SEALED, FLAG_SPARSE_RW = 1, 2, 4, 16
MAX_OFFSET = (1 << 50) - 1
INVALID_OFFSET = MAX_OFFSET
MAX_LENGTH = (1 << 14) - 1
INDEX_ALIGN = 256
MAX_LAYERS = 255

assert HT.size == HT_SIZE


class LsmtError(LayerfsError):
    """bad LSMT layer {}: {}"""

    exit_code = 6


@dataclass(frozen=True)
class HeaderTrailer:
    flags: int
    index_offset: int
    index_size: int
    virtual_size: int
    uuid: str = ""
    parent_uuid: str = ""
    user_tag: bytes = b""
    version: int = 1
    sub_version: int = 1

    def pack(self) -> bytes:
        raw = HT.pack(MAGIC0, MAGIC1, HT_SIZE, self.flags, self.index_offset, self.index_size,
                      self.virtual_size, self.uuid.encode(), self.parent_uuid.encode(), 0,
                      self.version, self.sub_version, self.user_tag)
        return raw.ljust(HT_SPACE, b"\0")

    @classmethod
    def unpack(cls, raw: bytes | bytearray | memoryview, what: str) -> HeaderTrailer:
        if len(raw) < HT_SIZE:
            raise LsmtError(what, "truncated header/trailer")
        (m0, m1, size, flags, ioff, isize, vsize, uid, puid, _, ver, sub,
         tag) = HT.unpack_from(raw)
        if m0 != MAGIC0 or m1 != MAGIC1:
            raise LsmtError(what, "bad magic")
        if size != HT_SIZE:
            raise LsmtError(what, f"header size {size}, expected {HT_SIZE}")
        return cls(flags, ioff, isize, vsize, uid.rstrip(b"\0").decode(errors="replace"),
                   puid.rstrip(b"\0").decode(errors="replace"), tag.rstrip(b"\0"), ver, sub)


@dataclass(frozen=True, slots=True)
class Mapping:
    """``length`` sectors at disk sector ``offset`` live at file sector ``moffset``."""

    offset: int
    length: int
    moffset: int
    zeroed: bool = False
    tag: int = 0  # runtime only: which layer of a stack the mapping comes from

    @property
    def end(self) -> int:
        return self.offset + self.length

    def pack(self) -> bytes:
        lo = self.offset | (self.length << 50)
        hi = self.moffset | (int(self.zeroed) << 55)
        return struct.pack("<QQ", lo, hi)

    @classmethod
    def unpack(cls, raw: bytes | bytearray | memoryview) -> Mapping:
        lo, hi = struct.unpack("<QQ", raw)
        return cls(lo & MAX_OFFSET, lo >> 50, hi & ((1 << 55) - 1), bool((hi >> 55) & 1))


def padding_entry() -> bytes:
    return Mapping(INVALID_OFFSET, 0, 0).pack()


def split_extent(sector: int, count: int, msector: int, zeroed: bool = False) -> list[Mapping]:
    """An extent as mappings of at most MAX_LENGTH sectors."""
    out = []
    while count > 0:
        n = min(count, MAX_LENGTH)
        out.append(Mapping(sector, n, msector, zeroed))
        sector, msector, count = sector + n, msector + n, count - n
    return out


def pack_index(mappings: list[Mapping]) -> bytes:
    body = b"".join(m.pack() for m in mappings)
    pad = -len(mappings) % INDEX_ALIGN
    return body + padding_entry() * pad


def parse_index(raw: bytes | bytearray | memoryview, virtual_size: int, data_end: int,
                what: str) -> list[Mapping]:
    """Entries from a sealed index: drops padding, checks order and bounds."""
    if len(raw) % 16:
        raise LsmtError(what, "index size is not a multiple of 16 bytes")
    out: list[Mapping] = []
    for i in range(0, len(raw), 16):
        m = Mapping.unpack(raw[i : i + 16])
        if m.offset == INVALID_OFFSET:
            continue
        if m.length == 0 or m.end * SECTOR > virtual_size:
            raise LsmtError(what, f"index entry {i // 16} outside the disk")
        if not m.zeroed and (m.moffset + m.length) * SECTOR > data_end:
            raise LsmtError(what, f"index entry {i // 16} points past the data")
        if out and m.offset < out[-1].end:
            raise LsmtError(what, f"index entry {i // 16} overlaps or is out of order")
        out.append(m)
    return out


def new_uuid() -> str:
    return str(uuidlib.uuid4())


@dataclass
class SealedLayout:
    """Where the parts of a sealed layer are, for a disk of ``virtual_size``
    bytes; the index starts on a chunk boundary, so it is a chunk of its own."""

    virtual_size: int
    align: int = HT_SPACE

    @property
    def index_offset(self) -> int:
        return -(-(HT_SPACE + self.virtual_size) // self.align) * self.align

    def file_size(self, entries: int) -> int:
        padded = entries + (-entries % INDEX_ALIGN)
        return self.index_offset + 16 * padded + HT_SPACE


def sealed_header(virtual_size: int, uid: str, parent_uuid: str) -> bytes:
    return HeaderTrailer(FLAG_HEADER | FLAG_DATA | FLAG_SEALED, 0, 0, virtual_size, uid,
                         parent_uuid).pack()


def sealed_trailer(layout: SealedLayout, entries: int, uid: str, parent_uuid: str) -> bytes:
    padded = entries + (-entries % INDEX_ALIGN)
    return HeaderTrailer(FLAG_DATA | FLAG_SEALED, layout.index_offset, padded,
                         layout.virtual_size, uid, parent_uuid).pack()


class SegmentMap:
    """Non-overlapping mappings sorted by disk offset; later inserts win."""

    def __init__(self, mappings: list[Mapping] | None = None) -> None:
        self.items: list[Mapping] = sorted(mappings or [], key=lambda m: m.offset)
        self._starts = [m.offset for m in self.items]

    def __len__(self) -> int:
        return len(self.items)

    def insert(self, new: Mapping) -> None:
        lo = bisect.bisect_right(self._starts, new.offset) - 1
        lo = max(lo, 0)
        hi = bisect.bisect_left(self._starts, new.end)
        keep_left: list[Mapping] = []
        keep_right: list[Mapping] = []
        for m in self.items[lo:hi]:
            if m.end <= new.offset or m.offset >= new.end:
                (keep_left if m.end <= new.offset else keep_right).append(m)
                continue
            if m.offset < new.offset:
                keep_left.append(Mapping(m.offset, new.offset - m.offset, m.moffset, m.zeroed,
                                         m.tag))
            if m.end > new.end:
                cut = new.end - m.offset
                keep_right.append(Mapping(new.end, m.end - new.end, m.moffset + cut, m.zeroed,
                                          m.tag))
        merged = keep_left + [new] + keep_right
        self.items[lo:hi] = merged
        self._starts[lo:hi] = [m.offset for m in merged]

    def lookup(self, sector: int, count: int) -> list[tuple[int, int, Mapping | None]]:
        """Pieces of ``[sector, sector+count)``: (start, length, mapping or None)."""
        out: list[tuple[int, int, Mapping | None]] = []
        end = sector + count
        i = max(bisect.bisect_right(self._starts, sector) - 1, 0)
        pos = sector
        while pos < end:
            m = self.items[i] if i < len(self.items) else None
            if m is None or m.offset >= end:
                out.append((pos, end - pos, None))
                break
            if m.end <= pos:
                i += 1
                continue
            if m.offset > pos:
                out.append((pos, m.offset - pos, None))
                pos = m.offset
            stop = min(end, m.end)
            out.append((pos, stop - pos, m))
            pos = stop
            i += 1
        return out
