"""The trace replay of an ``up``: it waits for both a layer's trace and its
chunk table, whichever comes first, then fetches in trace order; a layer
without a pushed trace replays nothing under ``auto``; a malformed trace is one
warning; a cancelled replay stops its fetches. On a trio ``MockClock`` that
stands still, with events instead of sleeps (as tests/test_fetcher.py)."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing
from support.chunkstores import RangeStore, fetcher, run, run_entries

from layerfs.errors import ObjectNotFound
from layerfs.formats.chunktable import ChunkTable
from layerfs.node.reads.accesstraces import trace_bytes, trace_key
from layerfs.node.reads.prefetch import Prefetcher
from layerfs.node.reads.tracereplay import TraceReplay
from layerfs.node.replica.replica import Replica
from layerfs.store.base import blob_key

PACK = "sha256:" + "a" * 64
LAYER = "sha256:" + "1" * 64
OTHER = "sha256:" + "2" * 64


class TraceStore(RangeStore):
    """Packs by key plus traces by layer digest; a missing object is a LayerfsError."""

    def __init__(self, packs: dict[str, bytes], traces: dict[str, bytes]) -> None:
        super().__init__(packs)
        self.traces = {trace_key(d): data for d, data in traces.items()}

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        if key.startswith("traces/"):
            self.calls.append((key, start, end))
            if key not in self.traces:
                raise ObjectNotFound(key)
            return self.traces[key]
        return super().get(key, start, end)


def layer(n: int = 6) -> tuple[ChunkTable, bytes]:
    entries, pack = run_entries([4096] * n, PACK)
    return ChunkTable(entries, n * 4096, 4096), pack


def replay_of(tmp_path, store, digests, pushed_only=True):
    f = fetcher(tmp_path, store)
    replica = Replica(tmp_path / "root")
    return TraceReplay(store, replica, Prefetcher(f), digests, pushed_only), f


def replay_whole(replay: TraceReplay, table: ChunkTable) -> None:
    """Run ``replay`` of one layer whose table comes once the replay has started,
    then the ``up`` ends; returns once every fetch it started is over."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(replay.run)
            replay.table_known(LAYER, table)
            replay.settle()  # the up is over

    run(main)


def test_a_table_that_comes_first_waits_for_the_trace_then_replays_it(tmp_path):
    table, pack = layer()
    store = TraceStore({PACK: pack}, {LAYER: trace_bytes([3, 4, 5, 0, 1])})
    replay, f = replay_of(tmp_path, store, [LAYER])

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            replay.table_known(LAYER, table)  # before the replay's task even ran
            nursery.start_soon(replay.run)
            replay.settle()  # the up is over

    run(main)
    assert store.calls[0] == (trace_key(LAYER), None, None)
    # one window: 0-1 and 3-5 by place, in one range read over chunk 2
    assert store.calls[1:] == [(blob_key(PACK), 0, 6 * 4096)]
    assert [f.cache.contains(e.sha256.hex()) for e in table.entries] == [True] * 2 + [False] \
        + [True] * 3


def test_a_trace_that_comes_first_waits_for_its_table(tmp_path):
    """Two layers: the replay starts each one's fetches only once its own table
    is in, and ends once the up is over and the fetches are done."""
    table, pack = layer()
    store = TraceStore({PACK: pack}, {LAYER: trace_bytes([2]), OTHER: trace_bytes([5])})
    replay, f = replay_of(tmp_path, store, [LAYER, OTHER])
    done = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _mark(done, replay.run()))
            await until(lambda: len(replay.orders) == 2)  # both traces in, no table
            assert sorted(c[0] for c in store.calls) == sorted([trace_key(LAYER),
                                                                trace_key(OTHER)])
            replay.table_known(OTHER, table)
            await until(lambda: f.cache.contains(table.entries[5].sha256.hex()))
            assert store.calls[-1] == (blob_key(PACK), 5 * 4096, 6 * 4096)
            assert not done  # LAYER's table may still come
            replay.table_known(LAYER, table)
            replay.settle()  # the up is over

    run(main)
    assert done == [True]
    assert store.calls[-1] == (blob_key(PACK), 2 * 4096, 3 * 4096)


async def until(condition) -> None:
    """Checkpoint until ``condition()`` holds (a worker thread's result is in)."""
    while not condition():
        await trio.sleep(0)


async def _mark(done: list, awaitable) -> None:
    await awaitable
    done.append(True)


def test_auto_replays_nothing_without_a_pushed_trace_and_trace_uses_the_nodes_own(tmp_path):
    table, pack = layer()
    store = TraceStore({PACK: pack}, {})
    replay, f = replay_of(tmp_path, store, [LAYER], pushed_only=True)
    replay.replica.put_trace(LAYER, [1])
    replay_whole(replay, table)
    assert store.calls == [(trace_key(LAYER), None, None)]  # asked, none pushed: nothing fetched
    replay_whole(TraceReplay(store, replay.replica, Prefetcher(f), [LAYER], pushed_only=False),
                 table)
    assert store.calls[-1] == (blob_key(PACK), 4096, 2 * 4096)  # the node's own trace


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.reads\.tracereplay: ignoring the malformed access "
                        r"trace traces/1{64} in the store")
def test_a_malformed_pushed_trace_is_one_warning_and_no_fetch(tmp_path):
    table, pack = layer()
    store = TraceStore({PACK: pack}, {LAYER: b'{"not": "a trace"}'})
    replay, _ = replay_of(tmp_path, store, [LAYER])
    replay_whole(replay, table)
    assert store.calls == [(trace_key(LAYER), None, None)]


def test_a_cancelled_replay_stops_its_fetches(tmp_path):
    """The up failed after the table came in: its replay's fetch in flight is
    abandoned, nothing of it is cached, and ``run`` returns."""
    table, pack = layer()
    store = TraceStore({PACK: pack}, {LAYER: trace_bytes([0, 1])})
    entered, release = threading.Event(), threading.Event()
    plain_get = store.get
    started = []

    def slow_get(key: str, start: int | None = None, end: int | None = None) -> bytes:
        if not key.startswith("traces/"):
            started.append((key, start, end))
            entered.set()
            release.wait(10)
        return plain_get(key, start, end)

    store.get = slow_get  # type: ignore[method-assign]
    replay, f = replay_of(tmp_path, store, [LAYER])

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(replay.run)
            replay.table_known(LAYER, table)
            assert await trio.to_thread.run_sync(entered.wait, 10)  # the run's read is in flight
            replay.cancel()
        assert not release.is_set()  # run() returned while the read still waited
        release.set()

    run(main)
    assert started == [(blob_key(PACK), 0, 2 * 4096)]  # one run, one read, abandoned
    assert not any(f.cache.contains(e.sha256.hex()) for e in table.entries)
