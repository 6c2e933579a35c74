"""The chunk table: where each piece of a layer's logical data blob is stored.

Binary layout (little endian)::

    header   8s magic "LFSCHNK1", u32 chunk_count, u32 pack_count,
             u64 blob_size (bytes), u32 chunk_size, u32 reserved     (32 bytes)
    packs    pack_count x 32-byte sha256 of the pack blob
    chunks   chunk_count x 68-byte entries, sorted by blob_offset:
             u64 blob_offset, u32 length, u32 pack_index, u64 pack_offset,
             u32 stored_length, u8 compression, u8 flags, 2 pad,
             32-byte sha256, 4 reserved

A chunk occupies ``round_up(length, 4096)`` bytes of the blob starting at
``blob_offset``; blob ranges no chunk covers (the padding after a short chunk)
read as zeros. ``compression`` 0 = stored raw, 1 = zstd. ``flags`` bit 0
(``FILE_START``): the chunk is a file's first in the blob (EROFS layers;
a file's holes and repeated chunks have no entry): file boundaries in the
blob, for readers that prefetch without the meta image.
``sha256`` is of the uncompressed bytes. Holes (all-zero chunks) have no
entry.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import IntegrityError

MAGIC = b"LFSCHNK1"
HEADER = struct.Struct("<8sIIQII")
ENTRY = struct.Struct("<QIIQIBB2x32s4x")
RAW, ZSTD = 0, 1
FILE_START = 1


@dataclass(frozen=True, slots=True)
class ChunkEntry:
    blob_offset: int
    length: int
    sha256: bytes
    pack: str  # "sha256:<hex>" of the pack blob
    pack_offset: int
    stored_length: int
    compression: int
    flags: int = 0

    @property
    def location(self) -> tuple[str, int]:
        return (self.pack, self.pack_offset)


class ChunkTable:
    """All chunks of one layer's blob, sorted by blob offset."""

    def __init__(self, entries: list[ChunkEntry], blob_size: int, chunk_size: int) -> None:
        self.entries = sorted(entries, key=lambda e: e.blob_offset)
        self.blob_size = blob_size
        self.chunk_size = chunk_size

    def __len__(self) -> int:
        return len(self.entries)

    def continuing(self, i: int, most: int) -> list[int]:
        """The entries after entry ``i`` that continue its file, at most
        ``most`` of them: each starts where the full chunk before it ends and
        is not flagged ``FILE_START`` (a file's holes and repeated chunks have
        no entry and take no place in the blob: they end the run)."""
        entries, size = self.entries, self.chunk_size
        rest: list[int] = []
        for j in range(i + 1, min(len(entries), i + 1 + most)):
            prev, nxt = entries[j - 1], entries[j]
            if (nxt.flags & FILE_START or prev.length != size
                    or nxt.blob_offset != prev.blob_offset + size):
                break
            rest.append(j)
        return rest

    def packs(self) -> list[str]:
        return sorted({e.pack for e in self.entries})

    def stored_bytes(self) -> int:
        return sum(e.stored_length for e in self.entries)

    def content_key(self) -> list[tuple[int, int, bytes]]:
        """What the blob holds, independent of where chunks are stored."""
        return [(e.blob_offset, e.length, e.sha256) for e in self.entries]

    def to_bytes(self) -> bytes:
        packs = self.packs()
        index = {p: i for i, p in enumerate(packs)}
        out = [HEADER.pack(MAGIC, len(self.entries), len(packs), self.blob_size,
                           self.chunk_size, 0)]
        out += [bytes.fromhex(p.removeprefix("sha256:")) for p in packs]
        for e in self.entries:
            out.append(
                ENTRY.pack(
                    e.blob_offset, e.length, index[e.pack], e.pack_offset,
                    e.stored_length, e.compression, e.flags, e.sha256,
                )
            )
        return b"".join(out)

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "chunk table") -> ChunkTable:
        if len(data) < HEADER.size:
            raise IntegrityError(what, "truncated header")
        magic, count, npacks, blob_size, chunk_size, _ = HEADER.unpack_from(data)
        if magic != MAGIC:
            raise IntegrityError(what, "bad magic")
        if len(data) != HEADER.size + 32 * npacks + ENTRY.size * count:
            raise IntegrityError(what, "size does not match its header")
        pos = HEADER.size
        packs = ["sha256:" + data[pos + 32 * i : pos + 32 * (i + 1)].hex() for i in range(npacks)]
        pos += 32 * npacks
        entries = []
        for off, length, pi, poff, slen, comp, flags, sha in ENTRY.iter_unpack(data[pos:]):
            if pi >= npacks or comp not in (RAW, ZSTD) or off + length > blob_size:
                raise IntegrityError(what, f"bad entry at blob offset {off}")
            entries.append(ChunkEntry(off, length, sha, packs[pi], poff, slen, comp, flags))
        return cls(entries, blob_size, chunk_size)
