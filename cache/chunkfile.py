"""The layout of one cache file, and checking what is read from it.

A cache file is a 32-byte header — magic ``LFSCACH2``, data length, block
size, block count, xxh3-64 of the whole data — then the xxh3-64 of each
block of the data (16 KiB blocks), then the chunk's uncompressed bytes. A
whole read checks the whole digest (one hash call); a read of part of the
chunk reads and checks only the blocks that hold it, with the header's
``BlockLayout`` (where the data starts, each block's digest) read from the
file or, when the caller kept it, from memory. Files of the first
format (``LFSCACH1``: magic, xxh3-64, length, then the data) are still read;
a part of one costs a whole read.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import TypeAlias

import xxhash

MAGIC = b"LFSCACH2"
MAGIC_V1 = b"LFSCACH1"
HEADER = struct.Struct("<8sQIIQ")  # magic, length, block size, block count, xxh3 of all
HEADER_V1 = struct.Struct("<8sQQ")  # magic, xxh3 of all, length
DIGEST = struct.Struct("<Q")
BLOCK = 16 << 10
FIRST_READ = 4096  # the header and (for chunks up to 8 MiB) every block digest
Buffer: TypeAlias = bytes | memoryview


def blocks_of(length: int, block: int = BLOCK) -> int:
    return -(-length // block)


def xxh(data: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(data)


def file_header(data: Buffer) -> bytes:
    """The header and block digests that precede ``data`` in its cache file."""
    view = memoryview(data)
    digests = b"".join(DIGEST.pack(xxh(view[i : i + BLOCK])) for i in range(0, len(view), BLOCK))
    return HEADER.pack(MAGIC, len(view), BLOCK, blocks_of(len(view)), xxh(view)) + digests


def file_size(length: int) -> int:
    return HEADER.size + blocks_of(length) * DIGEST.size + length


def whole_data(raw: bytes) -> Buffer | None:
    """The chunk's bytes from a whole cache file, or None if it is damaged."""
    view = memoryview(raw)
    if raw[:8] == MAGIC_V1 and len(raw) >= HEADER_V1.size:
        _, digest, length = HEADER_V1.unpack_from(raw)
        data = view[HEADER_V1.size :]
    elif raw[:8] == MAGIC and len(raw) >= HEADER.size:
        _, length, block, nblocks, digest = HEADER.unpack_from(raw)
        if block <= 0 or nblocks != blocks_of(length, block):
            return None
        data = view[HEADER.size + nblocks * DIGEST.size :]
    else:
        return None
    return data if len(data) == length and xxh(data) == digest else None


def whole_file(fd: int) -> Buffer | None:
    """The chunk's bytes from the open cache file ``fd``, or None if damaged."""
    return whole_data(os.pread(fd, os.fstat(fd).st_size, 0))


@dataclass(frozen=True)
class BlockLayout:
    """Where a cache file's data starts and the digest of each of its blocks.
    It depends only on the chunk's bytes, so it holds for every file ever
    written for that chunk and can be kept in memory."""

    length: int
    block: int
    start: int  # offset of the data in the file
    digests: bytes

    def digest(self, i: int) -> int:
        return int(DIGEST.unpack_from(self.digests, i * DIGEST.size)[0])


def layout_of(head: Buffer) -> BlockLayout | None:
    """The layout a ``LFSCACH2`` header describes, if ``head`` holds all of it."""
    head = bytes(head)
    if head[:8] != MAGIC or len(head) < HEADER.size:
        return None
    _, length, block, nblocks, _ = HEADER.unpack_from(head)
    start = HEADER.size + nblocks * DIGEST.size
    if block <= 0 or nblocks != blocks_of(length, block) or len(head) < start:
        return None
    return BlockLayout(length, block, start, head[HEADER.size : start])


def read_layout(fd: int) -> BlockLayout | None:
    """The layout of the open cache file ``fd``; None for a first-format or
    damaged file."""
    head = os.pread(fd, FIRST_READ, 0)
    if head[:8] == MAGIC and len(head) >= HEADER.size:
        nblocks = HEADER.unpack_from(head)[3]
        start = HEADER.size + nblocks * DIGEST.size
        if len(head) < start and nblocks < 1 << 24:
            head += os.pread(fd, start - len(head), len(head))
    return layout_of(head)


def part_data(fd: int, lo: int, hi: int, layout: BlockLayout | None) -> Buffer | None:
    """Bytes ``[lo, hi)`` of the chunk in the open cache file ``fd``, or None
    if the blocks that hold them are damaged or missing. ``layout`` is the
    file's (from :func:`read_layout` or memory); None for a file without one
    (first format, or a damaged header), which is read whole."""
    if layout is None:
        data = whole_file(fd)  # a first-format file, or a damaged one
        return None if data is None or hi > len(data) else memoryview(data)[lo:hi]
    if not 0 <= lo <= hi <= layout.length:
        return None
    block = layout.block
    first, last = lo // block, blocks_of(hi, block)
    want = min(last * block, layout.length) - first * block
    data = os.pread(fd, want, layout.start + first * block)
    if len(data) != want:
        return None
    view = memoryview(data)
    for k, i in enumerate(range(0, want, block)):
        if xxh(view[i : i + block]) != layout.digest(first + k):
            return None
    return view[lo - first * block : hi - first * block]
