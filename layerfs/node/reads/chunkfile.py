"""The layout of one cache file, and checking what is read from it.

A cache file holds one chunk in one of two forms:

* plain: a 64-byte header — magic ``LFSCACH3``, data length, block size,
  block count, xxh3-64 of the whole data, and the sha256 of the chunk it
  holds — then the xxh3-64 of each block of the data (16 KiB blocks), then
  the chunk's uncompressed bytes;
* zstd: a 64-byte header — magic ``LFSCACZ1``, data length, stored length,
  xxh3-64 of the stored bytes, the chunk's sha256 — then the zstd frame the
  store holds the chunk as (verified against the chunk's sha256 when it was
  fetched). Every read of it reads and checks the whole frame and
  decompresses it (:class:`ZstdLayout`: no blocks to read alone).

Every read checks the chunk's identity: the
header's sha256 must be the one the caller asks for (a 32-byte compare, no
re-hash), so a file of another chunk put in this one's place is never served;
the xxh3 digests then check the data. A whole read checks the whole digest
(one hash call); a read of part of the chunk reads and checks only the blocks
that hold it, with the header's ``BlockLayout`` (where the data starts, each
block's digest) read from the file or, when the caller kept it, from memory:
a layout kept in memory was learnt from the right chunk, so its digests tie
the blocks read to that chunk without reading the header again.

Files of the earlier formats (``LFSCACH1``, ``LFSCACH2``) do not say which
chunk they hold, so they cannot be checked: reading one raises
:class:`OldFormat`, and the cache drops it and fetches the chunk again.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import TypeAlias

import xxhash
import zstandard

MAGIC = b"LFSCACH3"
ZSTD_MAGIC = b"LFSCACZ1"
OLD_MAGICS = (b"LFSCACH1", b"LFSCACH2")
# magic, length, block size, block count, xxh3 of all, sha256 of the chunk
HEADER = struct.Struct("<8sQIIQ32s")
# magic, length, stored length, xxh3 of the stored bytes, sha256 of the chunk
ZSTD_HEADER = struct.Struct("<8sQQQ32s")
DIGEST = struct.Struct("<Q")
BLOCK = 16 << 10
FIRST_READ = 4096  # the header and (for chunks up to 7.8 MiB) every block digest
# A chunk's bytes as the cache and the node pass them on: a ``bytes``, or a view
# into the buffer a cache file was read into (no copy).
Chunk: TypeAlias = bytes | memoryview


class Unusable(Exception):
    """A cache file that must not be served."""


class Damaged(Unusable):
    """Torn, corrupted, or holding another chunk than its name says."""


class OldFormat(Unusable):
    """A file of an earlier format, which carries no chunk identity."""


def blocks_of(length: int, block: int = BLOCK) -> int:
    return -(-length // block)


def xxh(data: Chunk) -> int:
    return xxhash.xxh3_64_intdigest(data)


def file_header(sha: bytes, data: Chunk) -> bytes:
    """The header and block digests that precede ``data`` (the chunk whose
    sha256 is ``sha``) in its cache file."""
    view = memoryview(data)
    digests = b"".join(DIGEST.pack(xxh(view[i : i + BLOCK])) for i in range(0, len(view), BLOCK))
    return HEADER.pack(MAGIC, len(view), BLOCK, blocks_of(len(view)), xxh(view), sha) + digests


def file_size(length: int) -> int:
    return HEADER.size + blocks_of(length) * DIGEST.size + length


def zstd_header(sha: bytes, length: int, stored: Chunk) -> bytes:
    """The header that precedes ``stored``, the zstd frame of the ``length``-byte
    chunk whose sha256 is ``sha``, in its cache file."""
    return ZSTD_HEADER.pack(ZSTD_MAGIC, length, len(stored), xxh(stored), sha)


def zstd_file_size(stored_length: int) -> int:
    return ZSTD_HEADER.size + stored_length


def _zstd_data(raw: bytes, sha: bytes) -> bytes:
    """Chunk ``sha``'s bytes from a whole zstd-form cache file."""
    if len(raw) < ZSTD_HEADER.size:
        raise Damaged("bad header")
    _, length, stored_length, digest, named = ZSTD_HEADER.unpack_from(raw)
    check_identity(named, sha)
    stored = memoryview(raw)[ZSTD_HEADER.size:]
    if len(stored) != stored_length or xxh(stored) != digest:
        raise Damaged("data does not match its digest")
    try:
        data = zstandard.ZstdDecompressor().decompress(stored, max_output_size=length)
    except zstandard.ZstdError as exc:
        raise Damaged(f"cannot decompress ({exc})") from None
    if len(data) != length:
        raise Damaged("decompressed to the wrong length")
    return data


