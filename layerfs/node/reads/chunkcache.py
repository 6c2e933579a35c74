"""The node's chunk cache: content addressed, bounded, LRU, crash safe.

One file per chunk, ``ROOT/cache/<sha[:2]>/<sha>``, laid out and checked as
:mod:`~layerfs.node.reads.chunkfile` says. With ``compressed`` (the daemon's
``--cache-form stored``), a chunk the store holds zstd-compressed is kept as
that frame (fewer bytes written and kept; each read of the file
decompresses it), others decompressed; files of both forms are read whatever
the setting. Every read checks that the file holds
the chunk asked for (the sha256 in its header), a whole read checks the whole
chunk's xxh3-64, a read of part of a chunk (``read_range``, a random small
read) reads and checks only the 16 KiB blocks that hold it (the block digests
of recently used files are kept in memory, so that is one read of the file).
Files are written to a temporary name and renamed into place, and every read
is checked, so a torn or corrupted file, or one of another chunk, is never
served: it is removed, counted as ``corrupt``, logged, and reported as a miss
(the chunk is fetched again); a file of an earlier format is removed the same
way, counted as ``outdated``. A file system that is full (ENOSPC: the
sandboxes' upper directories share it) makes the cache evict its least
recently used files and try again, twice at most; then the chunk, fetched
and verified, is served from memory without a cache file (``not_cached``).
The daemon also lowers the bound at start to what the file system has room
for (:meth:`ChunkCache.cap`). The
LRU order lives in memory and is rebuilt at start from the files' access
stamps; the cache is shared by every layer and version, since equal bytes
have equal sha256.

Thread safety: every public method may be called from any thread; one lock
guards the LRU index, the block layouts and the counters, never file I/O.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from ...sizes import NO_SPACE
from .chunkfile import (
    Chunk,
    Layout,
    OldFormat,
    Unusable,
    ZstdLayout,
    file_header,
    file_size,
    layout_of,
    part_data,
    read_layout,
    whole_file,
    zstd_file_size,
    zstd_header,
)

log = logging.getLogger(__name__)

LAYOUTS = 16384  # block layouts kept in memory (about 0.5 KiB each for 1 MiB chunks)
NO_SPACE_RETRIES = 2  # evictions and new tries of a write that found no room
ROOM = 4 << 20  # bytes evicted at least before each of them


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    bytes_fetched: int = 0  # bytes of chunks fetched from the store (uncompressed)
    bytes_written: int = 0  # bytes written to cache files
    evictions: int = 0
    corrupt: int = 0  # cache files found damaged (or holding another chunk) and dropped
    outdated: int = 0  # cache files of an earlier format, dropped
    entries: int = 0
    size: int = 0  # bytes in cache files
    limit: int = 0
    no_space_evictions: int = 0  # times the file system was full and files were evicted
    not_cached: int = 0  # chunks served but not cached: the file system stayed full

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class ChunkCache:
    """Chunk bytes by sha256, bounded by ``limit`` bytes of files."""

    def __init__(self, root: str | os.PathLike[str], limit: int,
                 compressed: bool = False) -> None:
        self.root = Path(root)
        self.tmp = self.root / "tmp"
        self.limit = limit
        self.compressed = compressed
        self._plain: Counter[str] = Counter()  # sha hex → users: kept plain even if compressed
        self.stats = CacheStats(limit=limit)
        self._lru: OrderedDict[str, int] = OrderedDict()  # sha hex → file size
        # sha hex → block layout of its file, for the most recently used files
        self._layouts: OrderedDict[str, Layout] = OrderedDict()
        self._lock = threading.Lock()
        self._reserved = 0  # bytes of files being written
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._load()

    def _path(self, sha: str) -> Path:
        return self.root / sha[:2] / sha

    def _load(self) -> None:
        """Index the files left by an earlier run, oldest access first."""
        for stale in self.tmp.iterdir():
            stale.unlink(missing_ok=True)
        found = []
        for sub in self.root.iterdir():
            if sub.name == "tmp" or not sub.is_dir():
                continue
            for f in sub.iterdir():
                st = f.stat()
                found.append((st.st_atime_ns, f.name, st.st_size))
        for _, sha, size in sorted(found):
            self._lru[sha] = size
            self.stats.size += size
        self.stats.entries = len(self._lru)
        self._evict()

    def contains(self, sha: str) -> bool:
        with self._lock:
            return sha in self._lru

    def read(self, sha: str) -> Chunk | None:
        """The chunk's bytes if cached and intact, else None (a miss)."""
        return self._counted(sha, lambda fd: whole_file(fd, bytes.fromhex(sha)))

    def read_range(self, sha: str, lo: int, hi: int) -> Chunk | None:
        """Bytes ``[lo, hi)`` of the chunk, reading and checking only the
        blocks that hold them; None on a miss (or a damaged file, dropped).
        A zstd-form file is read whole: then all of the chunk's bytes."""
        return self._counted(sha, lambda fd: part_data(fd, lo, hi, self._layout(sha, fd),
                                                       bytes.fromhex(sha)))

    def reads_whole(self, sha: str) -> bool:
        """Whether a read of part of the chunk must read and decompress all of
        its file (a zstd-form file whose layout is in memory); no I/O."""
        with self._lock:
            return isinstance(self._layouts.get(sha), ZstdLayout)

    def _layout(self, sha: str, fd: int) -> Layout:
        """The block layout of the chunk's file: from memory (learnt from this
        chunk's bytes), else its header, which must name the chunk."""
        with self._lock:
            layout = self._layouts.get(sha)
            if layout is not None:
                self._layouts.move_to_end(sha)
                return layout
        layout = read_layout(fd, bytes.fromhex(sha))
        self._remember(sha, layout)
        return layout

    def _remember(self, sha: str, layout: Layout) -> None:
        with self._lock:
            if sha not in self._lru:
                return
            self._layouts[sha] = layout
            while len(self._layouts) > LAYOUTS:
                self._layouts.popitem(last=False)

    def _counted(self, sha: str, read: Callable[[int], Chunk]) -> Chunk | None:
        """``read`` of the chunk's open cache file, counted as a hit or a miss."""
        with self._lock:
            known = sha in self._lru
            if known:
                self._lru.move_to_end(sha)
        data = self._read_checked(sha, read) if known else None
        with self._lock:
            if data is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
        return data

    def _read_checked(self, sha: str, read: Callable[[int], Chunk]) -> Chunk | None:
        """``read`` of the cache file; a file gone is forgotten, an unusable one dropped."""
        path = self._path(sha)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._forget(sha)
            return None
        try:
            return read(fd)
        except Unusable as exc:
            self._unusable(sha, path, os.fstat(fd).st_ino, exc)
            return None
        finally:
            os.close(fd)

    def _unusable(self, sha: str, path: Path, inode: int, exc: Unusable) -> None:
        """Drop a file that must not be served (its inode ``inode``); count and
        log it once, though several readers may find the same file bad."""
        try:
            if os.stat(path).st_ino != inode:
                return  # already dropped, and fetched again, by another reader
        except FileNotFoundError:
            return
        old = isinstance(exc, OldFormat)
        with self._lock:
            if self._forget_locked(sha) is None:
                return  # another reader dropped it first
            if old:
                self.stats.outdated += 1
            else:
                self.stats.corrupt += 1
            first_old = old and self.stats.outdated == 1
        path.unlink(missing_ok=True)
        if not old:
            log.warning("cache file %s is damaged (%s); dropped, will refetch", path, exc)
        elif first_old:
            log.info("cache files of an earlier format (%s) are dropped and fetched again", exc)

    def keep_plain(self, shas: Iterable[str]) -> None:
        """Chunks read in parts (a block layer's: a guest's disk or RAM): their
        files are written plain even in a ``compressed`` cache, where every
        read of a part would decompress the whole frame again."""
        self._plain.update(shas)

    def forget_plain(self, shas: Iterable[str]) -> None:
        """Undo one :meth:`keep_plain` of ``shas``."""
        self._plain.subtract(shas)
        self._plain = +self._plain

    def write(self, sha: str, data: Chunk, stored: Chunk | None = None) -> None:
        """Store verified chunk bytes (``stored``: the zstd frame they were
        fetched as, if they were, kept instead if the cache is ``compressed``).
        Room is made first (least recently used chunks evicted, the new file's
        size reserved), so the files on disk, temporary ones included, stay
        within the limit."""
        frame = stored if self.compressed and sha not in self._plain else None
        size = file_size(len(data)) if frame is None else zstd_file_size(len(frame))
        with self._lock:
            if sha in self._lru:
                return
            self._reserved += size
        try:
            self._evict()
            if frame is None:
                header = file_header(bytes.fromhex(sha), data)
            else:
                header = zstd_header(bytes.fromhex(sha), len(data), frame)
            self._store_file(sha, header, data if frame is None else frame, size)
        finally:
            with self._lock:
                self._reserved -= size
        with self._lock:
            if sha not in self._lru:
                self._lru[sha] = size
                self.stats.size += size
                self.stats.entries += 1
            self.stats.bytes_written += size
        self._remember(sha, layout_of(header, bytes.fromhex(sha)) if frame is None
                       else ZstdLayout(len(data)))

    def _store_file(self, sha: str, header: bytes, body: Chunk, size: int) -> None:
        """Write the chunk's file; on a full file system (ENOSPC), evict least
        recently used files and try again, NO_SPACE_RETRIES times at most, then
        give up (the OSError, counted in ``not_cached``): the chunk is served
        from memory, just not kept."""
        for attempt in range(NO_SPACE_RETRIES + 1):
            try:
                self._put_file(sha, header, body)
                return
            except OSError as exc:
                if exc.errno not in NO_SPACE or attempt == NO_SPACE_RETRIES \
                        or not self.make_room(max(2 * size, ROOM)):
                    if exc.errno in NO_SPACE:
                        with self._lock:
                            self.stats.not_cached += 1
                    raise

    def _put_file(self, sha: str, header: bytes, body: Chunk) -> None:
        """The file, through a temporary name (removed if a step fails)."""
        path = self._path(sha)
        path.parent.mkdir(exist_ok=True)
        tmp = self.tmp / f"{sha}.{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(body)
            os.rename(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def make_room(self, nbytes: int) -> bool:
        """Evict least recently used files of at least ``nbytes`` in all (the
        file system is full); False if the cache had none to evict."""
        with self._lock:
            if not self._lru:
                return False
            self.stats.no_space_evictions += 1
            target = self.stats.size - nbytes
        self._evict(target)
        return True

    def cap(self, limit: int) -> None:
        """Lower the bound to ``limit`` bytes (what ROOT's file system has room
        for: the daemon's start), evicting down to it."""
        with self._lock:
            self.limit = self.stats.limit = min(self.limit, max(0, limit))
        self._evict()

    def note_miss(self) -> None:
        """A lookup that found no entry in the index (and so read no file)."""
        with self._lock:
            self.stats.misses += 1

    def note_fetched(self, nbytes: int) -> None:
        with self._lock:
            self.stats.bytes_fetched += nbytes

    def _forget(self, sha: str) -> None:
        with self._lock:
            self._forget_locked(sha)

    def _forget_locked(self, sha: str) -> int | None:
        """Take the chunk out of the index (lock held); its file size, if it was in."""
        self._layouts.pop(sha, None)
        size = self._lru.pop(sha, None)
        if size is not None:
            self.stats.size -= size
            self.stats.entries -= 1
        return size

    def discard(self, sha: str) -> int:
        """Remove the chunk's file, if cached; the bytes it held."""
        with self._lock:
            size = self._forget_locked(sha)
        if size is None:
            return 0
        self._path(sha).unlink(missing_ok=True)
        return size

    def _evict(self, limit: int | None = None) -> None:
        """Evict least recently used files until the files and those being
        written fit ``limit`` bytes (default: the cache's bound)."""
        victims = []
        with self._lock:
            bound = self.limit if limit is None else min(limit, self.limit)
            while self.stats.size + self._reserved > bound and self._lru:
                sha, size = self._lru.popitem(last=False)
                self._layouts.pop(sha, None)
                self.stats.size -= size
                self.stats.entries -= 1
                self.stats.evictions += 1
                victims.append(sha)
        for sha in victims:
            self._path(sha).unlink(missing_ok=True)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return self.stats.as_dict()
