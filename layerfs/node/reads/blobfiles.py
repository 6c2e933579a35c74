"""Lazy blob files: a layer's logical data blob, read through its chunk table.

Plain classes the FUSE adapter calls; tests can use them without a mount. A
read maps its byte range to chunks, gets each (in parallel) from what the node
holds (``ChunkStates.read_held``: memory, a flight, the cache) or, on a miss,
from the fetcher, and answers with views of the overlapping slices, zeros for holes and
padding: a read inside one chunk copies nothing, any other read copies its
bytes once.
A blob file composes the two halves of the read path: the prefetch policy
(layerfs/node/reads/prefetch.py), which decides what to fetch besides what the read
wants, and the fetch core (layerfs/node/reads/fetcher.py), which gets the bytes and
knows no policy. Readahead is mostly the kernel's (EROFS and FUSE readahead
windows, see the daemon); a read tells whether it continues a stream and asks
the policy once what to read ahead; a small random
read of a cached chunk reads only the blocks it needs. A miss on a small
chunk may bring the chunks after it in its pack along (the miss span); a miss
at the start of a small file of several chunks fetches the file's other
chunks alongside (the file fetch-ahead), and a miss at the start of an ELF
file the libraries it names (the library fetch-ahead, once the layer's meta
image is known: :meth:`BlobFile.know_files`). The first touch of each chunk
is recorded in order (the layer's access trace).
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ...formats.chunktable import FILE_START, ChunkEntry, ChunkTable
from .chunkfile import Chunk
from .chunkstates import Claim
from .fetcher import Buffer, ChunkFetcher
from .libraryahead import LibraryAhead
from .prefetch import Prefetcher

STABLE_INODE_BASE = 1 << 60  # above the fixed directories' inodes
PART_READ_FRACTION = 4  # a random read of at most 1/4 of a cached chunk reads just that
MISS_NEIGHBOURS = 64  # at most this many following chunks come along with a miss
FILE_AHEAD = 4  # a miss at the start of a file of 2 to this many chunks fetches the rest
RECENT_READS = 32  # streams (read ends) remembered per blob to tell sequential reads
ZEROS = bytes(1 << 20)  # shared by every hole a read returns
BLOB_KIND, DISK_KIND = 0, 1


def stable_inode(name: str, kind: int) -> int:
    """The FUSE inode of blob or disk ``name``: the same in every daemon, since
    the kernel keeps the inodes (and the open files, whose fh is the inode) an
    earlier daemon gave out across a live restart (56 bits of a hash, so two
    names share one with odds of about 2^-56 per pair)."""
    digest = hashlib.sha256(name.encode()).digest()
    return STABLE_INODE_BASE | int.from_bytes(digest[:7], "big") << 1 | kind


def zeros(n: int) -> Buffer:
    """``n`` zero bytes, without allocating when ``n`` is at most 1 MiB."""
    return memoryview(ZEROS)[:n] if n <= len(ZEROS) else bytes(n)


def joined(parts: list[Buffer]) -> Buffer:
    """One buffer of the parts: the part itself when there is one, else one copy
    (``bytes.join`` allocates once and does not zero first)."""
    if len(parts) == 1:
        return parts[0]
    return b"".join(parts)


def laid_out(pieces: list[tuple[int, int, int]], datas: list[Buffer], off: int,
             end: int) -> list[Buffer]:
    """The pieces' bytes (``(index, lo, hi)`` blob ranges, in order) as the
    buffers of ``[off, end)``, with zeros where no piece covers it."""
    parts: list[Buffer] = []
    pos = off
    for (_, lo, hi), data in zip(pieces, datas, strict=True):
        if hi <= pos:  # entries never overlap in a valid table; never answer more
            continue
        if lo > pos:
            parts.append(zeros(lo - pos))
        parts.append(memoryview(data)[max(pos - lo, 0):])
        pos = hi
    if pos < end:
        parts.append(zeros(end - pos))
    return parts


@dataclass(eq=False)
class BlobFile:
    digest: str
    table: ChunkTable
    fetcher: ChunkFetcher
    inode: int
    policy: Prefetcher | None = None  # None: a policy of its own, without a miss span
    offsets: list[int] = field(default_factory=list)
    touched: set[int] = field(default_factory=set)
    trace: list[int] = field(default_factory=list)
    bytes_read: int = 0
    # end of a recent read → its stream's (reads, bytes) so far
    ends: dict[int, tuple[int, int]] = field(default_factory=dict)
    libraries: LibraryAhead | None = None  # once the layer's files are known

    def __post_init__(self) -> None:
        self.offsets = [e.blob_offset for e in self.table.entries]

    @property
    def prefetcher(self) -> Prefetcher:
        """The prefetch policy the blob's reads consult."""
        if self.policy is None:
            self.policy = Prefetcher(self.fetcher)
        return self.policy

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

    def know_files(self, meta_image: Path) -> None:
        """The layer's checked meta image on the node: its files' misses may
        fetch ahead by what the files are (the library fetch-ahead, if the
        policy has it on)."""
        if self.libraries is None and self.prefetcher.libraries:
            self.libraries = LibraryAhead(self.table, self.offsets, meta_image, self.fetcher,
                                          self.prefetcher)

    def note_read(self, indexes: list[int], size: int) -> None:
        """A read the kernel served from elsewhere (a partial blob file):
        its chunks join the access trace and its bytes the count."""
        self._record(indexes)
        self.bytes_read += size

    async def read(self, off: int, size: int) -> Buffer:
        """The bytes of ``[off, off + size)``: a view into the chunk when one
        chunk holds them all (no copy), else one new buffer (one copy)."""
        return joined(await self.read_parts(off, size))

    async def read_parts(self, off: int, size: int) -> list[Buffer]:
        """``[off, off + size)`` (cut at the end of the blob) as views into
        its chunks, in order, with zeros for holes; chunks come in parallel.
        A read that continues a stream reads ahead from the cache; a read that
        does not and needs a small part of a chunk gets only that part."""
        end = min(off + size, self.size)
        if off >= end:
            return []
        entries = self.table.entries
        pieces = [(i, max(off, e.blob_offset), min(end, e.blob_offset + e.length))
                  for i in self.span(off, end) if (e := entries[i]).blob_offset + e.length > off]
        pieces = [(i, lo, hi) for i, lo, hi in pieces if hi > lo]
        self._record([i for i, _, _ in pieces])
        self.bytes_read += end - off
        reads, streamed = self._stream(off, end)
        streaming = reads > 1
        if streaming and pieces:  # the policy's: what to read ahead
            policy = self.prefetcher
            plan = policy.plan(reads, streamed, self.table.chunk_size)
            last = pieces[-1][0]
            policy.read_ahead(entries[last + 1:last + 1 + plan.depth], plan)
        states = self.fetcher  # what the node holds, asked through the fetch core
        datas: list[Buffer] = [b""] * len(pieces)

        deadline = self.fetcher.deadline()  # the whole read's

        async def get(k: int) -> None:
            i, lo, hi = pieces[k]
            entry = entries[i]
            lo, hi = lo - entry.blob_offset, hi - entry.blob_offset
            small = not streaming and (hi - lo) * PART_READ_FRACTION <= entry.length
            part = (lo, hi) if small else None  # (then only its blocks of a cache file)
            got = await states.read_held(entry, deadline, part)  # memory, a flight, the cache
            if isinstance(got, Claim):  # a miss (its state looked at once): the store's
                got, part = await self._miss(i, lo == 0, got, deadline), None
            datas[k] = got if part is not None else memoryview(got)[lo:hi]

        if len(pieces) == 1:
            await get(0)
        elif pieces:
            async with trio.open_nursery() as nursery:
                for k in range(len(pieces)):
                    nursery.start_soon(get, k)
        return laid_out(pieces, datas, off, end)

    async def _miss(self, i: int, from_start: bool, claim: Claim, deadline: float) -> Chunk:
        """A miss of entry ``i`` (read from its first byte if ``from_start``),
        whose ``claim`` ``read_held`` made: the policy's miss span and the rest
        of its file, then the fetch core's store read."""
        first = from_start and self.table.entries[i].flags & FILE_START
        try:
            along = self._along(i)
            if first:
                self._fetch_rest_of_file(i, along)
        except BaseException:
            self.fetcher.release(claim)  # (no flight left led by no one)
            raise
        got = await self.fetcher.fetch(claim, along, deadline)
        if first and self.libraries is not None:
            self.libraries.missed(i, got)
        return got

    def _along(self, i: int) -> list[ChunkEntry]:
        """The chunks the policy's miss span brings along with a miss on entry
        ``i`` (none unless that chunk is small)."""
        policy, entries = self.prefetcher, self.table.entries
        if not policy.takes_neighbours(entries[i]):
            return []
        return policy.miss_run(entries[i], entries[i + 1:i + 1 + MISS_NEIGHBOURS])[1:]

    def _stream(self, off: int, end: int) -> tuple[int, int]:
        """How many reads in a row, this one included, ended where the next one
        started, and how many bytes they read ((1, its size) for a read that
        continues none; several streams may interleave). Remembers where this
        one ends."""
        reads, streamed = self.ends.pop(off, (0, 0))
        stream = self.ends[end] = (reads + 1, streamed + end - off)
        if len(self.ends) > RECENT_READS:
            del self.ends[next(iter(self.ends))]
        return stream

    def rest_of_file(self, i: int) -> list[int]:
        """The entries after entry ``i`` that continue its file
        (``ChunkTable.continuing``), if the file has at most ``FILE_AHEAD``
        chunks (else none: a larger file is the stream's readahead's). A file
        with no chunk of its own has no flagged entry and cannot be told from
        the file before it when that one ends on a full chunk, so at worst a
        few of its chunks come along."""
        rest = self.table.continuing(i, FILE_AHEAD)
        return [] if len(rest) == FILE_AHEAD else rest

    def _fetch_rest_of_file(self, i: int, along: list[ChunkEntry]) -> None:
        """On a miss of a file's first chunk (entry ``i``, read from its
        start) of a file of 2 to ``FILE_AHEAD`` chunks: the file's other
        absent chunks, fetched in the background, but for those the miss
        span brings ``along`` with the chunk. A program that reads a file
        from its start (a loader opening a library, a small file read whole)
        reads the rest of it next: one round trip, not one per chunk. A read
        that starts inside a file may want only that part."""
        entries, states = self.table.entries, self.fetcher
        brought = {e.sha256 for e in along}
        rest = [e for j in self.rest_of_file(i)
                if (e := entries[j]).sha256 not in brought and states.absent(e.sha256)]
        if rest:
            self.prefetcher.fetch_ahead(rest)

    def _record(self, indexes: list[int]) -> None:
        for i in indexes:
            if i not in self.touched:
                self.touched.add(i)
                self.trace.append(i)


class BlobDirectory:
    """The blob files the FUSE mount shows under ``blobs/``, by name and inode.

    Reference counted: a blob stays while any layer mount, disk or VM uses it.
    """

    def __init__(self, policy: Prefetcher | None = None) -> None:
        self.policy = policy  # the node's prefetch policy, given to each blob
        self.by_name: dict[str, BlobFile] = {}
        self.by_inode: dict[int, BlobFile] = {}
        self.users: dict[str, int] = {}

    @property
    def prefetcher(self) -> Prefetcher:
        """The node's prefetch policy (the whole-layer ones: ``--prefetch``)."""
        if self.policy is None:
            raise RuntimeError("no prefetch policy")
        return self.policy

    def add(self, digest: str, table: ChunkTable, fetcher: ChunkFetcher) -> BlobFile:
        name = digest.removeprefix("sha256:")
        blob = self.by_name.get(name)
        if blob is None:
            blob = BlobFile(digest, table, fetcher, stable_inode(name, BLOB_KIND), self.policy)
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
            if blob.libraries is not None:
                blob.libraries.close()
