"""The prefetch policies: which chunks to fetch before a reader asks, and when.

The boundary is one-way: a policy decides what to fetch and hands the fetch
core (``ChunkFetcher``: ``fetch``'s ``along``, ``get_run``, ``lead`` of a
``claim``) runs, and asks it through its methods (``absent``, ``state``,
``slots``...); the core, which alone decides whether a chunk is fetched,
waited for or already there, never calls a policy. Who needs both
composes them (``BlobFile``, the daemon). The policies:

* eager (``--prefetch full``): every chunk not yet cached, in pack order, a
  run per range read, with a bounded pool of workers; into the cache, and
  into memory only while it has room (readers' chunks stay: ``ChunkStates.keep``);
* trace (``--prefetch trace``): a recorded access order in the background,
  yielding to readers' fetches: in windows of the order, each window's chunks
  fetched by place, neighbours and near neighbours in one range read
  (``trace_runs``);
* a stream's fetch-ahead: the next chunks of a long sequential read, claimed
  when the reader asks for them; and warming its next cached chunks into memory;
* the miss span (``--miss-span``): a miss on a small chunk brings the chunks
  after it in its pack along (``miss_run``, handed to ``ChunkFetcher.fetch``);
* a file's fetch-ahead: a miss at the start of a small file of several chunks
  fetches the file's other chunks (``BlobFile`` knows the files, ``fetch_ahead``
  fetches);
* the library fetch-ahead (``libraries``; ``--no-library-ahead`` turns it off):
  a miss at the start of an ELF file fetches the libraries it names, and
  theirs (``LibraryAhead`` in layerfs/node/reads/libraryahead.py);
* the read plan of ``BlobFile.read_parts``: how deep a stream reads ahead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from ...chunks import pack_runs
from ...formats.chunktable import FILE_START, ChunkEntry
from ...tasks import TaskGroup
from .chunkstates import ChunkState, Claim, FetchError

if TYPE_CHECKING:
    from .fetcher import ChunkFetcher

TRACE_WINDOW = 8 << 20  # a replay fetches by place within this many stored bytes of its order
TRACE_GAP = 1 << 20  # ... reading over at most this many bytes between two chunks
CACHED_READAHEAD = 16  # at most this many chunks read ahead from the cache into memory
STORE_READAHEAD = 4  # at most this many chunks a stream fetches ahead from the store
STORE_AHEAD_SHARE = 4  # ... and at most 1/4 of what it has read so far


@dataclass(frozen=True)
class ReadPlan:
    """What a read asks of the prefetcher: ``depth`` chunks after it to read
    ahead (0: it continues no stream), of which the first ``ahead`` may come
    from the store."""

    depth: int
    ahead: int

    @property
    def streaming(self) -> bool:
        return self.depth > 0


class Prefetcher:
    def __init__(self, fetcher: ChunkFetcher, miss_span: int = 0,
                 tasks: TaskGroup | None = None, libraries: bool = False) -> None:
        """``tasks``: the daemon's task group, where warming and fetching ahead
        run (by default the fetch core's); ``libraries``: blob files whose
        layer's meta image is known follow the libraries of ELF files that
        miss (layerfs/node/reads/libraryahead.py)."""
        self.fetcher = fetcher
        self.tasks = tasks or fetcher.tasks
        self.miss_span = miss_span
        self.libraries = libraries
        self.background_limit = trio.CapacityLimiter(max(1, fetcher.slots() // 4))

    # -- reads -------------------------------------------------------------

    @staticmethod
    def plan(reads: int, streamed: int, chunk_size: int) -> ReadPlan:
        """The readahead of a read that is the ``reads``-th of a stream that has
        read ``streamed`` bytes: from the cache as deep as the stream is long,
        from the store a quarter of what it has read."""
        return ReadPlan(depth=min(reads - 1, CACHED_READAHEAD),
                        ahead=min(streamed // (STORE_AHEAD_SHARE * chunk_size), STORE_READAHEAD))

    def read_ahead(self, following: Sequence[ChunkEntry], plan: ReadPlan) -> None:
        """Ahead of a stream: of the chunks ``following`` its read, up to
        ``plan.depth`` and never past the next file's start, the cached ones
        into memory, and of the first ``plan.ahead`` the absent ones from the
        store."""
        fetch = []
        for n, entry in enumerate(following[:plan.depth]):
            if entry.flags & FILE_START:
                break
            if n < plan.ahead and self.fetcher.absent(entry.sha256):
                fetch.append(entry)
            else:
                self.warm(entry)
        if fetch:
            self.fetch_ahead(fetch)

    def takes_neighbours(self, entry: ChunkEntry) -> bool:
        """Whether a miss of ``entry`` is fetched with the chunks after it
        (``ChunkFetcher.fetch``'s ``along``): a chunk smaller than ``miss_span``."""
        return entry.stored_length < self.miss_span

    def miss_run(self, entry: ChunkEntry, after: Sequence[ChunkEntry]) -> list[ChunkEntry]:
        """A miss of ``entry`` and the chunks right after it in its pack, up to
        the first one someone has or fetches, within ``miss_span`` stored
        bytes; just ``entry`` if it is larger than the span."""
        if entry.stored_length >= self.miss_span:
            return [entry]
        run, total, shas = [entry], entry.stored_length, {entry.sha256}
        for nxt in after:
            last = run[-1]
            if (nxt.pack != entry.pack or nxt.pack_offset != last.pack_offset + last.stored_length
                    or total + nxt.stored_length > self.miss_span or nxt.sha256 in shas
                    or not self.fetcher.absent(nxt.sha256)):
                break
            run.append(nxt)
            total += nxt.stored_length
            shas.add(nxt.sha256)
        return run

    def warm(self, entry: ChunkEntry) -> None:
        """Read a chunk that is in the cache into memory in the background (a
        sequential reader's next chunk: ``ChunkStates.read_held``); never a
        store fetch for it."""
        nursery = self.tasks.nursery
        if nursery is not None and self.fetcher.state(entry.sha256) is ChunkState.CACHED:
            nursery.start_soon(self._warm_quietly, entry)

    async def _warm_quietly(self, entry: ChunkEntry) -> None:
        """``read_held`` in the background: a failure is logged where it happened."""
        with contextlib.suppress(FetchError):  # logged; the reader that wants it tries again
            got = await self.fetcher.read_held(entry, self.fetcher.deadline())
            if isinstance(got, Claim):  # no longer cached: never the store's here
                self.fetcher.release(got)  # (abandoned: a reader that waits claims again)

    def fetch_ahead(self, entries: list[ChunkEntry]) -> None:
        """Fetch from the store, in the background, the chunks a reader reads
        next (a long sequential stream's, the rest of a file; runs of
        neighbours; kept in memory too). The chunks are claimed now, so a
        reader that asks for one before its run starts waits for it. A failure
        is logged where it happened and reaches the readers that wait for the
        chunk then, as their own fetch's would; a later read tries again
        (within the fail-fast windows of layerfs/node/reads/failfast.py)."""
        nursery = self.tasks.nursery
        if nursery is None:
            return
        claim = self.fetcher.claim(entries)
        flights = dict(zip((e.sha256 for e in claim.lead), claim.flights, strict=True))
        for run in pack_runs(claim.lead):
            part = Claim(run, [flights[e.sha256] for e in run], [])
            nursery.start_soon(self._lead_quietly, part)

    async def _lead_quietly(self, claim: Claim) -> None:
        with contextlib.suppress(FetchError):
            await self.fetcher.lead(claim, keep=True)

    # -- whole layers ---------------------------------------------------------

    async def fetch_all(self, entries: list[ChunkEntry], workers: int | None = None) -> None:
        """Fetch every chunk not yet cached, in pack order, a run per range read,
        with a bounded pool of workers (the eager ``--prefetch full``; by
        default half the fetch core's slots, so that sandboxes already up
        still get theirs); raises the first FetchError."""
        if workers is None:
            workers = max(1, self.fetcher.slots() // 2)
        wanted = sorted((e for e in _unique(entries) if self.fetcher.state(e.sha256)
                         in (ChunkState.ABSENT, ChunkState.IN_FLIGHT)),
                        key=lambda e: e.location)
        todo = pack_runs(wanted)
        failed: list[FetchError] = []

        async def worker() -> None:
            for run in todo:
                try:
                    await self.fetcher.get_run(run)
                except FetchError as exc:
                    failed.append(exc)
                    nursery.cancel_scope.cancel()
                    return

        async with trio.open_nursery() as nursery:
            for _ in range(workers):
                nursery.start_soon(worker)
        if failed:
            raise failed[0]
        await self.fetcher.writes_done()

    async def prefetch(self, entries: list[ChunkEntry], workers: int = 1) -> None:
        """Fetch chunks in the background at low priority, in order, with up to
        ``workers`` at a time (all prefetches share ``background_limit``); a
        run starts only while readers' fetches are quiet (``ChunkFetcher.quiet``);
        a worker stops at its first error, which is only logged."""
        todo = trace_runs([e for e in entries if self.fetcher.absent(e.sha256)])

        async def worker() -> None:
            for run in todo:
                async with self.background_limit:
                    await self.fetcher.quiet()
                    try:
                        await self.fetcher.get_run(run, background=True, gap=TRACE_GAP)
                    except FetchError:
                        return

        async with trio.open_nursery() as nursery:
            for _ in range(workers):
                nursery.start_soon(worker)


def trace_runs(entries: list[ChunkEntry], window: int = TRACE_WINDOW,
               gap: int = TRACE_GAP) -> Iterator[list[ChunkEntry]]:
    """A recorded order of chunks as range reads: the order cut into windows of
    ``window`` stored bytes, each window's chunks by place, in runs that read
    over at most ``gap`` bytes between two of them (see ``pack_runs``), the
    runs in the order of their first chunk in the trace. What a start reads
    first still comes first; within a window a store serves few large reads
    instead of many small ones (each a request, and on S3 gateways that read
    a whole stored chunk per range, that chunk again)."""
    todo: list[ChunkEntry] = []
    size = 0
    for entry in _unique(entries):
        todo.append(entry)
        size += entry.stored_length
        if size >= window:
            yield from _window_runs(todo, gap)
            todo, size = [], 0
    yield from _window_runs(todo, gap)


def _window_runs(window: list[ChunkEntry], gap: int) -> list[list[ChunkEntry]]:
    """One window of a trace (no repeats) as runs by place, the run with the
    window's earliest chunk first."""
    first = {e.sha256: n for n, e in enumerate(window)}
    runs = pack_runs(sorted(window, key=lambda e: e.location), gap=gap)
    return sorted(runs, key=lambda run: min(first[e.sha256] for e in run))


def _unique(entries: list[ChunkEntry]) -> list[ChunkEntry]:
    """The entries without repeats of a chunk (its first entry kept)."""
    seen: set[bytes] = set()
    unique = []
    for entry in entries:
        if entry.sha256 not in seen:
            seen.add(entry.sha256)
            unique.append(entry)
    return unique
