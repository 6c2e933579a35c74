"""Chunk pipeline: hash, dedup, compress and pack file data; upload the packs.

File data is cut into fixed-size chunks. Worker threads hash each chunk
(sha256 of the uncompressed bytes) and compress it with zstd unless it is
already known; the calling thread settles chunks strictly in submission order,
so blob addresses, and with them the meta image, do not depend on thread
timing. A chunk is, in this order of preference: a hole (all zeros, not
stored), a repeat of a chunk earlier in this layer (same blob address), a
chunk already in the store (referenced where it is), or new (appended to the
current pack). Full packs are uploaded by a small thread pool while the build
goes on. Before the build publishes, :meth:`ChunkPipeline.finish` refreshes every
pack it reuses (and its own packs written long ago), so that gc's grace period
covers them until the ref is written (docs/dev/builder.md, "gc and concurrent pushes").

The first store call of the pipeline that fails ends the build: uploads and
refreshes not yet started are not sent, the next chunk raises its error, and
the calls in flight end by the store's deadline (layerfs/store/base.py), so a
push whose store makes no progress ends within about its ``--timeout``.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import IO, TypeVar

import zstandard

from layerfs.errors import BlobVanished
from layerfs.formats.chunktable import FILE_START, RAW, ZSTD, ChunkEntry, ChunkTable
from layerfs.manifest import ChunkStats
from layerfs.store.base import Store, sha256_digest
from layerfs.tree import HOLE

BLOCK = 4096
DEFAULT_CHUNK_SIZE = 1 << 20
DEFAULT_PACK_SIZE = 16 << 20
ZSTD_LEVEL = 3
FRESH_SECONDS = 60.0  # own packs written this recently are not refreshed again
REFRESH_WORKERS = 8
T = TypeVar("T")


class DedupIndex:
    """sha256 → where a chunk with those bytes is already stored; with ``below``,
    that index's chunks too (looked up, not copied: an import adds each layer's
    table once to one index that every later layer's build looks in)."""

    def __init__(self, below: DedupIndex | None = None) -> None:
        self.chunks: dict[bytes, ChunkEntry] = {}
        self.below = below
        self.sources: dict[bytes, str] = {}  # sha256 → the ref of the table that added it
        self.refs: dict[str, int] = {}  # those refs, numbered in the order added

    def add_table(self, table: ChunkTable, source: str = "") -> None:
        if source:
            self.refs.setdefault(source, len(self.refs))
        for entry in table.entries:
            if entry.sha256 not in self.chunks:
                self.chunks[entry.sha256] = entry
                if source:
                    self.sources[entry.sha256] = source

    def get(self, sha: bytes) -> ChunkEntry | None:
        found = self.chunks.get(sha)
        if found is None and self.below is not None:
            return self.below.get(sha)
        return found

    def __contains__(self, sha: bytes) -> bool:
        return self.get(sha) is not None

    def sources_of(self, table: ChunkTable) -> list[str]:
        """The refs whose tables (added with a source) supplied chunks of ``table``
        (a table built with this index), in the order they were added."""
        used = {self.sources[e.sha256] for e in table.entries if e.sha256 in self.sources}
        return sorted(used, key=self.refs.__getitem__)


@dataclass
class _Pending:
    file: int | None  # EROFS mode: the number of the file whose chunk slot this fills
    slot: int  # chunk slot of that file, or the blob offset in linear mode
    length: int
    future: Future
    flags: int = 0


@dataclass
class _Digested:
    sha: bytes
    zero: bool
    payload: bytes | None
    compression: int


@dataclass
class _NewLocation:
    pack_no: int  # index into this build's packs
    pack_offset: int
    stored_length: int
    compression: int


@dataclass
class PipelineResult:
    table: ChunkTable
    blob_blocks: int
    stats: ChunkStats = field(default_factory=ChunkStats)
    reused: set[str] = field(default_factory=set)  # packs refreshed, not written, by this push
    file_chunks: list[list[int]] = field(default_factory=list)  # by file number: blob addresses