def _header(head: Chunk, sha: bytes) -> tuple[int, int, int, int]:
    """(length, block size, block count, xxh3 of all) from a header that names
    chunk ``sha``; raises :class:`Unusable` otherwise."""
    magic = bytes(head[:8])
    if magic in OLD_MAGICS:
        raise OldFormat(magic.decode())
    if magic != MAGIC or len(head) < HEADER.size:
        raise Damaged("bad header")
    _, length, block, nblocks, digest, named = HEADER.unpack_from(head)
    check_identity(named, sha)
    if block <= 0 or nblocks != blocks_of(length, block):
        raise Damaged("bad header")
    return length, block, nblocks, digest


def check_identity(named: bytes, sha: bytes) -> None:
    """The file names chunk ``sha``; else it holds another chunk (:class:`Damaged`)."""
    if named != sha:
        raise Damaged(f"holds chunk {named.hex()}")


def whole_data(raw: bytes, sha: bytes) -> Chunk:
    """Chunk ``sha``'s bytes from a whole cache file; raises :class:`Unusable`."""
    if raw[:8] == ZSTD_MAGIC:
        return _zstd_data(raw, sha)
    length, _, nblocks, digest = _header(raw, sha)
    data = memoryview(raw)[HEADER.size + nblocks * DIGEST.size :]
    if len(data) != length or xxh(data) != digest:
        raise Damaged("data does not match its digest")
    return data


def whole_file(fd: int, sha: bytes) -> Chunk:
    """Chunk ``sha``'s bytes from its open cache file ``fd``; raises :class:`Unusable`."""
    return whole_data(os.pread(fd, os.fstat(fd).st_size, 0), sha)


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


@dataclass(frozen=True)
class ZstdLayout:
    """A zstd-form cache file: a part of its chunk is read by reading the whole."""

    length: int


Layout: TypeAlias = BlockLayout | ZstdLayout


def layout_of(head: Chunk, sha: bytes) -> BlockLayout:
    """The layout a header of chunk ``sha`` describes; raises :class:`Unusable`
    if ``head`` is not one or does not hold all of it."""
    head = bytes(head)
    length, block, nblocks, _ = _header(head, sha)
    start = HEADER.size + nblocks * DIGEST.size
    if len(head) < start:
        raise Damaged("header cut short")
    return BlockLayout(length, block, start, head[HEADER.size : start])


def read_layout(fd: int, sha: bytes) -> Layout:
    """The layout of chunk ``sha``'s open cache file ``fd``; raises :class:`Unusable`."""
    head = os.pread(fd, FIRST_READ, 0)
    if head[:8] == ZSTD_MAGIC and len(head) >= ZSTD_HEADER.size:
        _, length, _, _, named = ZSTD_HEADER.unpack_from(head)
        check_identity(named, sha)
        return ZstdLayout(length)
    if head[:8] == MAGIC and len(head) >= HEADER.size:
        nblocks = HEADER.unpack_from(head)[3]
        start = HEADER.size + nblocks * DIGEST.size
        if len(head) < start and nblocks < 1 << 24:
            head += os.pread(fd, start - len(head), len(head))
    return layout_of(head, sha)


def part_data(fd: int, lo: int, hi: int, layout: Layout, sha: bytes) -> Chunk:
    """Bytes ``[lo, hi)`` of chunk ``sha`` in the open cache file ``fd``, whose
    layout is ``layout`` (from :func:`read_layout` or memory) — or, from a
    zstd-form file, which is read whole, all of the chunk's bytes (the caller
    tells by the length). Raises :class:`Damaged` if the blocks that hold them
    are damaged or missing."""
    if not 0 <= lo <= hi <= layout.length:
        raise Damaged(f"range {lo}-{hi} outside the chunk")
    if isinstance(layout, ZstdLayout):
        return whole_file(fd, sha)
    block = layout.block
    first, last = lo // block, blocks_of(hi, block)
    want = min(last * block, layout.length) - first * block
    data = os.pread(fd, want, layout.start + first * block)
    if len(data) != want:
        raise Damaged("file cut short")
    view = memoryview(data)
    for k, i in enumerate(range(0, want, block)):
        if xxh(view[i : i + block]) != layout.digest(first + k):
            raise Damaged(f"block {first + k} does not match its digest")
    return view[lo - first * block : hi - first * block]
