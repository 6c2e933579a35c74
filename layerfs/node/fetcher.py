"""Getting chunk bytes on the node: memory, then the cache, then the store.

Runs on the trio loop and never blocks it: cache file I/O, store requests,
decompression and hashing happen in worker threads bounded by
``trio.CapacityLimiter``s. Every fetch first claims its chunks
(``ChunkStates.claim``, one synchronous step), so there is one fetch per chunk
however many readers want it (single flight); fetches run in parallel up to a
bound; every fetch is bounded in time, and its failure (store down, corrupt
chunk, timeout) reaches every reader that waited for it, then is forgotten so
the next read tries again. A failed read makes the next reads of what
failed fail at once for a while (layerfs/node/failfast.py), so that one
read(2) never waits several timeouts: reads of one pack the store could not
serve, with a backoff, and every uncached read only when the store itself did
not answer (``STORE_COOLDOWN``). A run of chunks that lie one after another in a pack is
fetched with one range read; each chunk of it has its own flight. The
prefetch policies (layerfs/node/prefetch.py) only call this core.
Invariants: docs/node.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeAlias, TypeVar

import trio

from ..cache.chunkcache import ChunkCache
from ..cache.chunkfile import Chunk
from ..chunks import FetchedChunk, fetch_chunk_frame, fetch_run_frames, pack_runs
from ..errors import IntegrityError, LayerfsError, StoreError, StoreUnreachable
from ..formats.chunktable import ChunkEntry
from ..ratelog import RateLimitedLog
from ..store.base import Store
from .chunkstate import ChunkState, ChunkStates, Claim, FetchError, Flight, MemoryChunks
from .failfast import STORE_COOLDOWN, FailFast
from .prefetch import Prefetcher

__all__ = ["STORE_COOLDOWN", "Buffer", "ChunkFetcher", "FetchError", "MemoryChunks"]

Buffer: TypeAlias = bytes | bytearray | memoryview

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
QUIET = 1  # a background run starts only while at most this many readers' fetches go on


class ChunkFetcher:
    def __init__(self, store: Store, cache: ChunkCache, *, timeout: float = 30.0,
                 parallel: int = 16, io_threads: int = 16, memory: int = 64 << 20,
                 miss_span: int = 0) -> None:
        self.store = store
        self.cache = cache
        self.timeout = timeout
        self.parallel = parallel
        self.fetch_limit = trio.CapacityLimiter(parallel)
        # the store reads' worker threads, those abandoned after a timeout included
        # (trio's default limiter, 40 threads shared by all, would cap ``parallel``)
        self.store_threads = trio.CapacityLimiter(max(40, 2 * parallel))
        self.io_limit = trio.CapacityLimiter(io_threads)
        self.states = ChunkStates(cache, memory, self.io_limit)
        self.memory = self.states.memory
        self.nursery: trio.Nursery | None = None
        self.fail_fast = FailFast()
        self.store_log = RateLimitedLog(log)  # a store outage fails every read: one line a minute
        self._reader_fetches = 0  # store reads that readers (or an eager up) wait for
        self._quiet = trio.lowlevel.ParkingLot()  # woken when they drop to QUIET
        self.policy = Prefetcher(self, miss_span)

    # -- reading one chunk -------------------------------------------------

    async def get(self, entry: ChunkEntry, after: Sequence[ChunkEntry] = ()) -> Chunk:
        """The verified bytes of one chunk; raises FetchError within the timeout.
        ``after``: the entries that follow it in its blob; if the chunk comes
        from the store, those that follow it in its pack come along
        (``Prefetcher.miss_run``)."""
        while True:
            data = self.states.held(entry.sha256)
            if data is not None:
                return data
            absent = self.states.state(entry.sha256) is ChunkState.ABSENT
            run = self.policy.miss_run(entry, after) if after and absent else [entry]
            claim = self.states.claim(run, cached=True)
            if claim.lead:  # ours: the entry leads its run
                result = (await self.lead(claim, keep=False))[0]
                if isinstance(result, FetchError):
                    raise result
                self.memory.put(entry.sha256, result)
                return result
            flight = claim.wait[0][1]
            await flight.done.wait()
            if flight.data is not None:
                return flight.data
            if flight.error is not None:
                raise flight.error
            # the fetch was abandoned (its owner was cancelled): start another

    async def get_range(self, entry: ChunkEntry, lo: int, hi: int,
                        after: Sequence[ChunkEntry] = ()) -> Buffer:
        """Bytes ``[lo, hi)`` of one chunk. From memory or a flight if there;
        else, if the chunk is cached, only the cache file's blocks that hold
        them (a small random read: the chunk is not kept in memory); else, or
        if its file must be read whole (zstd form), the whole chunk, as
        :meth:`get` (which keeps it in memory for the reads that follow)."""
        sha = entry.sha256
        if self.states.state(sha) is ChunkState.CACHED and not self.cache.reads_whole(sha.hex()):
            with trio.move_on_after(self.timeout):
                part = await trio.to_thread.run_sync(self.cache.read_range, sha.hex(), lo, hi,
                                                     limiter=self.io_limit,
                                                     abandon_on_cancel=True)
                if part is not None and len(part) == hi - lo:
                    return part
                if part is not None and len(part) == entry.length:  # a file read whole
                    self.memory.put(sha, part)
                    return memoryview(part)[lo:hi]
        return memoryview(await self.get(entry, after))[lo:hi]

    def absent(self, sha: bytes) -> bool:
        """No one has or fetches the chunk (no I/O)."""
        return self.states.state(sha) is ChunkState.ABSENT

    async def writes_done(self) -> None:
        """Wait until every fetched chunk's cache file is written."""
        await self.states.writes_done()

    # -- runs --------------------------------------------------------------

    async def get_run(self, run: list[ChunkEntry], background: bool = False) -> None:
        """Bring the chunks of a run (see ``pack_runs``) into the cache: one range
        read for those no one has or fetches yet, a wait for those in flight;
        raises the first FetchError. A ``background`` run's reads are not
        counted as readers' (see :meth:`quiet`)."""
        claim = self.states.claim(run, cached=False)
        await self.lead(claim, keep=False, for_reader=not background, split=True)
        for entry, flight in claim.wait:
            await flight.done.wait()
            if flight.error is not None:
                raise flight.error
            if flight.data is None:  # abandoned by its owner
                await self.get(entry)

    async def lead(self, claim: Claim, *, keep: bool, for_reader: bool = True,
                   split: bool = False) -> list[Chunk | FetchError]:
        """Fetch the chunks the claim leads and end their flights: each chunk's
        bytes or FetchError (raises FetchError if a read itself failed). One
        chunk a reader wants is read from the cache or the store; several with
        one range read (``split``: cut into runs of neighbours first, a lone
        one read as a reader's and kept in memory; the first failure ends it,
        its later runs abandoned). Fetched bytes go to the cache, and to
        memory if ``keep``, else only while memory has room (a prefetch must
        not push out what readers use)."""
        try:
            if not split:
                return await self._lead_part(claim.lead, claim.flights, keep, for_reader)
            flights = dict(zip((e.sha256 for e in claim.lead), claim.flights, strict=True))
            results: list[Chunk | FetchError] = []
            for part in pack_runs(claim.lead):
                lone = len(part) == 1 and for_reader
                done = await self._lead_part(part, [flights[e.sha256] for e in part],
                                             keep or lone, for_reader)
                failed = next((r for r in done if isinstance(r, FetchError)), None)
                if failed is not None:
                    raise failed
                results += done
            return results
        finally:
            self.states.release(claim)

    async def _lead_part(self, part: list[ChunkEntry], flights: list[Flight],
                         keep: bool, for_reader: bool) -> list[Chunk | FetchError]:
        """Load ``part`` (claimed by the caller) and settle its flights: each
        gets its bytes or FetchError, all of them the error of a failed read."""
        try:
            if len(part) == 1 and for_reader:
                data, got = await self._load(part[0])
                results: list[Chunk | FetchError] = [data]
                frames = [None if got is None else got.frame]
                fetched = got is not None
            else:
                loaded = await self._load_run(part, for_reader)
                results = [r if isinstance(r, FetchError) else r.data for r in loaded]
                frames = [None if isinstance(r, FetchError) else r.frame for r in loaded]
                fetched = True
        except FetchError as exc:
            for flight in flights:
                flight.error = exc
            raise
        for flight, result in zip(flights, results, strict=True):
            if isinstance(result, FetchError):
                flight.error = result
            else:
                flight.data = result
        for entry, result, frame in zip(part, results, frames, strict=True):
            if not isinstance(result, FetchError):
                if keep:
                    self.memory.put(entry.sha256, result)
                elif fetched:  # a prefetch's: kept while memory has room
                    self.memory.offer(entry.sha256, result)
                if fetched:
                    await self.states.write_behind(entry.sha256, result, frame, self.nursery)
        return results

    # -- the store and the cache --------------------------------------------

    async def _load_run(self, run: list[ChunkEntry],
                        for_reader: bool = True) -> list[FetchedChunk | FetchError]:
        """Each chunk of a run from one range read of the store, or the FetchError
        of that chunk alone (a corrupt chunk); raises FetchError for a failed read."""
        where = f"{len(run)} chunks of pack {run[0].pack[7:23]} @ {run[0].pack_offset}"
        for _ in run:
            self.cache.note_miss()
        with trio.move_on_after(self.timeout) as scope:
            results = await self._from_store(where, run[0].pack, self._fetch_run, run,
                                             for_reader)
            return [self._failed_chunk(e, r) if isinstance(r, IntegrityError) else r
                    for e, r in zip(run, results, strict=True)]
        assert scope.cancelled_caught
        self._store_failed(f"no answer within {self.timeout:.0f}s")
        self.store_log.error("timeout", "%s: no answer from the store within %.0fs", where,
                             self.timeout)
        raise FetchError(where, f"timed out after {self.timeout:.0f}s")

    async def _from_store(self, where: str, pack: str, fetch: Callable[[T], R], arg: T,
                          for_reader: bool = True) -> R:
        """``fetch(arg)`` (a read of ``pack``) in a worker thread under
        ``fetch_limit``; its errors as FetchError with a log line. It fails at
        once while ``fail_fast`` refuses the pack; a store that did not answer
        opens the store-wide window, any other store error the pack's backoff.
        Counted in ``_reader_fetches`` unless it is a background fetch."""
        refusal = self.fail_fast.refusal(pack, trio.current_time())
        if refusal is not None:
            raise FetchError(where, refusal)
        self._reader_fetches += for_reader
        try:
            async with self.fetch_limit:
                result = await trio.to_thread.run_sync(fetch, arg, abandon_on_cancel=True,
                                                       limiter=self.store_threads)
            self.fail_fast.pack_served(pack)
            return result
        except StoreUnreachable as exc:
            self._store_failed(str(exc))
            self.store_log.error("unreachable", "%s: %s", where, exc)
            raise FetchError(where, str(exc)) from exc
        except StoreError as exc:
            self.fail_fast.pack_failed(pack, trio.current_time(), str(exc))
            self.store_log.error(type(exc).__name__, "%s: %s", where, exc)
            raise FetchError(where, str(exc)) from exc
        except LayerfsError as exc:
            log.error("%s: %s", where, exc)
            raise FetchError(where, str(exc)) from exc
        finally:
            self._reader_fetches -= for_reader
            if self._reader_fetches <= QUIET:
                self._quiet.unpark_all()

    async def quiet(self) -> None:
        """Wait until at most ``QUIET`` readers' store reads go on."""
        while self._reader_fetches > QUIET:
            await self._quiet.park()

    @staticmethod
    def _failed_chunk(entry: ChunkEntry, exc: IntegrityError) -> FetchError:
        sha = entry.sha256.hex()
        log.error("chunk %s: %s", sha[:16], exc)
        error = FetchError(f"chunk {sha[:16]}", str(exc))
        error.__cause__ = exc  # the daemon's answer exits with the cause's code
        return error

    def _fetch_run(self, run: list[ChunkEntry]) -> list[FetchedChunk | IntegrityError]:
        """Worker thread: one range read of the run, each chunk decoded and verified."""
        results = fetch_run_frames(self.store, run)
        self.cache.note_fetched(sum(len(r.data) for r in results
                                    if isinstance(r, FetchedChunk)))
        return results

    async def _load(self, entry: ChunkEntry) -> tuple[Chunk, FetchedChunk | None]:
        """The chunk's bytes, and what the store gave if they came from it."""
        sha = entry.sha256.hex()
        with trio.move_on_after(self.timeout) as scope:
            if self.cache.contains(sha):  # an index lookup: a miss costs no thread hop
                data = await trio.to_thread.run_sync(self.cache.read, sha, limiter=self.io_limit,
                                                     abandon_on_cancel=True)
                if data is not None and len(data) == entry.length:
                    return data, None
            else:
                self.cache.note_miss()
            got = await self._from_store(f"chunk {sha[:16]}", entry.pack, self._fetch, entry)
            return got.data, got
        assert scope.cancelled_caught
        self._store_failed(f"no answer within {self.timeout:.0f}s")
        self.store_log.error("timeout", "chunk %s: no answer from the store within %.0fs",
                             sha[:16], self.timeout)
        raise FetchError(f"chunk {sha[:16]}", f"timed out after {self.timeout:.0f}s")

    def _store_failed(self, reason: str) -> None:
        """The store did not answer: for a moment, fail uncached reads at once
        instead of waiting again (the kernel retries a failed read page by page,
        and each retry would otherwise wait a whole timeout)."""
        self.fail_fast.store_failed(trio.current_time(), reason)

    def _fetch(self, entry: ChunkEntry) -> FetchedChunk:
        """Worker thread: range-read the pack, decompress, verify."""
        got = fetch_chunk_frame(self.store, entry)
        self.cache.note_fetched(len(got.data))
        return got

    # -- the prefetch policies (layerfs/node/prefetch.py) --------------------

    def takes_neighbours(self, entry: ChunkEntry) -> bool:
        return self.policy.takes_neighbours(entry)

    def fetch_ahead(self, entries: list[ChunkEntry]) -> None:
        self.policy.fetch_ahead(entries)

    async def fetch_all(self, entries: list[ChunkEntry], workers: int) -> None:
        await self.policy.fetch_all(entries, workers)

    async def prefetch(self, entries: list[ChunkEntry], workers: int = 1) -> None:
        await self.policy.prefetch(entries, workers)
