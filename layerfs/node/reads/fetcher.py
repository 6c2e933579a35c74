"""Getting chunk bytes on the node from the store, for the reads that missed.

Runs on the trio loop and never blocks it: cache file I/O, store requests,
decompression and hashing happen in worker threads bounded by
``trio.CapacityLimiter``s. Every fetch first claims its chunks
(``ChunkStates.claim``, one synchronous step), so there is one fetch per chunk
however many readers want it (single flight); fetches run in parallel up to a
bound; a reader waits at most the timeout in all (the cache read, the queue
for a store slot and the store request together), and a failure (store down,
corrupt chunk, timeout) reaches every reader that waited for it, then is
forgotten so the next read tries again. Only the store request's own time is
held against the store: a slow cache read or a long queue fails the read
without blaming anyone. A failed read makes the next reads of what failed
fail at once for a while (layerfs/node/reads/failfast.py), so that one read(2)
never waits several timeouts: reads of that one pack, with a backoff, and
every uncached read only when the store as a whole stopped answering (no
answer to any request since the failed one began, and a health probe
unanswered too; ``STORE_COOLDOWN``). A run of chunks that lie one after another in a pack is
fetched with one range read; each chunk of it has its own flight.
The boundary is one-way: the prefetch policies (layerfs/node/reads/prefetch.py,
layerfs/node/reads/tracereplay.py) decide what to fetch and hand this core runs
(``fetch``'s ``along``, ``get_run``, ``lead`` of a claim); this core knows no
policy. The policies and the blob files ask it through methods named for what
they answer (``deadline``, ``slots``, ``state``, ``absent``, ``claim``,
``release``, ``read_held``), never through its attributes; those about what
the node holds are the chunk states' own (``ChunkStates``). A read that hits
(memory, a flight, the cache) never enters this module: ``read_held``
(``ChunkStates.read_held``) serves it, and hands a miss's claim to ``fetch``.
Memory is written only through ``ChunkStates`` (``keep``).
Invariants: docs/dev/node.md.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import TypeAlias, TypeVar, cast

import trio

from ...chunks import (
    RUN_GAP,
    FetchedChunk,
    fetch_chunk_frame,
    fetch_run_frames,
    fetch_run_views,
    pack_runs,
)
from ...errors import IntegrityError, LayerfsError, ObjectNotFound, StoreError, StoreUnreachable
from ...formats.chunktable import ChunkEntry
from ...logcontext import LOG_CONTEXT
from ...ratelog import RateLimitedLog
from ...store.base import Store, blob_key
from ...tasks import TaskGroup
from .chunkcache import ChunkCache
from .chunkfile import Chunk
from .chunkstates import ChunkStates, Claim, FetchError, Flight, MemoryChunks
from .failfast import STORE_COOLDOWN, FailFast

__all__ = ["STORE_COOLDOWN", "Buffer", "ChunkFetcher", "FetchError", "MemoryChunks"]

Buffer: TypeAlias = bytes | bytearray | memoryview

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
QUIET = 1  # a background run starts only while at most this many readers' fetches go on
PROBE_KEY = "refs/.probe"  # the health probe's HEAD: any answer, found or not, will do


class HeldThread:
    """A worker thread slot of a ``CapacityLimiter`` already taken (the queue
    for it waited out apart from the store request): the limiter that
    ``trio.to_thread.run_sync`` is given, which only gives the slot back when
    the thread ends (after it is abandoned, too)."""

    def __init__(self, limiter: trio.CapacityLimiter, owner: object) -> None:
        self.limiter = limiter
        self.owner = owner
        self.used = False  # a thread was started with it: it gives the slot back

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        """Taken already."""
        self.used = True

    def release_on_behalf_of(self, borrower: object) -> None:
        self.limiter.release_on_behalf_of(self.owner)


class ChunkFetcher:
    def __init__(self, store: Store, cache: ChunkCache, *, timeout: float = 30.0,
                 parallel: int = 16, io_threads: int = 16, memory: int = 64 << 20,
                 tasks: TaskGroup | None = None, store_log: RateLimitedLog | None = None,
                 fetch_timed: Callable[[float], None] | None = None,
                 pack_missing: Callable[[str], None] | None = None) -> None:
        """``tasks``: the daemon's task group (write-behind runs in it);
        ``store_log``: where store errors are logged (rate-limited);
        ``fetch_timed``: told each store read's duration; ``pack_missing``:
        told of a pack the store says it does not have."""
        self.store = store
        self.cache = cache
        self.timeout = timeout
        self.parallel = parallel
        self.fetch_limit = trio.CapacityLimiter(parallel)
        # the store reads' worker threads, those abandoned after a timeout included
        # (trio's default limiter, 40 threads shared by all, would cap ``parallel``)
        self.store_threads = trio.CapacityLimiter(max(40, 2 * parallel))
        self.probe_thread = trio.CapacityLimiter(1)  # the health probe's (one at a time)
        self.io_limit = trio.CapacityLimiter(io_threads)
        self.states = ChunkStates(cache, memory, self.io_limit, timeout)
        # What a policy or a blob file asks of what the node holds, answered by
        # the chunk states' own methods (so a cache hit runs no code of this module).
        self.deadline = self.states.deadline
        self.state = self.states.state
        self.absent = self.states.absent
        self.claim = self.states.claim
        self.release = self.states.release
        self.read_held = self.states.read_held
        self.hold_writes = self.states.hold_writes  # (a resumed vm's warm-up)
        self.tasks = tasks or TaskGroup()
        self.fail_fast = FailFast()
        # a store outage fails every read: one line a minute
        self.store_log = store_log or RateLimitedLog(log)
        self.fetch_timed = fetch_timed or (lambda seconds: None)
        self.pack_missing = pack_missing or (lambda pack: None)  # the store has no such pack
        self._reader_fetches = 0  # store reads that readers (or an eager up) wait for
        self._quiet = trio.lowlevel.ParkingLot()  # woken when they drop to QUIET

    def keep_plain(self, entries: Iterable[ChunkEntry]) -> None:
        """A block layer's chunks (read in parts): cached plain (``ChunkCache.keep_plain``)."""
        self.cache.keep_plain(e.sha256.hex() for e in entries)

    def forget_plain(self, entries: Iterable[ChunkEntry]) -> None:
        self.cache.forget_plain(e.sha256.hex() for e in entries)

    def slots(self) -> int:
        """How many store reads run at once (``--store-fetches``); a policy's
        workers take a share of them."""
        return self.parallel

    # -- reading one chunk -------------------------------------------------

    async def get(self, entry: ChunkEntry, along: Sequence[ChunkEntry] = (),
                  deadline: float | None = None) -> Chunk:
        """The verified bytes of one chunk, kept in memory as a reader's: from
        memory, a flight or the cache (``ChunkStates.read_held``), else from
        the store (:meth:`fetch`, with ``along``); raises FetchError within
        the timeout (by ``deadline``, a ``trio.current_time()``, if given)."""
        if deadline is None:
            deadline = self.deadline()
        got = await self.states.read_held(entry, deadline)
        if isinstance(got, Claim):
            return await self.fetch(got, along, deadline)
        return got

    async def fetch(self, claim: Claim, along: Sequence[ChunkEntry], deadline: float) -> Chunk:
        """A reader's miss from the store: the chunk ``claim`` leads (from
        ``ChunkStates.read_held``) and, in one range read with it, those of
        ``along`` (the chunks right after it in its pack: the miss span,
        ``Prefetcher.miss_run``) that no one has or fetches, claimed now, kept
        in memory only while it has room. Ends the claim's flights; by
        ``deadline``."""
        if along:
            more = self.states.claim(along)
            claim = Claim([*claim.lead, *more.lead], [*claim.flights, *more.flights], [])
        result = (await self.lead(claim, keep=False, deadline=deadline))[0]
        if isinstance(result, FetchError):
            raise result
        self.states.keep(claim.lead[0].sha256, result)
        return result

    async def read_run_into(self, run: list[ChunkEntry],
                            sink: Callable[[ChunkEntry, memoryview | bytes], None],
                            deadline: float) -> None:
        """One range read of ``run`` (see ``pack_runs``), each chunk decoded,
        checked against its sha256 and handed to ``sink`` in the worker
        thread (a local blob file's write: no flight, memory or cache file,
        the caller's file is the chunks' home); FetchError for a failed read
        or a damaged chunk, by ``deadline``. Counted as a reader's read."""
        where = f"{len(run)} chunks of pack {run[0].pack[7:23]} @ {run[0].pack_offset}"
        for _ in run:
            self.cache.note_miss()

        def read(chunks: list[ChunkEntry]) -> None:
            got = 0
            for entry, result in zip(chunks, fetch_run_views(self.store, chunks), strict=True):
                if isinstance(result, IntegrityError):
                    raise result
                sink(entry, result)
                got += len(result)
            self.cache.note_fetched(got)

        await self._from_store(where, run[0].pack, read, run, deadline)

    async def writes_done(self) -> None:
        """Wait until every fetched chunk's cache file is written."""
        await self.states.writes_done()

    # -- runs --------------------------------------------------------------

    async def get_run(self, run: list[ChunkEntry], background: bool = False,
                      gap: int = RUN_GAP) -> None:
        """Bring the chunks of a run (see ``pack_runs``) into the cache: one range
        read for those no one has or fetches yet, a wait for those in flight;
        raises the first FetchError (runs of neighbours at most ``gap`` bytes
        apart: see ``pack_runs``). A ``background`` run's reads are not
        counted as readers' (see :meth:`quiet`). Its chunks are not a reader's:
        memory keeps them only while it has room (``ChunkStates.keep``)."""
        claim = self.states.claim(run)
        await self.lead(claim, keep=False, for_reader=not background, split=True, gap=gap)
        for entry, flight in claim.wait:
            await flight.done.wait()
            if flight.error is not None:
                raise flight.error
            if flight.data is None:  # abandoned by its owner: fetched again, not kept
                await self.get_run([entry], background)

    async def lead(self, claim: Claim, *, keep: bool, for_reader: bool = True,
                   split: bool = False, deadline: float | None = None,
                   gap: int = RUN_GAP) -> list[Chunk | FetchError]:
        """Fetch the chunks the claim leads and end their flights: each chunk's
        bytes or FetchError (raises FetchError if a read itself failed). The
        chunks were claimed absent, so they come from the store: one a reader
        wants alone, several with one range read (``split``: cut into runs of
        neighbours first, a lone one read alone; the first failure ends it,
        its later runs abandoned).
        Fetched bytes go to the cache, and to memory as a reader's if
        ``keep``, else only while memory has room (a prefetch must not push
        out what readers use: ``ChunkStates.keep``). Each read within the timeout, or by
        ``deadline`` if given."""
        try:
            if not split:
                return await self._lead_part(claim.lead, claim.flights, keep, for_reader,
                                             deadline)
            flights = dict(zip((e.sha256 for e in claim.lead), claim.flights, strict=True))
            results: list[Chunk | FetchError] = []
            for part in pack_runs(claim.lead, gap=gap):
                done = await self._lead_part(part, [flights[e.sha256] for e in part],
                                             keep, for_reader, deadline)
                failed = next((r for r in done if isinstance(r, FetchError)), None)
                if failed is not None:
                    raise failed
                results += done
            return results
        finally:
            self.states.release(claim)

    async def _lead_part(self, part: list[ChunkEntry], flights: list[Flight],
                         keep: bool, for_reader: bool,
                         deadline: float | None = None) -> list[Chunk | FetchError]:
        """Load ``part`` (claimed by the caller) and settle its flights: each
        gets its bytes or FetchError, all of them the error of a failed read."""
        if deadline is None:
            deadline = self.deadline()
        try:
            if len(part) == 1 and for_reader:
                got = await self._load(part[0], deadline)
                results: list[Chunk | FetchError] = [got.data]
                frames = [got.frame]
            else:
                loaded = await self._load_run(part, deadline, for_reader)
                results = [r if isinstance(r, FetchError) else r.data for r in loaded]
                frames = [None if isinstance(r, FetchError) else r.frame for r in loaded]
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
                # a reader's (or fetch-ahead's) in memory; a prefetch's while it has room
                self.states.keep(entry.sha256, result, reader=keep)
                await self.states.write_behind(entry.sha256, result, frame, self.tasks.nursery)
        return results

    # -- the store and the cache --------------------------------------------

    async def _load_run(self, run: list[ChunkEntry], deadline: float,
                        for_reader: bool = True) -> list[FetchedChunk | FetchError]:
        """Each chunk of a run from one range read of the store, or the FetchError
        of that chunk alone (a corrupt chunk); raises FetchError for a failed read."""
        where = f"{len(run)} chunks of pack {run[0].pack[7:23]} @ {run[0].pack_offset}"
        for _ in run:
            self.cache.note_miss()
        results = await self._from_store(where, run[0].pack, self._fetch_run, run, deadline,
                                         for_reader)
        return [self._failed_chunk(e, r) if isinstance(r, IntegrityError) else r
                for e, r in zip(run, results, strict=True)]

    async def _from_store(self, where: str, pack: str, fetch: Callable[[T], R], arg: T,
                          deadline: float, for_reader: bool = True) -> R:
        """``fetch(arg)`` (a read of ``pack``) in a worker thread under
        ``fetch_limit``, by ``deadline``; its errors as FetchError with a log
        line. It fails at once while ``fail_fast`` refuses the pack. The queue
        for a fetch slot and a thread is not the store's: a deadline met there
        blames no one. A store request that got no answer (the deadline, a
        refused connection) backs its pack off and may make the store suspect
        (``_no_answer``); an error the store answered backs the pack off.
        Counted in ``_reader_fetches`` unless it is a background fetch."""
        self._refuse(where, pack)
        self._reader_fetches += for_reader
        started = trio.current_time()
        # the JSON log lines of this request name what it fetched and its store key
        context = LOG_CONTEXT.set({**(LOG_CONTEXT.get() or {}), "fetch": where,
                                   "store_key": blob_key(pack)})
        try:
            async with self._store_slot(where, deadline) as thread:
                self._refuse(where, pack)  # the store may have been found down meanwhile
                started = trio.current_time()
                with trio.move_on_at(deadline):
                    result = await trio.to_thread.run_sync(fetch, arg, abandon_on_cancel=True,
                                                           limiter=thread)
                    self.fail_fast.answered(trio.current_time())
                    self.fail_fast.pack_served(pack)
                    self.fetch_timed(trio.current_time() - started)
                    return result
            waited = trio.current_time() - started
            self._no_answer(pack, started, f"no answer within {waited:.1f}s")
            self.store_log.error("timeout", "%s: no answer from the store within %.1fs", where,
                                 waited)
            raise FetchError(where, f"timed out after {waited:.1f}s")
        except FetchError:
            raise
        except StoreUnreachable as exc:
            self._no_answer(pack, started, str(exc))
            self.store_log.error("unreachable", "%s: %s", where, exc)
            raise FetchError(where, str(exc)) from exc
        except StoreError as exc:
            self.fail_fast.answered(trio.current_time())
            self.fail_fast.pack_failed(pack, trio.current_time(), str(exc))
            self.store_log.error(type(exc).__name__, "%s: %s", where, exc)
            if isinstance(exc, ObjectNotFound):
                self.pack_missing(pack)
            raise FetchError(where, str(exc)) from exc
        except LayerfsError as exc:
            log.error("%s: %s", where, exc)
            raise FetchError(where, str(exc)) from exc
        finally:
            LOG_CONTEXT.reset(context)
            self._reader_fetches -= for_reader
            if self._reader_fetches <= QUIET:
                self._quiet.unpark_all()

    def _refuse(self, where: str, pack: str) -> None:
        refusal = self.fail_fast.refusal(pack, trio.current_time())
        if refusal is not None:
            raise FetchError(where, refusal)

    @asynccontextmanager
    async def _store_slot(self, where: str, deadline: float) -> AsyncIterator[trio.CapacityLimiter]:
        """A fetch slot (``fetch_limit``) and a store thread, waited for by
        ``deadline`` (threads of abandoned requests hold theirs until their
        request ends); FetchError past it, which blames neither the store nor
        the pack. Gives the thread's limiter for ``trio.to_thread.run_sync``."""
        owner = object()
        got = 0  # limiters taken
        with trio.move_on_at(deadline):
            await self.fetch_limit.acquire_on_behalf_of(owner)
            got = 1
            await self.store_threads.acquire_on_behalf_of(owner)
            got = 2
        if got < 2:
            if got:
                self.fetch_limit.release_on_behalf_of(owner)
            self.store_log.error("busy", "%s: no store slot free within the timeout (%d fetches,"
                                 " %d threads held)", where, self.fetch_limit.borrowed_tokens,
                                 self.store_threads.borrowed_tokens)
            raise FetchError(where, "node busy: no store slot free within the timeout")
        thread = HeldThread(self.store_threads, owner)
        try:
            yield cast(trio.CapacityLimiter, thread)
        finally:
            self.fetch_limit.release_on_behalf_of(owner)
            if not thread.used:  # no thread started (refused, cancelled first)
                self.store_threads.release_on_behalf_of(owner)

    def _no_answer(self, pack: str, started: float, reason: str) -> None:
        """A request of ``pack`` begun at ``started`` got no answer: the pack
        backs off; a probe checks the store if nothing answered since."""
        if self.fail_fast.no_answer(pack, started, trio.current_time(), reason):
            trio.lowlevel.spawn_system_task(self._probe, reason)

    async def _probe(self, why: str) -> None:
        """The health probe: one HEAD of a small key, within the timeout. Any
        answer (found, not found, an error reply) clears the suspicion; none
        opens the store-wide window (reads fail fast for ``STORE_COOLDOWN``)."""
        reason = ""
        with trio.move_on_after(self.timeout) as scope:
            try:
                await trio.to_thread.run_sync(self.store.head, PROBE_KEY,
                                              abandon_on_cancel=True, limiter=self.probe_thread)
            except StoreUnreachable as exc:
                reason = str(exc)
            except StoreError:
                pass  # an answer
            except Exception as exc:  # a store that cannot be probed tells nothing  # noqa: BLE001
                log.debug("store probe: %r", exc)
        if scope.cancelled_caught:
            reason = f"no answer within {self.timeout:.0f}s"
        now = trio.current_time()
        if not reason:
            log.info("store answers (after: %s); only that object's reads back off", why)
            self.fail_fast.probe_answered(now)
            return
        log.error("store does not answer (%s, and its health probe: %s); uncached reads"
                  " fail at once for %.0fs", why, reason, STORE_COOLDOWN)
        self.fail_fast.probe_failed(now, reason)

    async def quiet(self) -> None:
        """Wait until at most ``QUIET`` readers' store reads go on."""
        while self._reader_fetches > QUIET:
            await self._quiet.park()

    @staticmethod
    def _failed_chunk(entry: ChunkEntry, exc: IntegrityError) -> FetchError:
        sha = entry.sha256.hex()
        log.error("chunk %s: %s", sha[:16], exc,
                  extra={"chunk": sha, "store_key": blob_key(entry.pack)})
        error = FetchError(f"chunk {sha[:16]}", str(exc))
        error.__cause__ = exc  # the daemon's answer exits with the cause's code
        return error

    def _fetch_run(self, run: list[ChunkEntry]) -> list[FetchedChunk | IntegrityError]:
        """Worker thread: one range read of the run, each chunk decoded and verified."""
        results = fetch_run_frames(self.store, run)
        self.cache.note_fetched(sum(len(r.data) for r in results
                                    if isinstance(r, FetchedChunk)))
        return results

    async def _load(self, entry: ChunkEntry, deadline: float) -> FetchedChunk:
        """A chunk no one had (claimed absent: not in the cache), from the store."""
        self.cache.note_miss()
        return await self._from_store(f"chunk {entry.sha256.hex()[:16]}", entry.pack,
                                      self._fetch, entry, deadline)

    def _fetch(self, entry: ChunkEntry) -> FetchedChunk:
        """Worker thread: range-read the pack, decompress, verify."""
        got = fetch_chunk_frame(self.store, entry)
        self.cache.note_fetched(len(got.data))
        return got
