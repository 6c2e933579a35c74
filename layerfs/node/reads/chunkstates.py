"""Where each chunk is on the node, and the one fetch of each chunk in flight.

``ChunkStates`` alone owns the four places a chunk can be — absent, in flight
(a fetch owns it), in memory (the LRU, or fetched and waiting for its cache
file) or in the cache — and the flights. A fetch starts with ``claim``: one
synchronous step, before any ``await``, that makes the caller the owner of
the flights of the chunks no one has or fetches and names the flights of the
chunks others fetch, so two fetches of one chunk can never start (the state
diagram and the rule for each ``await``: docs/dev/node.md). Trio-thread only.

A hold (``hold_writes``) keeps the cache files of chunks fetched meanwhile
waiting, their bytes served from memory, up to ``HELD_BYTES``, until it is
released or its time is up: for a burst whose cores and disk are wanted by
someone waiting right now (a resumed vm's working set, its guest waiting
for it: layerfs/node/vms/ramwarm.py). Holds that overlap keep writes
waiting for at most ``HELD_WINDOW`` seconds in a row (a hold asked later
holds nothing), and ``writes_done`` (someone waits for the writes) lets
the held ones go.

It also serves what the node holds: a reader's chunk, or the part of it a
small read wants, from memory or its cache file (``read_held``; one read of a
file however many readers want it), so a cache hit never enters the fetch core
(layerfs/node/reads/fetcher.py), which is for the store. The memory LRU is written
only here (``keep``).
"""

from __future__ import annotations

import enum
import errno
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import trio

from ...errors import LayerfsError
from ...formats.chunktable import ChunkEntry
from ...ratelog import RateLimitedLog
from .chunkcache import ChunkCache
from .chunkfile import Chunk

log = logging.getLogger(__name__)
MAX_UNWRITTEN = 64  # fetched chunks whose cache files may be pending at once
HELD_BYTES = 256 << 20  # bytes of fetched chunks whose cache files a hold may keep waiting
HELD_WINDOW = 30.0  # seconds holds may keep writes waiting in a row, however many overlap


class FetchError(LayerfsError):
    """cannot read {}: {}"""

    exit_code = 8


class ChunkState(enum.Enum):
    ABSENT = "absent"  # no one has or fetches it
    IN_FLIGHT = "in flight"  # a fetch owns it; readers wait on its flight
    IN_MEMORY = "in memory"  # in the LRU, or fetched and its cache file pending
    CACHED = "cached"  # only in the cache index (reading it is disk I/O)


@dataclass(eq=False)
class Flight:
    """The one fetch of a chunk: its waiters get ``data`` or ``error`` once
    ``done`` is set; neither means the owner was cancelled (try again)."""

    done: trio.Event = field(default_factory=trio.Event)
    data: Chunk | None = None
    error: FetchError | None = None


@dataclass
class Claim:
    """What ``ChunkStates.claim`` gave a caller: the chunks it now leads (one
    flight each, same order) and the flights of the chunks others fetch."""

    lead: list[ChunkEntry]
    flights: list[Flight]
    wait: list[tuple[ChunkEntry, Flight]]


