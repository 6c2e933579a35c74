"""Library fetch-ahead: the shared libraries a program loads next, fetched
before the loader asks for them.

A program's start on a layer the node has not read is a chain of misses,
one after another: the loader reads the program, then each library it
names, then theirs, each a store round trip while the program waits (of the
38 misses of a Debian start that runs ``apt-get``, ``dpkg``, ``perl`` and
``bash``, 30 are ELF files, 22 of them libraries). When a reader misses a
file's first chunk from its start and the chunk is an ELF file, the blob's
:class:`LibraryAhead` reads the file's interpreter and ``DT_NEEDED`` names
(:mod:`layerfs.formats.elfdeps`), finds each in the layer's meta image as the
loader would (``DT_RUNPATH``/``DT_RPATH`` with ``$ORIGIN``, then the
multiarch and default directories; :class:`~layerfs.formats.erofsread.MetaLookup`),
and fetches those libraries at once in the background (whole up to
``WHOLE_CHUNKS`` chunks, else the first chunk), with the loader's cache
(``/etc/ld.so.cache``) for a program that names a loader; as each library's chunks come
in, its own names are followed, up to ``DEPTH`` levels. The loader then finds
them in flight or held: a chain of ``DEPTH`` round trips at most instead of
one per library.

Bounds: each file of the blob is followed once (``FOLLOWED_MAX`` at most per
blob), at most ``elfdeps.MAX_NEEDED`` names each; names resolve inside the
layer only (a library in another layer of the sandbox is left to its miss).
A guess costs a fetch and never changes what a read returns: the fetched
chunks are checked like any other. Off with ``--no-library-ahead``.
"""

from __future__ import annotations

import logging
import posixpath

import trio

from ...formats.chunktable import FILE_START, ChunkTable
from ...formats.elfdeps import ElfNeeds, NeedBytes, is_elf, needs
from ...formats.erofs import BLOCK
from ...formats.erofsread import MetaLookup
from ...ratelog import RateLimitedLog
from ...tree import HOLE
from .chunkstates import FetchError
from .fetcher import Buffer, ChunkFetcher
from .prefetch import Prefetcher

log = logging.getLogger(__name__)

DEPTH = 6  # levels of libraries followed below the program that missed
WHOLE_CHUNKS = 4  # a library of at most this many chunks is fetched whole
FOLLOWED_MAX = 4096  # files followed per blob
LOADER_CACHE = "/etc/ld.so.cache"  # what glibc's loader reads first (a file of the layer)
FILE_CHUNKS_MAX = 4096  # chunks of a program found by place (the chunk table alone)
# where the loader looks after the file's own search path ({ma}: the multiarch name)
LIBRARY_DIRS = ("/lib/{ma}", "/usr/lib/{ma}", "/lib64", "/usr/lib64", "/lib", "/usr/lib",
                "/usr/local/lib/{ma}", "/usr/local/lib")


