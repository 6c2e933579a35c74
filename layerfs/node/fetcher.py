"""Getting chunk bytes on the node: memory, then the cache, then the store.

Runs on the trio loop and never blocks it: cache file I/O, store requests,
decompression and hashing happen in worker threads bounded by
``trio.CapacityLimiter``s. One fetch per chunk however many readers want it
(single flight); fetches run in parallel up to a bound; every fetch is bounded
in time, and its failure (store down, corrupt chunk, timeout) reaches every
reader that waited for it, then is forgotten so the next read tries again.
After the store failed to answer, uncached reads fail at once for
``STORE_COOLDOWN`` seconds, so that one read(2) never waits several timeouts.
Prefetches (eager, trace, a long stream's next chunks, and with
``miss_span`` a small chunk's neighbours) fetch runs of chunks that lie one
after another in a pack with one range read; each chunk of a run has its own
flight. Background runs (trace replay) wait while readers' fetches go on.
Invariants: docs/node.md.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias, TypeVar

import trio

from ..cache.chunkcache import ChunkCache
from ..chunks import fetch_chunk, fetch_run, pack_runs
from ..errors import IntegrityError, LayerfsError, StoreUnreachable, TransientStoreError
from ..formats.chunktable import ChunkEntry
from ..store.base import Store

Buffer: TypeAlias = bytes | bytearray | memoryview

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
STORE_COOLDOWN = 2.0  # seconds uncached reads fail fast after the store failed
MAX_UNWRITTEN = 64  # fetched chunks whose cache files may be pending at once
BACKGROUND_SPAN = 1 << 20  # a background run's range read: small, not to hold up readers' fetches
QUIET = 1  # a background run starts only while at most this many readers' fetches go on


class FetchError(LayerfsError):
    """cannot read {}: {}"""

    exit_code = 8


@dataclass
class _Flight:
    done: trio.Event = field(default_factory=trio.Event)
    data: bytes | None = None
    error: FetchError | None = None  # None with no data: abandoned, try again


class MemoryChunks:
    """A small LRU of recently used chunks, so the kernel's 128 KiB reads of
    one chunk do not each reread and recheck its cache file. Trio-thread only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._items: OrderedDict[bytes, bytes] = OrderedDict()

    def get(self, sha: bytes) -> bytes | None:
        data = self._items.get(sha)
        if data is not None:
            self._items.move_to_end(sha)
        return data

    def __contains__(self, sha: bytes) -> bool:
        return sha in self._items

    def put(self, sha: bytes, data: bytes) -> None:
        if sha in self._items or len(data) > self.limit:
            return
        self._items[sha] = data
        self.size += len(data)
        while self.size > self.limit:
            _, old = self._items.popitem(last=False)
            self.size -= len(old)


