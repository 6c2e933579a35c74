"""Lazy blob files: a layer's logical data blob, read through its chunk table.

Plain classes the FUSE adapter calls; tests can use them without a mount. A
read maps its byte range to chunks, gets each from the fetcher (in parallel),
copies the overlapping slices and leaves zeros for holes and padding.
Readahead is the kernel's (EROFS and FUSE readahead windows, see the
daemon); the first touch of each chunk is recorded in order (the layer's
access trace).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TypeAlias

import trio

from ..formats.chunktable import ChunkEntry, ChunkTable
from .fetcher import ChunkFetcher

FIRST_BLOB_INODE = 16
Buffer: TypeAlias = bytes | bytearray | memoryview


@dataclass(eq=False)
class BlobFile:
    digest: str
    table: ChunkTable
    fetcher: ChunkFetcher
    inode: int
    offsets: list[int] = field(default_factory=list)
    touched: set[int] = field(default_factory=set)
    trace: list[int] = field(default_factory=list)
    bytes_read: int = 0

    def __post_init__(self) -> None:
        self.offsets = [e.blob_offset for e in self.table.entries]

    @property
    def name(self) -> str:
        return self.digest.removeprefix("sha256:")

    @property
    def size(self) -> int:
        return self.table.blob_size

    def span(self, start: int, end: int) -> range:
        """Indexes of the chunk entries that overlap ``[start, end)``."""
        first = max(bisect.bisect_right(self.offsets, start) - 1, 0)
        last = bisect.bisect_left(self.offsets, end)
        return range(first, last)

    async def read(self, off: int, size: int) -> Buffer:
        """The bytes of ``[off, off + size)``; a view into the chunk when one
        chunk holds them all (no copy), else a new buffer."""
        end = min(off + size, self.size)
        if off >= end:
            return b""
        entries = self.table.entries
        wanted = [i for i in self.span(off, end)
                  if entries[i].blob_offset + entries[i].length > off]
        self._record(wanted)
        self.bytes_read += end - off
        if len(wanted) == 1:  # the common case: one chunk, one copy
            entry = entries[wanted[0]]
            data = await self.fetcher.get(entry)
            lo, hi = off - entry.blob_offset, end - entry.blob_offset
            if lo >= 0 and hi <= entry.length:
                return memoryview(data)[lo:hi]
        out = bytearray(end - off)

        async def copy(i: int) -> None:
            entry = entries[i]
            data = await self.fetcher.get(entry)
            lo = max(off, entry.blob_offset)
            hi = min(end, entry.blob_offset + entry.length)
            out[lo - off : hi - off] = data[lo - entry.blob_offset : hi - entry.blob_offset]

        if len(wanted) == 1:
            await copy(wanted[0])
        elif wanted:
            async with trio.open_nursery() as nursery:
                for i in wanted:
                    nursery.start_soon(copy, i)
        return out

    def _record(self, indexes: list[int]) -> None:
        for i in indexes:
            if i not in self.touched:
                self.touched.add(i)
                self.trace.append(i)

    def entries_in_order(self, order: list[int]) -> list[ChunkEntry]:
        n = len(self.table.entries)
        return [self.table.entries[i] for i in order if 0 <= i < n]


class BlobDirectory:
    """The blob files the FUSE mount shows under ``blobs/``, by name and inode.

    Reference counted: a blob stays while any layer mount, disk or VM uses it.
    """

    def __init__(self) -> None:
        self.by_name: dict[str, BlobFile] = {}
        self.by_inode: dict[int, BlobFile] = {}
        self.users: dict[str, int] = {}
        # a name keeps its inode for the daemon's life: the kernel caches entries
        self._inodes: dict[str, int] = {}

    def add(self, digest: str, table: ChunkTable, fetcher: ChunkFetcher) -> BlobFile:
        name = digest.removeprefix("sha256:")
        blob = self.by_name.get(name)
        if blob is None:
            inode = self._inodes.setdefault(name, FIRST_BLOB_INODE + len(self._inodes))
            blob = BlobFile(digest, table, fetcher, inode)
            self.by_name[name] = blob
            self.by_inode[blob.inode] = blob
        self.users[name] = self.users.get(name, 0) + 1
        return blob

    def remove(self, digest: str) -> None:
        name = digest.removeprefix("sha256:")
        left = self.users.get(name, 0) - 1
        if left > 0:
            self.users[name] = left
            return
        self.users.pop(name, None)
        blob = self.by_name.pop(name, None)
        if blob is not None:
            self.by_inode.pop(blob.inode, None)
