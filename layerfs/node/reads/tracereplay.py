"""Replaying the layers' access traces while a sandbox comes up.

One :class:`TraceReplay` per ``up`` with ``--prefetch trace`` or ``auto``.
It starts as soon as the layers' digests are known: each layer's trace (the
one pushed to the store, merged with this node's own for ``trace``) is
fetched alongside the layer's own objects, and a layer's chunks are
prefetched (window by window of the trace: ``prefetch.trace_runs``) as soon
as both its trace and its meta image and verified chunk table are in
(:meth:`table_known`), while the layer is mounted and the sandbox's runtime
starts. So the chunks a sandbox reads first are on their way before the
sandbox reads, and the ``up``'s own store requests are not queued behind
them.

A replay is a hint: a trace that cannot be had is logged and skipped; a chunk
a replay fetches is verified like any other (the chunk table was checked
against the layer's manifest first), so an ``up`` that fails after its
tables came in leaves only verified chunks in the cache, and
:meth:`cancel` stops the fetches still going on.

Runs on the trio loop; the store reads run in worker threads.
"""

from __future__ import annotations

import logging

import trio

from ...errors import LayerfsError
from ...formats.chunktable import ChunkTable
from ...store.base import Store
from ...tasks import TaskGroup
from ..replica.replica import Replica
from .accesstraces import merge_traces, parse_trace, trace_key
from .prefetch import Prefetcher

log = logging.getLogger(__name__)
TRACE_WORKERS = 4  # fetches of one layer's trace replay at a time (one store round trip each)


def pushed_trace(store: Store, digest: str) -> list[int] | None:
    """Worker thread: layer ``digest``'s trace in the store, if there is a valid one."""
    try:
        data = store.get(trace_key(digest))
    except LayerfsError:
        return None
    order = parse_trace(data)
    if order is None:
        log.warning("ignoring the malformed access trace %s in the store", trace_key(digest))
    return order


class TraceReplay:
    """The trace replay of one ``up``: of each of ``digests``, the trace pushed
    to the store (``pushed_only``) or that merged with the replica's, handed
    to the prefetch policy's background ``prefetch`` (which hands the fetch
    core its runs)."""

    def __init__(self, store: Store, replica: Replica, policy: Prefetcher,
                 digests: list[str], pushed_only: bool) -> None:
        self.store = store
        self.replica = replica
        self.policy = policy
        self.digests = list(dict.fromkeys(digests))
        self.pushed_only = pushed_only
        self.orders: dict[str, list[int]] = {}
        self.tables: dict[str, ChunkTable] = {}
        self.started: set[str] = set()
        self.scope = trio.CancelScope()
        self._settled = trio.Event()  # the up is over: no more tables will come
        self._nursery: trio.Nursery | None = None

    @classmethod
    def start_in(cls, tasks: TaskGroup, store: Store, replica: Replica, policy: Prefetcher,
                 digests: list[str], pushed_only: bool) -> TraceReplay | None:
        """A replay of ``digests``' traces running in the daemon's task group
        (None while it is not open)."""
        if tasks.nursery is None:
            return None
        replay = cls(store, replica, policy, digests, pushed_only)
        tasks.nursery.start_soon(replay.run)
        return replay

    async def run(self) -> None:
        """Fetch the traces and replay each layer's once its table is in; returns
        when every replay started is done (or on :meth:`cancel`)."""
        with self.scope:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for digest in self.digests:
                    nursery.start_soon(self._trace_of, digest)
                await self._settled.wait()

    def table_known(self, digest: str, table: ChunkTable) -> None:
        """Layer ``digest``'s chunk table, verified (trio thread)."""
        if digest in self.digests:
            self.tables.setdefault(digest, table)
            self._start(digest)

    def settle(self) -> None:
        """The up is over: no more tables will come."""
        self._settled.set()

    def cancel(self) -> None:
        self.settle()
        self.scope.cancel()

    async def _trace_of(self, digest: str) -> None:
        try:
            order = await trio.to_thread.run_sync(self._trace_for, digest)
        except Exception as exc:  # noqa: BLE001 - a replay is only a hint
            log.error("access trace of %s not replayed: %s", digest, exc)
            return
        self.orders[digest] = order
        self._start(digest)

    def _trace_for(self, digest: str) -> list[int]:
        """Worker thread: the layer's pushed trace merged into this node's own;
        with ``pushed_only``, nothing if none was pushed."""
        pushed = pushed_trace(self.store, digest)
        if pushed is None and self.pushed_only:
            return []
        return merge_traces(self.replica.trace(digest), pushed or [])

    def _start(self, digest: str) -> None:
        """Replay the layer's trace once both it and the layer's table are in."""
        order, table = self.orders.get(digest), self.tables.get(digest)
        if order is None or table is None or digest in self.started or self._nursery is None:
            return
        self.started.add(digest)
        n = len(table.entries)
        entries = [table.entries[i] for i in order if 0 <= i < n]
        if entries:
            self._nursery.start_soon(self.policy.prefetch, entries, TRACE_WORKERS)