class ChunkFetcher:
    def __init__(self, store: Store, cache: ChunkCache, *, timeout: float = 30.0,
                 parallel: int = 16, io_threads: int = 16, memory: int = 64 << 20,
                 miss_span: int = 0) -> None:
        self.store = store
        self.miss_span = miss_span
        self.cache = cache
        self.timeout = timeout
        self.parallel = parallel
        self.fetch_limit = trio.CapacityLimiter(parallel)
        self.io_limit = trio.CapacityLimiter(io_threads)
        self.background_limit = trio.CapacityLimiter(max(1, parallel // 4))
        self.memory = MemoryChunks(memory)
        self._flights: dict[bytes, _Flight] = {}
        self._unwritten: dict[bytes, bytes] = {}  # fetched, cache file not written yet
        self._written = trio.lowlevel.ParkingLot()  # woken when _unwritten empties
        self.nursery: trio.Nursery | None = None
        self.store_down_until = 0.0
        self._reader_fetches = 0  # store reads that readers (or an eager up) wait for
        self._quiet = trio.lowlevel.ParkingLot()  # woken when they drop to QUIET

    async def get(self, entry: ChunkEntry, after: Sequence[ChunkEntry] = ()) -> bytes:
        """The verified bytes of one chunk; raises FetchError within the timeout.
        ``after``: the entries that follow it in its blob; if the chunk comes
        from the store, those that follow it in its pack come along, up to
        ``miss_span`` stored bytes in all (see :meth:`takes_neighbours`)."""
        while True:
            data = self.memory.get(entry.sha256) or self._unwritten.get(entry.sha256)
            if data is not None:
                return data
            flight = self._flights.get(entry.sha256)
            if flight is None:
                run = self._miss_run(entry, after) if after else [entry]
                if len(run) == 1:
                    return await self._lead(entry)
                result = (await self._lead_run(run))[0]
                if isinstance(result, FetchError):
                    raise result
                self.memory.put(entry.sha256, result)
                return result
            await flight.done.wait()
            if flight.data is not None:
                return flight.data
            if flight.error is not None:
                raise flight.error
            # the fetch was abandoned (its owner was cancelled): start another

    def takes_neighbours(self, entry: ChunkEntry) -> bool:
        """A miss that :meth:`get` would fetch with the chunks after it: a chunk
        smaller than ``miss_span`` that no one has or fetches (no I/O)."""
        return entry.stored_length < self.miss_span and self.absent(entry.sha256)

    def _miss_run(self, entry: ChunkEntry, after: Sequence[ChunkEntry]) -> list[ChunkEntry]:
        """``entry`` and the chunks right after it in its pack, up to the first
        one someone has or fetches, within ``miss_span`` stored bytes; just
        ``entry`` if it is cached."""
        if self.cache.contains(entry.sha256.hex()):
            return [entry]
        run, total, shas = [entry], entry.stored_length, {entry.sha256}
        for nxt in after:
            last = run[-1]
            if (nxt.pack != entry.pack or nxt.pack_offset != last.pack_offset + last.stored_length
                    or total + nxt.stored_length > self.miss_span or nxt.sha256 in shas
                    or not self.absent(nxt.sha256)):
                break
            run.append(nxt)
            total += nxt.stored_length
            shas.add(nxt.sha256)
        return run

    async def _lead(self, entry: ChunkEntry) -> bytes:
        """Fetch as the one owner of this chunk's flight. Waiters get the bytes or
        a FetchError; any other end of the owner (cancellation) is only the owner's."""
        flight = self._flights[entry.sha256] = _Flight()
        try:
            flight.data, fetched = await self._load(entry)
            self.memory.put(entry.sha256, flight.data)
            if fetched:
                await self._write_behind(entry.sha256, flight.data)
            return flight.data
        except FetchError as exc:
            flight.error = exc
            raise
        finally:
            del self._flights[entry.sha256]
            flight.done.set()

    async def get_range(self, entry: ChunkEntry, lo: int, hi: int) -> Buffer:
        """Bytes ``[lo, hi)`` of one chunk. From memory or a flight if there;
        else, if the chunk is cached, only the cache file's blocks that hold
        them (a small random read: the chunk is not kept in memory); else the
        whole chunk, as :meth:`get`."""
        sha = entry.sha256
        if self._only_in_cache(sha):
            with trio.move_on_after(self.timeout):
                part = await trio.to_thread.run_sync(self.cache.read_range, sha.hex(), lo, hi,
                                                     limiter=self.io_limit,
                                                     abandon_on_cancel=True)
                if part is not None and len(part) == hi - lo:
                    return part
        return memoryview(await self.get(entry))[lo:hi]

    def warm(self, entry: ChunkEntry) -> None:
        """Read a chunk that is in the cache into memory in the background (a
        sequential reader's next chunk); never a store fetch for it."""
        if self.nursery is not None and self._only_in_cache(entry.sha256):
            self.nursery.start_soon(self._get_quietly, entry)

    def _only_in_cache(self, sha: bytes) -> bool:
        """The chunk is in the cache index and in neither memory, a flight nor
        the pending writes (an index lookup, no I/O)."""
        return (sha not in self.memory and sha not in self._flights
                and sha not in self._unwritten and self.cache.contains(sha.hex()))

    async def _get_quietly(self, entry: ChunkEntry) -> None:
        """``get`` in the background: a failure is logged where it happened."""
        try:
            await self.get(entry)
        except FetchError:
            pass  # logged; the reader that wants it tries again

    def absent(self, sha: bytes) -> bool:
        """No one has or fetches the chunk (no I/O)."""
        return sha not in self._flights and not self._have(sha)

    def fetch_ahead(self, entries: list[ChunkEntry]) -> None:
        """Fetch from the store, in the background, the chunks a long sequential
        stream reads next (runs of neighbours; kept in memory too); a failure
        is only logged: the reader that wants the chunk tries again."""
        if self.nursery is None:
            return
        for run in pack_runs(e for e in entries if self.absent(e.sha256)):
            self.nursery.start_soon(self._fetch_ahead, run)

    async def _fetch_ahead(self, run: list[ChunkEntry]) -> None:
        if len(run) == 1:
            await self._get_quietly(run[0])
            return
        with contextlib.suppress(FetchError):
            await self._lead_run(run, keep=True)

    async def fetch_all(self, entries: list[ChunkEntry], workers: int) -> None:
        """Fetch every chunk not yet cached, in pack order, a run per range read,
        with a bounded pool of workers (the eager ``--prefetch full``); raises
        the first FetchError."""
        wanted = sorted((e for e in self._unique(entries) if not self._have(e.sha256)),
                        key=lambda e: e.location)
        todo = pack_runs(wanted)
        failed: list[FetchError] = []

        async def worker() -> None:
            for run in todo:
                try:
                    await self.get_run(run)
                except FetchError as exc:
                    failed.append(exc)
                    nursery.cancel_scope.cancel()
                    return

        async with trio.open_nursery() as nursery:
            for _ in range(workers):
                nursery.start_soon(worker)
        if failed:
            raise failed[0]
        await self.writes_done()

    @staticmethod
    def _unique(entries: list[ChunkEntry]) -> list[ChunkEntry]:
        """The entries without repeats of a chunk (its first entry kept)."""
        seen: set[bytes] = set()
        unique = []
        for entry in entries:
            if entry.sha256 not in seen:
                seen.add(entry.sha256)
                unique.append(entry)
        return unique

    def _have(self, sha: bytes) -> bool:
        """In memory, waiting for its cache file, or in the cache index (no I/O)."""
        return (sha in self.memory or sha in self._unwritten
                or self.cache.contains(sha.hex()))

    async def get_run(self, run: list[ChunkEntry], background: bool = False) -> None:
        """Bring the chunks of a run (see ``pack_runs``) into the cache: one range
        read for those no one has or fetches yet, a wait for those in flight;
        raises the first FetchError. A ``background`` run first waits until at
        most ``QUIET`` readers' fetches go on: on a shared link its bytes would
        queue ahead of theirs."""
        if background:
            while self._reader_fetches > QUIET:
                await self._quiet.park()
        mine: list[ChunkEntry] = []
        theirs: list[ChunkEntry] = []
        for entry in self._unique(run):
            if entry.sha256 in self._flights:
                theirs.append(entry)
            elif not self._have(entry.sha256):
                mine.append(entry)
        for part in pack_runs(mine):
            if len(part) == 1 and not background:
                await self.get(part[0])
                continue
            results = await self._lead_run(part, for_reader=not background)
            failed = next((r for r in results if isinstance(r, FetchError)), None)
            if failed is not None:
                raise failed
        for entry in theirs:
            await self.get(entry)

    async def _lead_run(self, run: list[ChunkEntry], keep: bool = False,
                        for_reader: bool = True) -> list[bytes | FetchError]:
        """Fetch a run as the owner of each of its chunks' flights; each chunk's
        bytes or FetchError (raises FetchError if the read itself failed). The
        bytes go to the cache, and to memory only if ``keep`` (a prefetch must
        not push out what readers use). Waiters get their chunk's bytes or its
        FetchError."""
        flights = [_Flight() for _ in run]
        for entry, flight in zip(run, flights, strict=True):
            self._flights[entry.sha256] = flight
        try:
            results = await self._load_run(run, for_reader)
            for flight, result in zip(flights, results, strict=True):
                if isinstance(result, FetchError):
                    flight.error = result
                else:
                    flight.data = result
            for entry, flight in zip(run, flights, strict=True):
                if flight.data is not None:
                    if keep:
                        self.memory.put(entry.sha256, flight.data)
                    await self._write_behind(entry.sha256, flight.data)
            return results
        except FetchError as exc:
            for flight in flights:
                if flight.data is None and flight.error is None:
                    flight.error = exc
            raise
        finally:
            for entry, flight in zip(run, flights, strict=True):
                del self._flights[entry.sha256]
                flight.done.set()

    async def _load_run(self, run: list[ChunkEntry],
                        for_reader: bool = True) -> list[bytes | FetchError]:
        """Each chunk of a run from one range read of the store, or the FetchError
        of that chunk alone (a corrupt chunk); raises FetchError for a failed read."""
        where = f"{len(run)} chunks of pack {run[0].pack[7:23]} @ {run[0].pack_offset}"
        for _ in run:
            self.cache.note_miss()
        with trio.move_on_after(self.timeout) as scope:
            results = await self._from_store(where, self._fetch_run, run, for_reader)
            return [self._failed_chunk(e, r) if isinstance(r, IntegrityError) else r
                    for e, r in zip(run, results, strict=True)]
        assert scope.cancelled_caught
        self._store_failed()
        log.error("%s: no answer from the store within %.0fs", where, self.timeout)
        raise FetchError(where, f"timed out after {self.timeout:.0f}s")

    async def _from_store(self, where: str, fetch: Callable[[T], R], arg: T,
                          for_reader: bool = True) -> R:
        """``fetch(arg)`` in a worker thread under ``fetch_limit``; its errors as
        FetchError with a log line, a store outage also opening the fail-fast
        window (during which it fails at once). Counted in ``_reader_fetches``
        unless it is a background fetch."""
        if trio.current_time() < self.store_down_until:
            raise FetchError(where, "store unavailable (failed just now)")
        self._reader_fetches += for_reader
        try:
            async with self.fetch_limit:
                return await trio.to_thread.run_sync(fetch, arg, abandon_on_cancel=True)
        except (StoreUnreachable, TransientStoreError) as exc:
            self._store_failed()
            log.error("%s: %s", where, exc)
            raise FetchError(where, str(exc)) from exc
        except LayerfsError as exc:
            log.error("%s: %s", where, exc)
            raise FetchError(where, str(exc)) from exc
        finally:
            self._reader_fetches -= for_reader
            if self._reader_fetches <= QUIET:
                self._quiet.unpark_all()

    @staticmethod
    def _failed_chunk(entry: ChunkEntry, exc: IntegrityError) -> FetchError:
        sha = entry.sha256.hex()
        log.error("chunk %s: %s", sha[:16], exc)
        error = FetchError(f"chunk {sha[:16]}", str(exc))
        error.__cause__ = exc  # the daemon's answer exits with the cause's code
        return error

    def _fetch_run(self, run: list[ChunkEntry]) -> list[bytes | IntegrityError]:
        """Worker thread: one range read of the run, each chunk decoded and verified."""
        results = fetch_run(self.store, run)
        self.cache.note_fetched(sum(len(r) for r in results if isinstance(r, bytes)))
        return results

    async def _load(self, entry: ChunkEntry) -> tuple[bytes, bool]:
        """The chunk's bytes and whether they came from the store."""
        sha = entry.sha256.hex()
        with trio.move_on_after(self.timeout) as scope:
            if self.cache.contains(sha):  # an index lookup: a miss costs no thread hop
                data = await trio.to_thread.run_sync(self.cache.read, sha, limiter=self.io_limit,
                                                     abandon_on_cancel=True)
                if data is not None and len(data) == entry.length:
                    return data, False  # type: ignore[return-value]  # a memoryview: see issue 14
            else:
                self.cache.note_miss()
            return await self._from_store(f"chunk {sha[:16]}", self._fetch, entry), True
        assert scope.cancelled_caught
        self._store_failed()
        log.error("chunk %s: no answer from the store within %.0fs", sha[:16], self.timeout)
        raise FetchError(f"chunk {sha[:16]}", f"timed out after {self.timeout:.0f}s")

    def _store_failed(self) -> None:
        """For a moment, fail uncached reads at once instead of waiting again: the
        kernel retries a failed read page by page, and each retry would otherwise
        wait a whole timeout."""
        self.store_down_until = trio.current_time() + STORE_COOLDOWN

    def _fetch(self, entry: ChunkEntry) -> bytes:
        """Worker thread: range-read the pack, decompress, verify."""
        data = fetch_chunk(self.store, entry)
        self.cache.note_fetched(len(data))
        return data

    async def _write_behind(self, sha: bytes, data: bytes) -> None:
        """Write the cache file after the readers have their bytes (they stay
        readable from ``_unwritten`` meanwhile); with too many writes pending, or
        no nursery to run them in, the fetch waits for its own write."""
        if self.nursery is None or len(self._unwritten) >= MAX_UNWRITTEN:
            await self._write(sha, data)
            return
        self._unwritten[sha] = data
        self.nursery.start_soon(self._write, sha, data)

    async def _write(self, sha: bytes, data: bytes) -> None:
        try:
            await trio.to_thread.run_sync(self.cache.write, sha.hex(), data,
                                          limiter=self.io_limit)
        except OSError as exc:  # the bytes were served; only the cache copy is lost
            log.warning("cannot write cache file for chunk %s: %s", sha.hex()[:16], exc)
        finally:
            self._unwritten.pop(sha, None)
            if not self._unwritten:
                self._written.unpark_all()

    async def writes_done(self) -> None:
        """Wait until every fetched chunk's cache file is written."""
        while self._unwritten:
            await self._written.park()

    async def prefetch(self, entries: list[ChunkEntry], workers: int = 1) -> None:
        """Fetch chunks in the background at low priority, in order, with up to
        ``workers`` at a time (all prefetches share ``background_limit``); a
        worker stops at its first error, which is only logged."""
        todo = pack_runs((e for e in entries if self.absent(e.sha256)), span=BACKGROUND_SPAN)

        async def worker() -> None:
            for run in todo:
                async with self.background_limit:
                    try:
                        await self.get_run(run, background=True)
                    except FetchError:
                        return

        async with trio.open_nursery() as nursery:
            for _ in range(workers):
                nursery.start_soon(worker)

    def spawn_prefetch(self, entries: list[ChunkEntry], workers: int = 1) -> None:
        if self.nursery is not None and entries:
            self.nursery.start_soon(self.prefetch, entries, workers)