class ChunkPipeline:
    """Turns file streams into chunk addresses and uploaded packs."""

    def __init__(
        self,
        store: Store,
        index: DedupIndex,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        upload: bool = True,
        pack_size: int = DEFAULT_PACK_SIZE,
        workers: int = 2,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.index = index
        self.chunk_size = chunk_size
        self.upload = upload
        self.pack_size = max(pack_size, chunk_size)
        self.on_bytes = on_bytes
        self.stats = ChunkStats()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="chunk")
        self._uploads = ThreadPoolExecutor(2, thread_name_prefix="upload")
        self._upload_slots = threading.Semaphore(3)
        self._upload_futures: list[Future] = []
        self._failure: BaseException | None = None  # the first failed store call's error
        self._failure_lock = threading.Lock()
        self._inflight: deque[_Pending] = deque()
        self._max_inflight = 4 * workers + 2
        self._local = threading.local()
        self._zero_sha: dict[int, bytes] = {}
        self._layer_addr: dict[bytes, int] = {}  # sha → blob block address (EROFS mode)
        self._stored: dict[bytes, ChunkEntry | _NewLocation] = {}  # sha → where it is stored
        self._placed: list[tuple[int, int, bytes, int]] = []  # (blob offset, length, sha, flags)
        self._blob_end = 0
        self._pack = bytearray()
        self._pack_digests: list[str] = []
        self._written_at: dict[str, float] = {}  # own pack → when its put_blob started
        self._reused: set[str] = set()  # packs this push found stored and refreshed
        self._found: set[str] = set()  # own packs put_blob found already stored
        self._next_block = 0
        self._file_chunks: list[list[int]] = []  # EROFS mode, by file number
        self._files_placed: set[int] = set()  # EROFS mode: files with a chunk in the blob

    # -- worker side --
    def _compressor(self) -> zstandard.ZstdCompressor:
        comp = getattr(self._local, "zstd", None)
        if comp is None:
            comp = self._local.zstd = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        return comp

    def _zero_digest(self, length: int) -> bytes:
        sha = self._zero_sha.get(length)
        if sha is None:
            sha = self._zero_sha[length] = hashlib.sha256(bytes(length)).digest()
        return sha

    def _digest(self, data: bytes) -> _Digested:
        sha = hashlib.sha256(data).digest()
        if sha == self._zero_digest(len(data)):
            return _Digested(sha, True, None, RAW)
        if sha in self._stored or sha in self.index:
            return _Digested(sha, False, None, RAW)
        packed = self._compressor().compress(data)
        if len(packed) < len(data):
            return _Digested(sha, False, packed, ZSTD)
        return _Digested(sha, False, data, RAW)

    # -- caller side --
    def add_file(self, stream: IO[bytes], size: int) -> int:
        """EROFS mode: chunk ``size`` bytes of ``stream``; the file's number, under
        which :attr:`PipelineResult.file_chunks` holds its chunks' blob addresses
        (a chunk that repeats in the layer gets the address it got first)."""
        number = len(self._file_chunks)
        chunks: list[int] = []
        self._file_chunks.append(chunks)
        for length, fut in self._submit(stream, size):
            chunks.append(HOLE)
            self._queue(_Pending(number, len(chunks) - 1, length, fut))
        return number

    def add_windows(self, windows: Iterable[tuple[int, bytes]]) -> None:
        """Linear mode: each window is the blob's bytes at a chunk-aligned offset
        (at most one chunk); offsets not given are holes. Used for sealed LSMT
        files, which are read as one linear file, not through EROFS indexes."""
        for offset, data in windows:
            assert offset % self.chunk_size == 0 and 0 < len(data) <= self.chunk_size
            self.stats.chunks += 1
            if self.on_bytes:
                self.on_bytes(len(data))
            self._queue(_Pending(None, offset, len(data), self._pool.submit(self._digest, data)))
            self._blob_end = max(self._blob_end, offset + len(data))

    def set_blob_size(self, size: int) -> None:
        """Linear mode: the blob's size, trailing holes included."""
        self._blob_end = max(self._blob_end, size)

    def _submit(self, stream: IO[bytes], size: int):
        remaining = size
        while remaining > 0:
            data = stream.read(min(self.chunk_size, remaining))
            if not data:
                raise EOFError(f"source ended {remaining} bytes early")
            remaining -= len(data)
            self.stats.chunks += 1
            if self.on_bytes:
                self.on_bytes(len(data))
            yield len(data), self._pool.submit(self._digest, data)

    def _queue(self, pending: _Pending) -> None:
        self._raise_failure()
        self._inflight.append(pending)
        while len(self._inflight) > self._max_inflight:
            self._settle(self._inflight.popleft())

    def _settle(self, pending: _Pending) -> None:
        res: _Digested = pending.future.result()
        if res.zero:
            self.stats.holes += 1
            return  # EROFS slots start as HOLE; linear holes have no entry
        self._store_chunk(res)
        if pending.file is None:
            self._placed.append((pending.slot, pending.length, res.sha, pending.flags))
            return
        addr = self._layer_addr.get(res.sha)
        if addr is None:
            addr = self._next_block
            self._next_block += -(-pending.length // BLOCK)
            self._layer_addr[res.sha] = addr
            # the file's first chunk in the blob (its slots settle in order): a hole or
            # bytes placed earlier take no place there, so a file may start past them
            flags = 0 if pending.file in self._files_placed else FILE_START
            self._files_placed.add(pending.file)
            self._placed.append((addr * BLOCK, pending.length, res.sha, flags))
        self._file_chunks[pending.file][pending.slot] = addr

    def _store_chunk(self, res: _Digested) -> None:
        """Make sure the chunk is stored: found in the store, in this build, or new."""
        if res.sha in self._stored:
            return
        known = self.index.get(res.sha)
        if known is not None:
            self.stats.reused_chunks += 1
            self._stored[res.sha] = known
            return
        assert res.payload is not None
        self._stored[res.sha] = _NewLocation(len(self._pack_digests), len(self._pack),
                                             len(res.payload), res.compression)
        self._pack += res.payload
        if len(self._pack) >= self.pack_size:
            self._seal_pack()

    def _seal_pack(self) -> None:
        if not self._pack:
            return
        data = bytes(self._pack)
        self._pack = bytearray()
        digest = sha256_digest(data)
        self._pack_digests.append(digest)
        if not self.upload:
            return
        self._check_uploads()
        self._upload_slots.acquire()
        fut = self._uploads.submit(self._upload, data, digest)
        self._upload_futures.append(fut)

    def _upload(self, data: bytes, digest: str) -> int:
        try:
            started = time.time()
            uploaded = self._guarded(lambda: self.store.put_blob(data, digest)[1], None)
            if uploaded is None:  # not sent: the build fails
                return 0
            self._written_at[digest] = started
            if not uploaded:  # already stored (a retried build): put_blob refreshed it
                self._found.add(digest)
            return len(data) if uploaded else 0
        finally:
            self._upload_slots.release()

    def _guarded(self, call: Callable[[], T], skipped: T) -> T:
        """``call()`` unless a store call of this pipeline failed already (then
        ``skipped``: the build ends with that error); the first error is kept."""
        if self._failure is not None:
            return skipped
        try:
            return call()
        except BaseException as exc:
            with self._failure_lock:
                if self._failure is None:
                    self._failure = exc
            raise

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _check_uploads(self) -> None:
        self._raise_failure()

    def finish(self) -> PipelineResult:
        """Settle every chunk, upload the last pack, and return the chunk table."""
        try:
            while self._inflight:
                self._settle(self._inflight.popleft())
            self._seal_pack()
            wait(self._upload_futures, return_when=FIRST_EXCEPTION)
            self._raise_failure()
            for fut in self._upload_futures:
                uploaded = fut.result()
                if uploaded:
                    self.stats.uploaded_bytes += uploaded
                    self.stats.uploaded_packs += 1
            if self.upload:
                self._refresh_packs()
        finally:
            self.close()
        return self._result()

    def _packs_to_refresh(self) -> set[str]:
        """Packs of other layers this build references, and own packs written
        more than FRESH_SECONDS ago (or found already stored by their put_blob)."""
        own = set(self._pack_digests)
        foreign = {loc.pack for loc in self._stored.values()
                   if isinstance(loc, ChunkEntry) and loc.pack not in own}
        stale = time.time() - FRESH_SECONDS
        old_own = {d for d in own if self._written_at.get(d, 0.0) < stale}
        return foreign | old_own

    def _refresh_packs(self) -> None:
        """Refresh every pack the build relies on but did not just write; one that
        is gone fails the build (the ref is not written)."""
        packs = sorted(self._packs_to_refresh())
        with ThreadPoolExecutor(REFRESH_WORKERS, thread_name_prefix="refresh") as pool:
            futures = [pool.submit(self._guarded, lambda d=d: self.store.refresh_blob(d), True)
                       for d in packs]
            wait(futures, return_when=FIRST_EXCEPTION)
            self._raise_failure()
            present = [f.result() for f in futures]
        for digest, ok in zip(packs, present, strict=True):
            if not ok:
                raise BlobVanished(f"pack {digest}", "this layer was built")
        self._reused = set(packs) | self._found

    def _result(self) -> PipelineResult:
        entries = []
        for offset, length, sha, flags in self._placed:
            loc = self._stored[sha]
            if isinstance(loc, _NewLocation):
                entries.append(ChunkEntry(offset, length, sha, self._pack_digests[loc.pack_no],
                                          loc.pack_offset, loc.stored_length, loc.compression,
                                          flags))
            else:
                entries.append(ChunkEntry(offset, length, sha, loc.pack, loc.pack_offset,
                                          loc.stored_length, loc.compression, flags))
        blob_size = max(self._next_block * BLOCK, self._blob_end)
        table = ChunkTable(entries, blob_size, self.chunk_size)
        self.stats.unique_chunks = len(self._stored)
        self.stats.blob_bytes = table.blob_size
        self.stats.stored_bytes = table.stored_bytes()
        return PipelineResult(table, self._next_block, self.stats, set(self._reused),
                              self._file_chunks)

    def close(self) -> None:
        for pending in self._inflight:
            pending.future.cancel()
        self._inflight.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._uploads.shutdown(wait=True, cancel_futures=True)
