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

import bisect
import logging
import os
import posixpath
from pathlib import Path

import trio

from ...formats.chunktable import ChunkTable
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
FOLLOWS_AT_ONCE = 8  # files of one blob read and looked up at once
SEARCH_DIRS_MAX = 16  # of a file's own search path (DT_RUNPATH/DT_RPATH), the first ones
LOOKUPS_MAX = 256  # path lookups for one file's names
LOADER_CACHE = "/etc/ld.so.cache"  # what glibc's loader reads first (a file of the layer)
FILE_CHUNKS_MAX = 4096  # chunks of a program found by place (the chunk table alone)
# where the loader looks after the file's own search path ({ma}: the multiarch name)
LIBRARY_DIRS = ("/lib/{ma}", "/usr/lib/{ma}", "/lib64", "/usr/lib64", "/lib", "/usr/lib",
                "/usr/local/lib/{ma}", "/usr/local/lib")


class LibraryAhead:
    """One layer blob's library fetch-ahead, over the layer's meta image."""

    def __init__(self, table: ChunkTable, offsets: list[int], meta_image: Path,
                 fetcher: ChunkFetcher, policy: Prefetcher) -> None:
        """``offsets``: the entries' blob offsets, in order (the blob's);
        ``meta_image``: the layer's checked meta image on the node, opened
        for each batch of lookups (no descriptor held between them)."""
        self.table = table
        self.entries = table.entries
        self.chunk_size = table.chunk_size
        self.offsets = offsets
        self.meta_image = meta_image
        self.lookup: MetaLookup | None = None  # made at the first batch (its listings kept)
        self.fetcher = fetcher
        self.policy = policy
        self.followed: set[int] = set()  # first entries of the files followed
        self.lookups = trio.CapacityLimiter(1)  # the meta image's lookups: one thread
        self.follows = trio.CapacityLimiter(FOLLOWS_AT_ONCE)
        self.closed = False  # the blob is gone: nothing more is started
        self.warnings = RateLimitedLog(log)

    def close(self) -> None:
        """The blob is no longer served: follows end at their next step."""
        self.closed = True

    def missed(self, i: int, data: Buffer) -> None:
        """A reader's miss of entry ``i``, a file's first chunk read from its
        start, whose bytes are ``data``: followed in the background if it is an
        ELF file not followed yet."""
        if (self.closed or i in self.followed or len(self.followed) >= FOLLOWED_MAX
                or not is_elf(data)):
            return
        self.followed.add(i)
        self.policy.tasks.start_soon(self._follow, self._by_place(i), None, 0, data)

    def _by_place(self, i: int) -> list[int | None]:
        """The entries of the file whose first chunk is entry ``i``, as far as
        the chunk table tells (``ChunkTable.continuing``)."""
        return [i, *self.table.continuing(i, FILE_CHUNKS_MAX)]

    async def _follow(self, chunks: list[int | None], origin: str | None, depth: int,
                      first: Buffer | None = None) -> None:
        """Read the needs of the file made of ``chunks`` (in ``origin``, its
        directory, if known), fetch the libraries it names and follow them.
        Whatever goes wrong ends this file's following only: a hint lost."""
        try:
            async with self.follows:
                if self.closed:
                    return
                wants = await self._needs(chunks, first)
                if wants is not None and not self.closed:
                    await self._fetch_needs(wants, origin, depth)
        except (FetchError, OSError):  # the loader's reads fetch as they would have
            pass
        except Exception as exc:  # never the daemon's end: one line (rate-limited)
            self.warnings.warning("bug", "library fetch-ahead of a file failed: %r", exc)

    async def _fetch_needs(self, wants: ElfNeeds, origin: str | None, depth: int) -> None:
        """The libraries ``wants`` names that the layer holds and no one has
        followed: fetched ahead, then followed one level deeper."""
        located = await trio.to_thread.run_sync(self._locate_all, wants, origin,
                                                limiter=self.lookups, abandon_on_cancel=True)
        found: dict[int, tuple[str, list[int]]] = {}
        for where, files in located:
            if files[0] not in self.followed and len(self.followed) < FOLLOWED_MAX:
                self.followed.add(files[0])
                found[files[0]] = (where, files)
        wanted = sorted((self.entries[j] for _, files in found.values()
                         for j in (files if len(files) <= WHOLE_CHUNKS else files[:1])
                         if self.fetcher.absent(self.entries[j].sha256)),
                        key=lambda e: (e.pack, e.pack_offset))
        if wanted:
            log.debug("library fetch-ahead: %d chunks of %r", len(wanted),
                      [where for where, _ in found.values()])
            self.policy.fetch_ahead(wanted)  # by place: neighbours in one range read
        if depth + 1 < DEPTH:
            for where, files in found.values():
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
        hole or a chunk the table lacks); at most ``LOOKUPS_MAX`` lookups."""
        fd = os.open(self.meta_image, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            def read(offset: int, length: int) -> bytes:
                return os.pread(fd, length, offset)

            if self.lookup is None:
                self.lookup = MetaLookup(read)
            self.lookup.read = read
            budget = [LOOKUPS_MAX]
            out = []
            # a program's loader reads its cache of library paths before any library
            names = ([wants.interp, LOADER_CACHE] if wants.interp else []) + wants.needed
            for name in dict.fromkeys(names):
                found = self._locate(self.lookup, name, self._dirs(wants, origin), budget)
                if found is not None:
                    out.append(found)
            return out
        finally:
            os.close(fd)

    @staticmethod
    def _dirs(wants: ElfNeeds, origin: str | None) -> list[str]:
        """Where the loader looks for a bare name: the file's own search path
        (``$ORIGIN`` as its directory, when known), then the system's."""
        own = [d.replace("${ORIGIN}", origin).replace("$ORIGIN", origin) if origin else d
               for d in wants.search]
        system = [d.format(ma=wants.multiarch) for d in LIBRARY_DIRS
                  if wants.multiarch or "{ma}" not in d]
        dirs = [d for d in own if d.startswith("/") and "$" not in d][:SEARCH_DIRS_MAX]
        return list(dict.fromkeys(dirs + system))

    def _locate(self, lookup: MetaLookup, name: str, dirs: list[str], budget: list[int]
                ) -> tuple[str, list[int]] | None:
        if "/" in name:
            candidates = [name] if name.startswith("/") else []
        else:
            candidates = [posixpath.join(d, name) for d in dirs]
        for path in candidates:
            if budget[0] <= 0:
                return None
            budget[0] -= 1
            found = lookup.file_chunks(path)
            if found is None:
                continue
            where, blocks = found
            files = [None if b == HOLE else self._entry_at(b * BLOCK) for b in blocks]
            if files and None not in files:
                return where, [j for j in files if j is not None]
            return None  # the loader takes the first it finds: a hole, or not in this blob
        return None

    def _entry_at(self, offset: int) -> int | None:
        """The entry that starts at blob ``offset``, if one does."""
        j = bisect.bisect_left(self.offsets, offset)
        return j if j < len(self.offsets) and self.offsets[j] == offset else None