class LibraryAhead:
    """One layer blob's library fetch-ahead, over the layer's meta image."""

    def __init__(self, table: ChunkTable, lookup: MetaLookup, fetcher: ChunkFetcher,
                 policy: Prefetcher) -> None:
        self.entries = table.entries
        self.chunk_size = table.chunk_size
        self.lookup = lookup
        self.fetcher = fetcher
        self.policy = policy
        self.at = {e.blob_offset: i for i, e in enumerate(self.entries)}
        self.followed: set[int] = set()  # first entries of the files followed
        self.lookups = trio.CapacityLimiter(1)  # the meta image's listings: one thread
        self.warnings = RateLimitedLog(log)

    def missed(self, i: int, data: Buffer) -> None:
        """A reader's miss of entry ``i``, a file's first chunk read from its
        start, whose bytes are ``data``: followed in the background if it is an
        ELF file not followed yet."""
        if i in self.followed or len(self.followed) >= FOLLOWED_MAX or not is_elf(data):
            return
        self.followed.add(i)
        self.policy.tasks.start_soon(self._follow, self._by_place(i), None, 0, data)

    def _by_place(self, i: int) -> list[int | None]:
        """The entries of the file whose first chunk is entry ``i``, as far as
        the chunk table tells: full chunks one after another, none flagged as
        a file's start (see ``BlobFile.rest_of_file``)."""
        chunks: list[int | None] = [i]
        entries, size = self.entries, self.chunk_size
        for j in range(i + 1, min(len(entries), i + FILE_CHUNKS_MAX)):
            prev, nxt = entries[j - 1], entries[j]
            if (nxt.flags & FILE_START or prev.length != size
                    or nxt.blob_offset != prev.blob_offset + size):
                break
            chunks.append(j)
        return chunks

    async def _follow(self, chunks: list[int | None], origin: str | None, depth: int,
                      first: Buffer | None = None) -> None:
        """Read the needs of the file made of ``chunks`` (in ``origin``, its
        directory, if known), fetch the libraries it names and follow them.
        Whatever goes wrong ends this file's following only: a hint lost."""
        try:
            wants = await self._needs(chunks, first)
            if wants is not None:
                await self._fetch_needs(wants, origin, depth)
        except (FetchError, OSError):  # the loader's reads fetch as they would have
            pass
        except Exception as exc:  # never the daemon's end: one line (rate-limited)
            self.warnings.warning("bug", "library fetch-ahead of a file failed: %r", exc)

    async def _fetch_needs(self, wants: ElfNeeds, origin: str | None, depth: int) -> None:
        """The libraries ``wants`` names that the layer holds and no one has
        followed: fetched ahead, then followed one level deeper."""
        found = await trio.to_thread.run_sync(self._locate_all, wants, origin,
                                              limiter=self.lookups)
        found = [(where, files) for where, files in found if files[0] not in self.followed
                 and len(self.followed) < FOLLOWED_MAX]
        self.followed |= {files[0] for _, files in found}
        wanted = [self.entries[j] for _, files in found
                  for j in (files if len(files) <= WHOLE_CHUNKS else files[:1])]
        wanted = sorted((e for e in wanted if self.fetcher.absent(e.sha256)),
                        key=lambda e: (e.pack, e.pack_offset))
        if wanted:
            log.debug("library fetch-ahead: %d chunks of %s", len(wanted),
                      ", ".join(where for where, _ in found))
            self.policy.fetch_ahead(wanted)  # by place: neighbours in one read
        if depth + 1 < DEPTH:
            for where, files in found:
                self.policy.tasks.start_soon(self._follow, files, posixpath.dirname(where),
                                             depth + 1)

    async def _needs(self, chunks: list[int | None], first: Buffer | None) -> ElfNeeds | None:
        """The file's needs, its chunks fetched as the reading asks for them."""
        held: dict[int, Buffer] = {} if first is None else {0: first}
        for _ in range(len(chunks) + 1):
            try:
                return needs(lambda offset, length: self._read(chunks, held, offset, length))
            except NeedBytes as need:
                k = need.offset // self.chunk_size
                if k >= len(chunks) or k in held or (j := chunks[k]) is None:
                    return None
                held[k] = await self.fetcher.get(self.entries[j])
        return None

    def _read(self, chunks: list[int | None], held: dict[int, Buffer], offset: int,
              length: int) -> bytes:
        """``[offset, +length)`` of the file from the chunks held (shorter at
        its end); NeedBytes for a chunk not held yet."""
        out = bytearray()
        at, end = offset, offset + length
        while at < end:
            k, inside = divmod(at, self.chunk_size)
            if k >= len(chunks):
                break
            if k not in held:
                raise NeedBytes(at)
            piece = memoryview(held[k])[inside:inside + end - at]
            if not piece:
                break
            out += piece
            at += len(piece)
        return bytes(out)

    def _locate_all(self, wants: ElfNeeds, origin: str | None
                    ) -> list[tuple[str, list[int]]]:
        """Worker thread: each named library the layer holds, as the loader
        would find it: its path and entries (whole files only: none with a
        hole or a chunk the table lacks)."""
        out = []
        # a program's loader reads its cache of library paths before any library
        names = ([wants.interp, LOADER_CACHE] if wants.interp else []) + wants.needed
        for name in names:
            found = self._locate(name, wants, origin)
            if found is not None:
                out.append(found)
        return out

    def _locate(self, name: str, wants: ElfNeeds, origin: str | None
                ) -> tuple[str, list[int]] | None:
        if "/" in name:
            candidates = [name] if name.startswith("/") else []
        else:
            dirs = [d.replace("$ORIGIN", origin).replace("${ORIGIN}", origin)
                    if origin else d for d in wants.search]
            dirs += [d.format(ma=wants.multiarch) for d in LIBRARY_DIRS
                     if wants.multiarch or "{ma}" not in d]
            candidates = [posixpath.join(d, name) for d in dirs
                          if d.startswith("/") and "$" not in d]
        for path in candidates:
            found = self.lookup.file_chunks(path)
            if found is None:
                continue
            where, blocks = found
            files = [self.at.get(b * BLOCK) if b != HOLE else None for b in blocks]
            if files and None not in files:
                return where, [j for j in files if j is not None]
            return None  # the loader takes the first it finds: a hole, or not in this blob
        return None