class MemoryChunks:
    """A small LRU of recently used chunks, so the kernel's 128 KiB reads of
    one chunk do not each reread and recheck its cache file. Trio-thread only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._items: OrderedDict[bytes, Chunk] = OrderedDict()

    def get(self, sha: bytes) -> Chunk | None:
        data = self._items.get(sha)
        if data is not None:
            self._items.move_to_end(sha)
        return data

    def __contains__(self, sha: bytes) -> bool:
        return sha in self._items

    def offer(self, sha: bytes, data: Chunk) -> None:
        """Keep a prefetched chunk only if that evicts nothing (a prefetch
        must not push out what readers use)."""
        if self.size + len(data) <= self.limit:
            self.put(sha, data)

    def put(self, sha: bytes, data: Chunk) -> None:
        if sha in self._items or len(data) > self.limit:
            return
        self._items[sha] = data
        self.size += len(data)
        while self.size > self.limit:
            _, old = self._items.popitem(last=False)
            self.size -= len(old)


class ChunkStates:
    """The chunks' states, their flights and the pending cache writes."""

    def __init__(self, cache: ChunkCache, memory: int, io_limit: trio.CapacityLimiter,
                 timeout: float = 30.0) -> None:
        self.cache = cache
        self.io_limit = io_limit
        self.timeout = timeout  # a read's (``--read-timeout``), in the cache-timeout message
        self.memory = MemoryChunks(memory)
        self._flights: dict[bytes, Flight] = {}
        self._unwritten: dict[bytes, Chunk] = {}  # fetched, cache file not written yet
        self._written = trio.lowlevel.ParkingLot()  # woken when _unwritten empties
        self._holds = 0  # holds on the cache writes not released yet
        self._writes_go = trio.Event()  # set while no hold is on
        self._writes_go.set()
        self._held = 0  # bytes of the writes waiting for a hold to end
        self._held_since = 0.0  # when the holds now on began
        self.warnings = RateLimitedLog(log)  # one per chunk otherwise, on a full ROOT

    def deadline(self) -> float:
        """When a read that starts now must be answered by: now (a
        ``trio.current_time()``) plus the read timeout (``--read-timeout``)."""
        return trio.current_time() + self.timeout

    def keep(self, sha: bytes, data: Chunk, *, reader: bool = True) -> None:
        """Keep a chunk's bytes in memory: the only way into it. A reader's
        chunk goes in, pushing out the least recently used; any other (a
        prefetch's: fetch-ahead's neighbours, a miss span's, a trace replay's,
        ``--prefetch full``'s) only if that pushes out nothing, so no prefetch
        evicts what readers use."""
        if reader:
            self.memory.put(sha, data)
        else:
            self.memory.offer(sha, data)

    def held(self, sha: bytes) -> Chunk | None:
        """The chunk's bytes if they are in memory (no I/O)."""
        data = self.memory.get(sha)
        return self._unwritten.get(sha) if data is None else data

    def state(self, sha: bytes) -> ChunkState:
        """Where the chunk is now (an index lookup at most, no I/O)."""
        if sha in self.memory or sha in self._unwritten:
            return ChunkState.IN_MEMORY
        if sha in self._flights:
            return ChunkState.IN_FLIGHT
        if self.cache.contains(sha.hex()):
            return ChunkState.CACHED
        return ChunkState.ABSENT

    def absent(self, sha: bytes) -> bool:
        """No one has or fetches the chunk (no I/O)."""
        return self.state(sha) is ChunkState.ABSENT

    async def read_held(self, entry: ChunkEntry, deadline: float,
                        part: tuple[int, int] | None = None) -> Chunk | memoryview | Claim:
        """A reader's chunk from memory, from the flight that fetches it, or
        from its cache file (read once however many readers want it; then
        kept in memory); with ``part`` (``lo, hi``), only those bytes of it,
        and of a chunk only in the cache only the cache file's blocks that
        hold them are read (the chunk is not kept in memory; a zstd-form file
        is read whole, then kept). If the node does not have it (or its file
        was dropped as damaged): the claim of its fetch, made in the same step
        as the one look at its state, which the caller leads from the store
        (``ChunkFetcher.fetch``). Raises the flight's FetchError, or
        FetchError if the cache does not answer by ``deadline`` (a
        ``trio.current_time()``)."""
        sha, ranged = entry.sha256, part is not None
        while True:
            data = self.held(sha)
            if data is None:
                state = self.state(sha)  # (the look: once, unless something changed meanwhile)
                if state is ChunkState.IN_FLIGHT:
                    flight = self._flights[sha]
                    await flight.done.wait()
                    if flight.error is not None:
                        raise flight.error
                    if flight.data is None:
                        continue  # abandoned by its owner: look again
                    data = flight.data
                elif state is ChunkState.ABSENT:
                    return self._lead(entry)  # a miss: the store's
                elif part is not None and ranged and not self.cache.reads_whole(sha.hex()):
                    got = await self._read_range(entry, *part, deadline)
                    if got is not None:
                        return got
                    ranged = False  # the file cannot serve the part: read it whole
                    continue
                else:
                    claim = self._lead(entry)
                    try:
                        data = await self._read_file(entry, deadline)
                    except BaseException as exc:
                        if isinstance(exc, FetchError):
                            claim.flights[0].error = exc  # its waiters' too
                        self.release(claim)  # (cancelled: abandoned, a waiter looks again)
                        raise
                    if data is None:  # the file gone or damaged: the store's, still led
                        return claim
                    claim.flights[0].data = data
                    self.release(claim)
                    self.keep(sha, data)
            return data if part is None else memoryview(data)[part[0]:part[1]]

    def _lead(self, entry: ChunkEntry) -> Claim:
        """A claim that leads ``entry``'s new flight (its state seen: not in one)."""
        flight = self._flights[entry.sha256] = Flight()
        return Claim([entry], [flight], [])

    async def _read_range(self, entry: ChunkEntry, lo: int, hi: int,
                          deadline: float) -> Chunk | memoryview | None:
        """Bytes ``[lo, hi)`` of a chunk only in the cache, from just the cache
        file's blocks that hold them; None if its file cannot serve the part
        (dropped meanwhile). FetchError if the cache does not answer by
        ``deadline``."""
        sha = entry.sha256
        with trio.move_on_at(deadline):
            got = await trio.to_thread.run_sync(self.cache.read_range, sha.hex(), lo, hi,
                                                limiter=self.io_limit, abandon_on_cancel=True)
            if got is not None and len(got) == hi - lo:
                return got
            if got is not None and len(got) == entry.length:  # a file read whole
                self.keep(sha, got)
                return memoryview(got)[lo:hi]
            return None
        raise self.cache_timeout(f"chunk {sha.hex()[:16]}")

    async def _read_file(self, entry: ChunkEntry, deadline: float) -> Chunk | None:
        """The chunk's cache file, read and checked by ``deadline``; None if
        gone or damaged (dropped)."""
        sha = entry.sha256.hex()
        with trio.move_on_at(deadline):
            data = await trio.to_thread.run_sync(self.cache.read, sha, limiter=self.io_limit,
                                                 abandon_on_cancel=True)
            return data if data is not None and len(data) == entry.length else None
        raise self.cache_timeout(f"chunk {sha[:16]}")

    def cache_timeout(self, where: str) -> FetchError:
        """The local cache read did not end within the timeout: not the store's."""
        log.error("%s: the local cache did not answer within %.0fs", where, self.timeout)
        return FetchError(where, f"cache read timed out after {self.timeout:.0f}s")

    def claim(self, entries: Iterable[ChunkEntry]) -> Claim:
        """Lead every chunk of ``entries`` that is absent; wait for those in
        flight; skip the rest (a reader's chunk in the cache is
        ``read_held``'s, which claims it itself). Synchronous: the state seen
        is the state claimed. The caller must end its flights with
        ``release`` (in a ``finally``)."""
        lead: list[ChunkEntry] = []
        flights: list[Flight] = []
        wait: list[tuple[ChunkEntry, Flight]] = []
        seen: set[bytes] = set()
        for entry in entries:
            sha = entry.sha256
            if sha in seen:
                continue
            seen.add(sha)
            state = self.state(sha)
            if state is ChunkState.IN_FLIGHT:
                wait.append((entry, self._flights[sha]))
            elif state is ChunkState.ABSENT:
                flight = self._flights[sha] = Flight()
                lead.append(entry)
                flights.append(flight)
        return Claim(lead, flights, wait)

    def release(self, claim: Claim, error: FetchError | None = None) -> None:
        """End the claim's flights: those without bytes or an error get
        ``error`` (None: abandoned, a waiter fetches again); wake the waiters."""
        for entry, flight in zip(claim.lead, claim.flights, strict=True):
            if flight.data is None and flight.error is None:
                flight.error = error
            if self._flights.get(entry.sha256) is flight:
                del self._flights[entry.sha256]
            flight.done.set()

    async def write_behind(self, sha: bytes, data: Chunk, frame: bytes | None,
                           nursery: trio.Nursery | None) -> None:
        """Write the cache file (of ``data``, or of ``frame``, the zstd frame it
        was stored as: ``ChunkCache.write``) after the readers have their bytes
        (they stay readable from memory meanwhile); with too many writes
        pending, or no nursery to run them in, wait for this write."""
        if nursery is not None and self._holds and self._held + len(data) <= HELD_BYTES:
            self._unwritten[sha] = data
            self._held += len(data)
            nursery.start_soon(self._write_after_hold, sha, data, frame, self._writes_go)
            return
        if nursery is None or len(self._unwritten) >= MAX_UNWRITTEN:
            await self._write(sha, data, frame)
            return
        self._unwritten[sha] = data
        nursery.start_soon(self._write, sha, data, frame)

    def hold_writes(self, nursery: trio.Nursery, seconds: float) -> Callable[[], None]:
        """Hold the cache writes of chunks fetched from now on (see the module's
        docstring) until the returned function is called (once is enough) or
        ``seconds`` have passed."""
        if self._holds == 0:
            self._writes_go = trio.Event()
            self._held_since = trio.current_time()
        elif trio.current_time() - self._held_since > HELD_WINDOW:
            return lambda: None  # holds back to back: the writes go
        self._holds += 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self._holds -= 1
            if self._holds == 0:
                self._writes_go.set()

        async def release_later() -> None:
            await trio.sleep(seconds)
            release()

        nursery.start_soon(release_later)
        return release

    async def _write_after_hold(self, sha: bytes, data: Chunk, frame: bytes | None,
                                go: trio.Event) -> None:
        try:
            await go.wait()
        except BaseException:  # cancelled (the daemon stops): not cached, as after a crash
            self._held -= len(data)
            self._done_with(sha)
            raise
        self._held -= len(data)
        await self._write(sha, data, frame)

    async def _write(self, sha: bytes, data: Chunk, frame: bytes | None) -> None:
        try:
            await trio.to_thread.run_sync(self.cache.write, sha.hex(), data, frame,
                                          limiter=self.io_limit)
        except OSError as exc:  # the bytes were served; only the cache copy is lost
            kind = errno.errorcode.get(exc.errno or 0, "cache write")
            self.warnings.warning(kind, "cannot write cache file for chunk %s: %s; served "
                                  "without caching it", sha.hex()[:16], exc)
        finally:
            self._done_with(sha)

    def _done_with(self, sha: bytes) -> None:
        """The chunk's cache write is over (written or not)."""
        self._unwritten.pop(sha, None)
        if not self._unwritten:
            self._written.unpark_all()

    async def writes_done(self) -> None:
        """Wait until every fetched chunk's cache file is written (those a hold
        keeps waiting go now)."""
        self._writes_go.set()
        while self._unwritten:
            await self._written.park()
