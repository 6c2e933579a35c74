"""The chunk fetcher and blob files without a mount: single flight, failures,
cancellation and readahead from the cache.

No test depends on elapsed time: each runs on a trio ``MockClock`` that stands
still (a timeout or the store's cooldown ends only when the test jumps the
clock, or, for a hung store, when the clock jumps itself because nothing else
can happen), and waits for the fetcher's tasks with trio's and threading's
events, ``wait_all_tasks_blocked`` and nurseries that end with their tasks."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import threading
import time

import pytest
import trio
import trio.testing
from support.chunkstores import RangeStore, fetcher, run, run_entries

from layerfs.chunks import pack_runs
from layerfs.errors import StoreUnreachable, TransientStoreError
from layerfs.formats.chunktable import FILE_START, RAW, ChunkEntry, ChunkTable
from layerfs.node.reads.blobfiles import FILE_AHEAD, BlobFile
from layerfs.node.reads.chunkcache import ChunkCache
from layerfs.node.reads.chunkfile import BLOCK
from layerfs.node.reads.chunkstates import ChunkState
from layerfs.node.reads.failfast import OBJECT_BACKOFF, OBJECT_BACKOFF_MAX, FailFast
from layerfs.node.reads.fetcher import STORE_COOLDOWN, ChunkFetcher, FetchError
from layerfs.node.reads.prefetch import Prefetcher, trace_runs
from layerfs.store.base import blob_key

DATA = b"chunk bytes " * 1000
ENTRY = ChunkEntry(0, len(DATA), hashlib.sha256(DATA).digest(), "sha256:" + "0" * 64, 0,
                   len(DATA), RAW)


class SlowStore:
    """Serves DATA for any range; the first call (``entered`` once it began)
    waits until released."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail = fail

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            self.release.wait(10)
        if self.fail:
            raise StoreUnreachable("test store is down")
        return DATA


async def entered(store: SlowStore) -> None:
    """Wait until the store's first call is in its worker thread."""
    assert await trio.to_thread.run_sync(store.entered.wait, 10)


def test_one_fetch_for_many_readers(tmp_path):
    store = SlowStore()
    f = fetcher(tmp_path, store)
    results: list[bytes] = []

    async def main() -> None:
        async def read() -> None:
            results.append(await f.get(ENTRY))

        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(read)
            await entered(store)
            await trio.testing.wait_all_tasks_blocked()  # the nine others wait for its flight
            store.release.set()

    run(main)
    assert results == [DATA] * 10 and store.calls == 1


def test_a_cancelled_owner_does_not_cancel_the_waiters(tmp_path):
    """Regression: the owner's Cancelled once reached other readers and ended the
    FUSE loop; now a waiter starts its own fetch."""
    store = SlowStore()
    f = fetcher(tmp_path, store)
    got: list[bytes] = []
    clock = trio.testing.MockClock()

    async def main() -> None:
        async def owner() -> None:
            with trio.move_on_after(0.2):
                await f.get(ENTRY)

        async def waiter() -> None:
            got.append(await f.get(ENTRY))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(owner)
            await entered(store)
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()  # the waiter waits for the owner's flight
            clock.jump(0.2)  # the owner gives up
        store.release.set()

    run(main, clock)
    assert got == [DATA] and store.calls == 2


@pytest.mark.daemon_log(r"store unreachable: test store is down")
def test_a_failure_reaches_every_waiter_and_the_next_read_tries_again(tmp_path):
    store = SlowStore(fail=True)
    f = fetcher(tmp_path, store)
    errors: list[BaseException] = []
    clock = trio.testing.MockClock()

    async def main() -> None:
        async def read() -> None:
            try:
                await f.get(ENTRY)
            except FetchError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(read)
            await entered(store)
            await trio.testing.wait_all_tasks_blocked()
            store.release.set()
        store.fail = False
        with pytest.raises(FetchError, match=r"unavailable \(failed 1 time"):  # its backoff
            await f.get(ENTRY)
        clock.jump(OBJECT_BACKOFF)
        assert await f.get(ENTRY) == DATA

    run(main, clock)
    assert len(errors) == 3 and store.calls == 2


@pytest.mark.daemon_log(r"no answer from the store within")
def test_a_hung_store_is_eio_within_the_timeout(tmp_path):
    store = SlowStore()
    f = fetcher(tmp_path, store, timeout=0.5)

    async def main() -> None:
        start = trio.current_time()
        with pytest.raises(FetchError, match="timed out"):
            await f.get(ENTRY)
        assert trio.current_time() - start == 0.5  # the mock clock's time: the timeout

    # the store never answers: the clock jumps to the timeout as soon as
    # every task waits
    run(main, trio.testing.MockClock(autojump_threshold=0))
    store.release.set()


BAD_PACK = "sha256:" + "b" * 64
LOST = b"lost chunk " * 1000
BAD_ENTRY = ChunkEntry(0, len(LOST), hashlib.sha256(LOST).digest(), BAD_PACK, 0, len(LOST), RAW)
OTHER = b"other chunk " * 1000
OTHER_ENTRY = ChunkEntry(0, len(OTHER), hashlib.sha256(OTHER).digest(), "sha256:" + "c" * 64,
                         0, len(OTHER), RAW)


class FaultyStore:
    """Fault injection: answers an error for the objects in ``broken`` (a 500
    for one lost volume), DATA or OTHER for the others; records the keys read.
    Its HEAD (the fetcher's health probe) raises ``head_error`` if given."""

    def __init__(self, broken: set[str], error: Exception,
                 head_error: Exception | None = None) -> None:
        self.broken = broken
        self.error = error
        self.head_error = head_error
        self.keys: list[str] = []
        self.heads = 0

    def head(self, key: str) -> None:
        self.heads += 1
        if self.head_error is not None:
            raise self.head_error

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self.keys.append(key)
        if key in self.broken:
            raise self.error
        return OTHER if key == blob_key(OTHER_ENTRY.pack) else DATA


@pytest.mark.daemon_log(r"transient store error: 500 for one object")
def test_one_unservable_pack_fails_fast_alone_and_other_reads_go_on(tmp_path):
    """Regression (issue 16, item 3): one object's 500 once failed every uncached
    read of the node for 2 s; now only that pack fails fast, within its backoff."""
    store = FaultyStore({blob_key(BAD_PACK)}, TransientStoreError("500 for one object"))
    f = fetcher(tmp_path, store)

    async def main() -> None:
        with pytest.raises(FetchError, match="500 for one object"):
            await f.get(BAD_ENTRY)
        assert await f.get(ENTRY) == DATA  # another pack, right after the failure
        assert await f.get(OTHER_ENTRY) == OTHER
        reads = len(store.keys)
        with pytest.raises(FetchError, match=r"unavailable \(failed 1 time"):
            await f.get(BAD_ENTRY)
        assert len(store.keys) == reads  # failed fast: the store was not asked again

    trio.run(main)


async def probed(f: ChunkFetcher) -> None:
    """Wait (in real time: the probe is a worker thread) until the fetcher's
    health probe, if one runs, has its answer."""
    while f.fail_fast.probing:
        await trio.to_thread.run_sync(time.sleep, 0.005)


@pytest.mark.daemon_log(r"store unreachable: connection refused|store does not answer")
def test_a_store_that_does_not_answer_fails_every_uncached_read_fast(tmp_path):
    refused = StoreUnreachable("connection refused")
    store = FaultyStore({blob_key(BAD_PACK)}, refused, head_error=refused)
    f = fetcher(tmp_path, store)

    async def main() -> None:
        with pytest.raises(FetchError, match="connection refused"):
            await f.get(BAD_ENTRY)
        await probed(f)
        with pytest.raises(FetchError, match=r"store unavailable \(failed just now"):
            await f.get(ENTRY)
        assert store.keys == [blob_key(BAD_PACK)] and store.heads == 1

    trio.run(main)


@pytest.mark.daemon_log(r"store unreachable: connection refused")
def test_a_refused_read_while_the_store_answers_its_probe_fails_that_pack_alone(tmp_path):
    store = FaultyStore({blob_key(BAD_PACK)}, StoreUnreachable("connection refused"))
    f = fetcher(tmp_path, store)

    async def main() -> None:
        with pytest.raises(FetchError, match="connection refused"):
            await f.get(BAD_ENTRY)
        await probed(f)
        assert await f.get(ENTRY) == DATA
        with pytest.raises(FetchError, match=r"unavailable \(failed 1 time"):
            await f.get(BAD_ENTRY)
        assert store.heads == 1

    trio.run(main)


class HangingStore:
    """Objects that answer (DATA, OTHER) or hang: a GET of a key in ``hung``,
    and the HEAD if ``head_hangs``, waits until ``release`` is set (then
    fails, as a request given up on). Counts its calls."""

    def __init__(self, hung: set[str], head_hangs: bool = False) -> None:
        self.hung = hung
        self.head_hangs = head_hangs
        self.release = threading.Event()
        self.gets: list[str] = []
        self.heads = 0

    def _hang(self) -> None:
        self.release.wait(30)
        raise StoreUnreachable("given up")

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self.gets.append(key)
        if key in self.hung:
            self._hang()
        return OTHER if key == blob_key(OTHER_ENTRY.pack) else DATA

    def head(self, key: str) -> None:
        self.heads += 1
        if self.head_hangs:
            self._hang()


@pytest.mark.daemon_log(r"no answer from the store within 5\.0s")
def test_one_object_that_does_not_answer_while_the_store_does_backs_off_alone(tmp_path):
    """Regression (the real cluster, replication 000, one volume server lost and
    a gateway that retries it past ``--read-timeout``): one object's timeout
    once failed every uncached read for 2 s. Objects slow one by one: the
    probe answers, each backs off alone, every other read goes on."""
    store = HangingStore({blob_key(BAD_PACK)})
    f = fetcher(tmp_path, store, timeout=5.0)

    async def main() -> None:
        start = trio.current_time()
        with pytest.raises(FetchError, match=r"timed out after 5\.0s"):
            await f.get(BAD_ENTRY)
        assert trio.current_time() - start == 5.0
        clock.autojump_threshold = math.inf  # the clock stands still from now on
        await probed(f)
        assert f.fail_fast.store_down_until == 0.0  # the probe answered
        assert await f.get(ENTRY) == DATA  # another pack, right after the timeout
        assert await f.get(OTHER_ENTRY) == OTHER
        gets = len(store.gets)
        with pytest.raises(FetchError, match=r"unavailable \(failed 1 time"):
            await f.get(BAD_ENTRY)
        assert len(store.gets) == gets  # its backoff: not asked again

    clock = trio.testing.MockClock(autojump_threshold=0)
    try:
        run(main, clock)
    finally:
        store.release.set()
    assert store.heads == 1


@pytest.mark.daemon_log(r"no answer from the store within 5\.0s")
def test_a_timeout_while_other_objects_answer_needs_no_probe(tmp_path):
    """A read that times out while reads of other objects were answered since
    it began: the store answers, no probe is sent, nothing else fails."""
    store = HangingStore({blob_key(BAD_PACK)})
    f = fetcher(tmp_path, store, timeout=5.0)
    clock = trio.testing.MockClock()

    async def main() -> None:
        async def lost() -> None:
            with pytest.raises(FetchError, match="timed out"):
                await f.get(BAD_ENTRY)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lost)
            while not store.gets:
                await trio.sleep(0)
            clock.jump(1.0)
            assert await f.get(ENTRY) == DATA  # answered while the lost read waits
            clock.jump(4.0)
        assert not f.fail_fast.probing and f.fail_fast.store_down_until == 0.0
        assert await f.get(OTHER_ENTRY) == OTHER

    try:
        run(main, clock)
    finally:
        store.release.set()
    assert store.heads == 0


@pytest.mark.daemon_log(r"no answer from the store within 5\.0s|store does not answer")
def test_a_store_where_nothing_answers_fails_every_uncached_read_fast(tmp_path):
    """Objects slow all at once and the probe unanswered too: the store is
    down, every uncached read fails at once for STORE_COOLDOWN."""
    store = HangingStore({blob_key(BAD_PACK), blob_key(ENTRY.pack)}, head_hangs=True)
    f = fetcher(tmp_path, store, timeout=5.0)

    async def main() -> None:
        with pytest.raises(FetchError, match="timed out after 5"):
            await f.get(BAD_ENTRY)
        await probed(f)  # the probe's own timeout
        start = trio.current_time()
        with pytest.raises(FetchError, match=r"store unavailable \(failed just now"):
            await f.get(OTHER_ENTRY)
        assert trio.current_time() == start  # at once
        assert store.gets == [blob_key(BAD_PACK)]

    try:
        run(main, trio.testing.MockClock(autojump_threshold=0))
    finally:
        store.release.set()
    assert store.heads == 1


class StuckCache(ChunkCache):
    """A chunk cache whose file reads hang until ``release`` is set."""

    release = threading.Event()

    def read(self, sha: str) -> bytes | None:
        self.release.wait(30)
        return None

    def read_range(self, sha: str, lo: int, hi: int) -> bytes | None:
        self.release.wait(30)
        return None


@pytest.mark.daemon_log(r"the local cache did not answer within 5s")
def test_a_slow_cache_read_fails_within_the_timeout_and_blames_no_store(tmp_path):
    """A local cache read that hangs: ``get`` and a part's read
    (``ChunkStates.read_held`` of a part, which once waited twice that) each fail
    within ``--read-timeout`` in all, and neither the store nor the pack is
    held to blame."""
    store = HangingStore(set())
    f = ChunkFetcher(store, StuckCache(tmp_path / "cache", 1 << 20), timeout=5.0)
    f.cache.write(ENTRY.sha256.hex(), DATA)

    async def main() -> None:
        for read in (lambda: f.get(ENTRY),
                     lambda: f.states.read_held(ENTRY, trio.current_time() + 5.0, (10, 20))):
            start = trio.current_time()
            with pytest.raises(FetchError, match="cache read timed out"):
                await read()
            assert trio.current_time() - start == 5.0
        clock.autojump_threshold = math.inf  # the clock stands still from now on
        assert f.fail_fast.packs == {} and not f.fail_fast.probing
        assert f.fail_fast.store_down_until == 0.0
        assert await f.get(OTHER_ENTRY) == OTHER  # the store was never asked, nor blamed

    clock = trio.testing.MockClock(autojump_threshold=0)
    try:
        run(main, clock)
    finally:
        StuckCache.release.set()
    assert store.gets == [blob_key(OTHER_ENTRY.pack)] and store.heads == 0


@pytest.mark.daemon_log(r"no store slot free within the timeout|no answer from the store")
def test_a_read_that_waits_its_timeout_in_the_queue_blames_no_store(tmp_path):
    """One store thread, held by a read of an object that does not answer
    (after its timeout, too: an abandoned request's thread runs on): a read of
    another pack waits for it, fails within its timeout as the node's own
    business, and neither its pack nor the store is blamed."""
    store = HangingStore({blob_key(BAD_PACK)})
    f = ChunkFetcher(store, ChunkCache(tmp_path / "cache", 1 << 20), timeout=5.0, parallel=1)
    f.store_threads = trio.CapacityLimiter(1)
    clock = trio.testing.MockClock()

    async def main() -> None:
        async def lost() -> None:
            with pytest.raises(FetchError, match="timed out"):
                await f.get(BAD_ENTRY)

        async def queued() -> None:
            with pytest.raises(FetchError, match="node busy"):
                await f.get(ENTRY)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lost)
            while not store.gets:
                await trio.sleep(0)
            clock.jump(1.0)
            nursery.start_soon(queued)
            await trio.testing.wait_all_tasks_blocked()
            clock.jump(4.0)  # the lost read's timeout: the slot is free, the probe starts
            await trio.testing.wait_all_tasks_blocked()
            clock.jump(1.0)  # the queued read's timeout
        assert ENTRY.pack not in f.fail_fast.packs and BAD_ENTRY.pack in f.fail_fast.packs
        await probed(f)
        assert f.fail_fast.store_down_until == 0.0

    try:
        run(main, clock)
    finally:
        store.release.set()
    assert store.gets == [blob_key(BAD_PACK)]


def test_the_evidence_rule_blames_the_store_only_when_nothing_answered():
    """The plain rule: a no-answer backs its pack off; it makes the store
    suspect (a probe) only if nothing answered since it began and no probe
    runs; the probe's answer clears it, its silence opens the window."""
    fail_fast = FailFast()
    assert fail_fast.no_answer("a", started=0.0, now=10.0, reason="t")  # probe it
    assert fail_fast.refusal("a", 10.0) is not None and fail_fast.refusal("b", 10.0) is None
    assert not fail_fast.no_answer("b", started=1.0, now=11.0, reason="t")  # one probe at a time
    fail_fast.probe_answered(11.5)
    assert fail_fast.refusal("c", 11.5) is None
    assert not fail_fast.no_answer("c", started=11.0, now=21.0, reason="t")  # answered since
    assert fail_fast.no_answer("d", started=12.0, now=22.0, reason="t")
    fail_fast.probe_failed(27.0, "no answer")
    assert "store unavailable" in (fail_fast.refusal("e", 27.0) or "")
    assert fail_fast.refusal("e", 27.0 + STORE_COOLDOWN) is None


def test_a_packs_backoff_doubles_up_to_a_bound_and_a_success_forgets_it():
    fail_fast = FailFast()
    now, waits = 100.0, []
    for _ in range(8):
        fail_fast.pack_failed("p", now, "500")
        waits.append(fail_fast.packs["p"].until - now)
        assert fail_fast.refusal("p", now + waits[-1] - 0.01) is not None
        assert fail_fast.refusal("p", now + waits[-1]) is None
        assert fail_fast.refusal("q", now) is None
    assert waits[:3] == [OBJECT_BACKOFF, 2 * OBJECT_BACKOFF, 4 * OBJECT_BACKOFF]
    assert waits[-1] == OBJECT_BACKOFF_MAX
    fail_fast.pack_served("p")
    fail_fast.pack_failed("p", now, "500")
    assert fail_fast.packs["p"].until - now == OBJECT_BACKOFF


class PackStore:
    """Serves byte ranges of one pack; counts the calls."""

    def __init__(self, pack: bytes) -> None:
        self.pack = pack
        self.calls = 0

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self.calls += 1
        return self.pack[start:end]


def test_a_miss_and_a_hit_look_at_the_chunks_state_once(tmp_path):
    """A read of a chunk no one has looks at its state once (the claim of its
    fetch is made in that step) and gets it from the store, a small random
    read too; a hit on the cache file of a chunk looks once as well."""
    size = 4096
    chunks = [bytes([i]) * size for i in range(3)]
    entries = [ChunkEntry(i * size, size, hashlib.sha256(c).digest(), "sha256:" + "0" * 64,
                          i * size, size, RAW, FILE_START) for i, c in enumerate(chunks)]
    store = PackStore(b"".join(chunks))
    f = fetcher(tmp_path, store)
    f.cache.write(entries[2].sha256.hex(), chunks[2])
    blob = BlobFile("sha256:" + "4" * 64, ChunkTable(entries, 3 * size, size), f, 16)
    looks: dict[bytes, int] = {}
    real_state = f.states.state

    def state(sha: bytes) -> ChunkState:
        looks[sha] = looks.get(sha, 0) + 1
        return real_state(sha)

    f.states.state = state  # type: ignore[method-assign]

    async def main() -> None:
        async with trio.open_nursery() as background:
            f.tasks.nursery = background
            assert await blob.read(0, size) == chunks[0]  # a miss, the whole chunk
            assert await blob.read(size + 10, 100) == chunks[1][10:110]  # a miss, a part
            assert await blob.read(2 * size + 10, 100) == chunks[2][10:110]  # a hit, a part
        f.tasks.nursery = None

    run(main)
    assert [looks.get(e.sha256) for e in entries] == [1, 1, 1]
    assert store.calls == 2


def test_sequential_reads_bring_the_next_cached_chunks_of_the_file_into_memory(tmp_path):
    """A stream's next cached chunks come into memory, never past its file's
    end; a random read brings none; a short stream fetches nothing ahead."""
    size = 4096
    chunks = [bytes([i]) * size for i in range(12)]
    entries = [ChunkEntry(i * size, size, hashlib.sha256(c).digest(), "sha256:" + "0" * 64,
                          i * size, size, RAW, FILE_START if i in (0, 8) else 0)
               for i, c in enumerate(chunks)]
    store = PackStore(b"".join(chunks))
    f = fetcher(tmp_path, store)
    for i, c in enumerate(chunks):
        if i != 6:  # not cached
            f.cache.write(entries[i].sha256.hex(), c)
    blob = BlobFile("sha256:" + "1" * 64, ChunkTable(entries, 12 * size, size), f, 16)

    async def main() -> None:
        async with trio.open_nursery() as background:  # ends when its reads ahead have
            f.tasks.nursery = background
            assert await blob.read(9 * size, 100) == chunks[9][:100]  # starts no stream
        assert entries[10].sha256 not in f.states.memory
        async with trio.open_nursery() as background:
            f.tasks.nursery = background
            for i in range(5):  # a stream: chunks 0-4, reading ahead 0, 1, 2, 3, 4 chunks
                assert await blob.read(i * size, size) == chunks[i]
        f.tasks.nursery = None

    run(main)
    in_memory = [i for i, e in enumerate(entries) if e.sha256 in f.states.memory]
    # 6 is not cached, and 5 chunks read fetch 1 ahead (5); 8 starts a file; the
    # random read took a part of 9
    assert in_memory == [0, 1, 2, 3, 4, 5, 7]
    assert store.calls == 0


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.reads\.chunkcache: cache file \S+ is damaged")
def test_a_small_random_read_of_a_cached_chunk_reads_only_its_blocks(tmp_path):
    data = os.urandom(BLOCK * 8)
    entry = ChunkEntry(0, len(data), hashlib.sha256(data).digest(), "sha256:" + "0" * 64, 0,
                       len(data), RAW, FILE_START)
    store = PackStore(data)
    f = fetcher(tmp_path, store)
    f.cache.write(entry.sha256.hex(), data)
    blob = BlobFile("sha256:" + "2" * 64, ChunkTable([entry], len(data), len(data)), f, 16)
    path = f.cache._path(entry.sha256.hex())
    raw = bytearray(path.read_bytes())
    raw[len(raw) - len(data) + 6 * BLOCK] ^= 1  # damage block 6: a read of block 2 is served
    path.write_bytes(raw)

    async def main() -> None:
        assert await blob.read(2 * BLOCK + 5, 4096) == data[2 * BLOCK + 5 : 2 * BLOCK + 4101]
        assert entry.sha256 not in f.states.memory  # a part, not the chunk
        assert await blob.read(6 * BLOCK, 4096) == data[6 * BLOCK : 6 * BLOCK + 4096]

    run(main)
    assert store.calls == 1  # block 6 was damaged: dropped, the chunk fetched again
    assert f.cache.snapshot()["corrupt"] == 1


def test_pack_runs_join_neighbours_in_one_pack_up_to_a_span():
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    first, _ = run_entries([100, 100, 100, 100], a, gaps={2: 50, 3: 70_000})
    other, _ = run_entries([100], b)
    runs = list(pack_runs(first + other + first[:1]))
    assert runs == [first[:3], first[3:], other, first[:1]]  # gap 50 joins, 70,000 cuts
    assert [len(r) for r in pack_runs(first[:3], span=250)] == [2, 1]
    assert [len(r) for r in pack_runs(first[:3], gap=0)] == [2, 1]


@pytest.mark.daemon_log(r"integrity check failed for chunk")
def test_a_full_prefetch_reads_each_run_once_and_verifies_each_chunk(tmp_path):
    """Eight chunks in two packs: two range reads. A damaged chunk is a FetchError
    and never cached; its neighbours in the run are cached; the next prefetch
    fetches only what is missing."""
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    in_a, pack_a = run_entries([5000] * 5, a)
    in_b, pack_b = run_entries([3000] * 3, b)
    damaged = bytearray(pack_a)
    damaged[in_a[2].pack_offset + 10] ^= 1
    store = RangeStore({a: bytes(damaged), b: pack_b})
    f = fetcher(tmp_path, store)
    entries = in_b + in_a + in_a[:1]  # out of pack order, one chunk twice

    async def main() -> None:
        with pytest.raises(FetchError, match="sha256 mismatch"):
            await Prefetcher(f).fetch_all(entries, workers=1)  # pack a first: its run fails
        assert store.calls == [(blob_key(a), 0, 5 * 5000)]
        cached = {e.sha256 for e in entries if f.cache.contains(e.sha256.hex())}
        assert cached == {e.sha256 for e in in_a} - {in_a[2].sha256}
        store.packs[blob_key(a)] = pack_a
        store.calls.clear()
        await Prefetcher(f).fetch_all(entries, workers=1)
        assert store.calls == [(blob_key(a), 2 * 5000, 3 * 5000), (blob_key(b), 0, 3 * 3000)]

    run(main)
    assert all(f.cache.read(e.sha256.hex()) is not None for e in entries)


def test_a_full_prefetch_leaves_a_readers_chunks_in_memory(tmp_path):
    """Regression: ``--prefetch full`` read each lone chunk (a run of one) as a
    reader's and kept it in memory, pushing out the chunks readers use. Now
    it keeps a chunk in memory only while that pushes out nothing
    (``ChunkStates.keep``): the reader's chunk stays, the prefetched ones
    are in the cache."""
    packs = ["sha256:" + c * 64 for c in "rcde"]
    (read, *prefetched), stored = zip(*(run_entries([4096], p) for p in packs), strict=True)
    store = RangeStore(dict(zip(packs, stored, strict=True)))
    f = ChunkFetcher(store, ChunkCache(tmp_path / "cache", 1 << 20), memory=2 * 4096)
    lone = [e for entries in prefetched for e in entries]  # one chunk per pack: runs of one

    async def main() -> None:
        await f.get(read[0])
        await Prefetcher(f).fetch_all(lone, workers=1)

    run(main)
    assert read[0].sha256 in f.states.memory
    assert all(f.cache.contains(e.sha256.hex()) for e in lone)


def test_a_cache_hit_read_walks_neither_the_fetch_core_nor_the_policy(tmp_path):
    """A read of cached chunks (a small part of one, and a whole one) is served
    by ``ChunkStates`` from memory or the cache file: on the trio thread it
    calls only blobfiles.py, chunkstates.py and chunkcache.py (its index) of
    the node's read path (the cache files are read in worker threads), never
    the fetch core nor the policy, and the store is never asked."""
    import sys

    import layerfs.node.reads.blobfiles as blobfiles

    datas = [os.urandom(64 << 10) for _ in range(2)]
    entries = [ChunkEntry(k << 16, 64 << 10, hashlib.sha256(d).digest(), "sha256:" + "9" * 64,
                          k << 16, 64 << 10, RAW) for k, d in enumerate(datas)]
    store = RangeStore({})
    f = fetcher(tmp_path, store)
    for entry, data in zip(entries, datas, strict=True):
        f.cache.write(entry.sha256.hex(), data)
    blob = BlobFile("sha256:" + "9" * 64, ChunkTable(entries, 128 << 10, 64 << 10), f, 16)
    node = os.path.dirname(blobfiles.__file__) + os.sep
    walked: set[str] = set()

    def profile(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(node):
            walked.add(os.path.basename(frame.f_code.co_filename))

    async def main() -> None:
        sys.setprofile(profile)
        try:
            part = await blob.read((64 << 10) + 100, 4096)  # continues no stream
            whole = await blob.read(1000, 64 << 10)  # two chunks, neither only a small part
        finally:
            sys.setprofile(None)
        assert part == datas[1][100:4196]
        assert whole == datas[0][1000:] + datas[1][:1000]

    run(main)
    assert walked == {"blobfiles.py", "chunkstates.py", "chunkcache.py"}
    assert store.calls == []


def test_the_fetch_core_imports_no_prefetch_policy():
    """The boundary is one-way: the policies call the fetch core, never the
    reverse (layerfs/node/reads/fetcher.py imports neither prefetch nor tracereplay,
    not even for type checking)."""
    import ast
    from pathlib import Path

    import layerfs.node.reads.fetcher as core

    tree = ast.parse(Path(core.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            imported |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    policies = {"prefetch", "tracereplay"}
    assert imported and not {m for m in imported if policies & set(m.lstrip(".").split("."))}


def test_a_trace_prefetch_reads_by_place_and_shares_its_runs_with_readers(tmp_path):
    """Trace order 3 4 5 0 1, one window: one range read over the five (and the
    chunk between them); a reader of chunk 4 while that read is in flight
    waits for it instead of reading the store again."""
    a = "sha256:" + "a" * 64
    entries, pack = run_entries([4096] * 6, a)
    store = RangeStore({a: pack})
    release = threading.Event()
    plain_get = store.get

    def slow_get(key: str, start: int | None = None, end: int | None = None) -> bytes:
        release.wait(10)
        return plain_get(key, start, end)

    store.get = slow_get  # type: ignore[method-assign]
    f = fetcher(tmp_path, store)
    got: list[bytes] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(Prefetcher(f).prefetch, [entries[i] for i in (3, 4, 5, 0, 1)])
            await trio.testing.wait_all_tasks_blocked()  # its first run is in flight
            nursery.start_soon(lambda: _append(got, f.get(entries[4])))
            await trio.testing.wait_all_tasks_blocked()  # the reader waits for that run
            release.set()

    run(main)
    assert got == [pack[4 * 4096:5 * 4096]]
    assert store.calls == [(blob_key(a), 0, 6 * 4096)]
    assert all(f.cache.contains(entries[i].sha256.hex()) for i in (0, 1, 3, 4, 5))
    assert not f.cache.contains(entries[2].sha256.hex())  # read over, not kept


def test_a_trace_keeps_its_order_across_windows_and_reads_each_by_place():
    """Windows of 3 chunks' stored bytes: order 3 4 5 | 9 0 1 | b1 8: each
    window by place, neighbours (or chunks at most ``gap`` apart) in one read,
    another pack or a wider gap a read of its own, a repeat left out; a
    window's runs in the order of their first chunk in the trace."""
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    ea, _ = run_entries([4096] * 10, a)
    eb, _ = run_entries([4096] * 2, b)
    order = [ea[3], ea[4], ea[5], ea[9], ea[0], ea[1], ea[4], eb[1], ea[8]]
    runs = list(trace_runs(order, window=3 * 4096, gap=4096))
    assert [[(e.pack, e.pack_offset // 4096) for e in r] for r in runs] == [
        [(a, 3), (a, 4), (a, 5)],
        [(a, 9)], [(a, 0), (a, 1)],
        [(b, 1)], [(a, 8)],
    ]


async def _append(out: list, awaitable) -> None:
    out.append(await awaitable)


@pytest.mark.daemon_log(r"integrity check failed for chunk")
def test_a_miss_on_a_small_chunk_brings_the_chunks_after_it_in_its_pack(tmp_path):
    """miss_span 3 chunks: a read of chunk 0 fetches 0-2 with one range read, a
    read of 1 then needs no store, one of 3 fetches 3-5 (the span stops at the
    end of the pack's chunks). A damaged neighbour fails alone: the read that
    brought it along succeeds; reading it is an error, then it is fetched again."""
    a = "sha256:" + "a" * 64
    entries, pack = run_entries([4096] * 6, a)
    damaged = bytearray(pack)
    damaged[4 * 4096 + 1] ^= 1
    store = RangeStore({a: bytes(damaged)})
    f = ChunkFetcher(store, ChunkCache(tmp_path / "cache", 1 << 20))
    blob = BlobFile("sha256:" + "3" * 64, ChunkTable(entries, len(pack), 4096), f, 16,
                    Prefetcher(f, miss_span=3 * 4096))

    async def main() -> None:
        assert await blob.read(0, 100) == pack[:100]
        assert await blob.read(4096, 4096) == pack[4096:8192]
        assert store.calls == [(blob_key(a), 0, 3 * 4096)]
        assert await blob.read(3 * 4096, 10) == pack[3 * 4096:3 * 4096 + 10]
        assert store.calls[1:] == [(blob_key(a), 3 * 4096, 6 * 4096)]
        with pytest.raises(FetchError, match="sha256 mismatch"):
            await blob.read(4 * 4096, 10)
        store.packs[blob_key(a)] = pack
        assert await blob.read(4 * 4096, 10) == pack[4 * 4096:4 * 4096 + 10]
        assert store.calls[2:] == [(blob_key(a), 4 * 4096, 5 * 4096)] * 2  # 5 is cached

    run(main)
    assert f.cache.snapshot()["entries"] == 6


def test_a_stream_fetches_ahead_a_quarter_of_what_it_has_read(tmp_path):
    """One 20-chunk file, nothing cached, read chunk by chunk: after 12 chunks
    the 3 after them are fetched (one range read for neighbours), not more."""
    a = "sha256:" + "a" * 64
    entries, pack = run_entries([4096] * 20, a)
    entries[0] = ChunkEntry(*[getattr(entries[0], f) for f in ("blob_offset", "length",
                              "sha256", "pack", "pack_offset", "stored_length",
                              "compression")], FILE_START)
    store = RangeStore({a: pack})
    f = fetcher(tmp_path, store)
    blob = BlobFile("sha256:" + "4" * 64, ChunkTable(entries, len(pack), 4096), f, 16)

    async def main() -> None:
        for i in range(12):
            async with trio.open_nursery() as background:  # ends when its fetches ahead have
                f.tasks.nursery = background
                assert await blob.read(i * 4096, 4096) == pack[i * 4096:(i + 1) * 4096]
            f.tasks.nursery = None

    run(main)
    present = [i for i, e in enumerate(entries) if not f.states.absent(e.sha256)]
    assert present == list(range(15))
    assert len(store.calls) <= 13  # 0-3 on demand, then ahead: 4, 5, 6, 7, 8-9, 10, 11, 12, 13-14
    assert any(end - start == 2 * 4096 for _, start, end in store.calls)


def read_with_background(f: ChunkFetcher, blob: BlobFile, off: int, size: int) -> bytes:
    """One read of ``blob``, with a nursery for the fetches it starts in the
    background, which ends once they have."""
    got: list[bytes] = []

    async def main() -> None:
        async with trio.open_nursery() as background:
            f.tasks.nursery = background
            got.append(bytes(await blob.read(off, size)))
        f.tasks.nursery = None

    run(main)
    return got[0]


def files_of(entries: list[ChunkEntry], starts: set[int]) -> list[ChunkEntry]:
    """The entries with FILE_START set on those at ``starts``."""
    return [dataclasses.replace(e, flags=FILE_START if i in starts else 0)
            for i, e in enumerate(entries)]


def test_a_miss_at_the_start_of_a_small_file_fetches_the_rest_of_it(tmp_path):
    """Files of 3, 2, 6 and 2 chunks (FILE_AHEAD is 4). A read of 100 bytes at
    the first file's start fetches its first chunk, and its other two with one
    range read in the background; so does one at the last file's start. A read
    inside the 2-chunk file fetches only its chunk (a reader that starts inside
    a file may want only that part), and so does one at the start of the
    6-chunk file."""
    assert FILE_AHEAD == 4
    a = "sha256:" + "a" * 64
    plain, pack = run_entries([4096] * 13, a)
    entries = files_of(plain, {0, 3, 5, 11})
    store = RangeStore({a: pack})
    f = fetcher(tmp_path, store)
    blob = BlobFile("sha256:" + "5" * 64, ChunkTable(entries, len(pack), 4096), f, 16)
    assert [blob.rest_of_file(i) for i in (0, 3, 5, 11)] == [[1, 2], [4], [], [12]]

    async def main() -> None:
        async with trio.open_nursery() as background:
            f.tasks.nursery = background
            for at in (0, 4 * 4096, 5 * 4096, 11 * 4096):
                assert await blob.read(at, 100) == pack[at:at + 100]
        f.tasks.nursery = None
        calls = sorted((start, end) for _, start, end in store.calls)
        assert calls == [(0, 4096), (4096, 3 * 4096), (4 * 4096, 5 * 4096),
                         (5 * 4096, 6 * 4096), (11 * 4096, 12 * 4096), (12 * 4096, 13 * 4096)]
        assert all(f.states.held(entries[i].sha256) is not None for i in (1, 2, 12))  # in memory
        assert await blob.read(4096, 2 * 4096) == pack[4096:3 * 4096]
        assert len(store.calls) == 6

    run(main)
    present = [i for i, e in enumerate(entries) if not f.states.absent(e.sha256)]
    assert present == [0, 1, 2, 4, 5, 11, 12]


def test_a_file_ends_at_a_short_chunk_a_gap_or_the_next_files_start():
    """What continues a file: full chunks one after another in the blob, up to
    FILE_AHEAD of them. A short chunk ends it (the next entry, unflagged, is a
    file with no chunk of its own before it); so does a gap in the blob (no
    builder leaves one; a table could); a fifth chunk makes it too large."""
    a = "sha256:" + "a" * 64
    sizes = [4096, 100, 4096, 4096, 4096, 4096] + [4096] * 4 + [4096] * 5
    plain, pack = run_entries(sizes, a)
    entries = files_of(plain, {0, 3, 6, 10})
    # blob offsets: a gap between entries 3 and 4
    entries = [dataclasses.replace(e, blob_offset=k * 4096 + (4096 if k >= 4 else 0))
               for k, e in enumerate(entries)]
    blob = BlobFile("sha256:" + "7" * 64, ChunkTable(entries, 17 * 4096, 4096), None, 16)
    assert [blob.rest_of_file(i) for i in range(6)] == [[1], [], [], [], [5], []]
    assert blob.rest_of_file(6) == [7, 8, 9]  # 4 chunks: FILE_AHEAD
    assert blob.rest_of_file(10) == []  # 5 chunks


def test_the_miss_span_and_the_file_fetch_ahead_split_a_file(tmp_path):
    """With the miss span on, a miss at a 4-chunk file's start is one range read
    of the chunk and the neighbours the span holds, and the file's last chunk
    comes in the background; nothing is read twice."""
    a = "sha256:" + "a" * 64
    plain, pack = run_entries([4096] * 4 + [4096], a)
    entries = files_of(plain, {0, 4})
    store = RangeStore({a: pack})
    f = ChunkFetcher(store, ChunkCache(tmp_path / "cache", 1 << 20))
    blob = BlobFile("sha256:" + "8" * 64, ChunkTable(entries, len(pack), 4096), f, 16,
                    Prefetcher(f, miss_span=3 * 4096))
    assert read_with_background(f, blob, 0, 100) == pack[:100]
    assert sorted(store.calls) == [(blob_key(a), 0, 3 * 4096), (blob_key(a), 3 * 4096, 4 * 4096)]
    assert [i for i, e in enumerate(entries) if not f.states.absent(e.sha256)] == [0, 1, 2, 3]


def test_a_table_without_file_starts_fetches_only_what_is_read(tmp_path):
    """No FILE_START flags (a disk's table): no file fetch-ahead."""
    a = "sha256:" + "a" * 64
    entries, pack = run_entries([4096] * 3, a)
    store = RangeStore({a: pack})
    f = fetcher(tmp_path, store)
    blob = BlobFile("sha256:" + "6" * 64, ChunkTable(entries, len(pack), 4096), f, 16)
    assert read_with_background(f, blob, 0, 100) == pack[:100]
    assert store.calls == [(blob_key(a), 0, 4096)]


def test_a_background_run_waits_while_readers_fetch(tmp_path):
    """Two readers' fetches going on: a trace replay's run does not start (its
    bytes would queue ahead of theirs on the link); it starts once they end."""
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    read_set, pack_a = run_entries([4096] * 2, a)
    traced, pack_b = run_entries([4096] * 3, b)
    store = RangeStore({a: pack_a, b: pack_b})
    release = threading.Event()
    plain_get = store.get

    def get(key: str, start: int | None = None, end: int | None = None) -> bytes:
        if key == blob_key(a):
            release.wait(10)
        return plain_get(key, start, end)

    store.get = get  # type: ignore[method-assign]
    f = fetcher(tmp_path, store)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for entry in read_set:
                nursery.start_soon(f.get, entry)
            await trio.testing.wait_all_tasks_blocked()  # both readers' fetches go on
            nursery.start_soon(Prefetcher(f).prefetch, traced)
            await trio.testing.wait_all_tasks_blocked()  # the replay waits for quiet
            assert [k for k, _, _ in store.calls] == []  # readers blocked, replay waiting
            release.set()
        keys = [k for k, _, _ in store.calls]
        # the replay starts once at most one reader's fetch goes on (QUIET): after one ended
        assert keys.index(blob_key(b)) > keys.index(blob_key(a))

    run(main)
    assert all(f.cache.contains(e.sha256.hex()) for e in read_set + traced)


class FirstReadWaitsStore(RangeStore):
    """A range store whose single-chunk reads wait (in their worker thread)
    until a read of a longer range has begun: a reader's fetch is still going
    on while a run that holds its chunk starts."""

    def __init__(self, packs: dict[str, bytes], chunk: int) -> None:
        super().__init__(packs)
        self.chunk = chunk
        self.run_begun = threading.Event()

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        assert start is not None and end is not None
        if end - start > self.chunk:
            self.run_begun.set()
        else:
            self.run_begun.wait(10)
        return super().get(key, start, end)


def test_fetch_ahead_claims_its_chunks_when_called_so_a_reader_joins_it(tmp_path):
    """Regression: ``fetch_ahead`` found chunks 0-1 absent, but its run began
    only after a reader of chunk 0 had started its own fetch; the run then
    replaced the reader's flight, chunk 0 was read twice, and whichever of the
    two ended last hit a KeyError (the reader's EIO, or the daemon's nursery).
    Now the run claims both chunks when fetch_ahead is called: the reader waits
    for it and the pack is read once."""
    a = "sha256:" + "a" * 64
    entries, pack = run_entries([4096] * 2, a)
    store = FirstReadWaitsStore({a: pack}, 4096)
    f = fetcher(tmp_path, store)
    got: list[bytes] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            f.tasks.nursery = nursery
            Prefetcher(f).fetch_ahead(entries)  # the run's task starts at the next checkpoint
            got.append(await f.get(entries[0]))
            await f.writes_done()
            f.tasks.nursery = None

    run(main)
    assert got == [pack[:4096]]
    assert store.calls == [(blob_key(a), 0, 2 * 4096)]
    assert all(f.cache.contains(e.sha256.hex()) for e in entries)


def test_a_run_claims_all_its_chunks_before_its_first_read(tmp_path):
    """Regression: ``get_run`` cut the chunks it wanted into runs and fetched them
    one after another, so a reader could start a fetch of a later run's chunk
    meanwhile, which that run then replaced (read twice, KeyError). Chunk 1 is
    cached and longer than a run's gap: the run is read as 0, then 2-3; a
    reader of chunk 2 that comes while 0 is read now waits for the run."""
    a = "sha256:" + "a" * 64
    entries, pack = run_entries([4096, 70_000, 4096, 4096], a)
    store = FirstReadWaitsStore({a: pack}, 4096)
    first = threading.Event()
    release = threading.Event()
    plain_get = store.get

    def get(key: str, start: int | None = None, end: int | None = None) -> bytes:
        if start == 0:  # chunk 0: the run's first read
            first.set()
            release.wait(10)
            return RangeStore.get(store, key, start, end)
        return plain_get(key, start, end)

    store.get = get  # type: ignore[method-assign]
    f = fetcher(tmp_path, store)
    f.cache.write(entries[1].sha256.hex(), pack[4096:4096 + 70_000])
    got: list[bytes] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(f.get_run, entries)
            await trio.to_thread.run_sync(first.wait, 10)
            nursery.start_soon(lambda: _append(got, f.get(entries[2])))
            await trio.testing.wait_all_tasks_blocked()
            release.set()

    run(main)
    c2 = entries[2].pack_offset
    assert got == [pack[c2:c2 + 4096]]
    assert store.calls == [(blob_key(a), 0, 4096), (blob_key(a), c2, c2 + 2 * 4096)]


class GatheringStore:
    """Serves ``count`` chunks, one per pack, each only once ``count`` reads are in
    flight at the same time (a barrier)."""

    def __init__(self, count: int) -> None:
        self.barrier = threading.Barrier(count, timeout=10)
        self.data = {f"sha256:{i:064x}": b"chunk %d " % i * 100 for i in range(count)}

    def entries(self) -> list[ChunkEntry]:
        return [ChunkEntry(i << 20, len(data), hashlib.sha256(data).digest(), pack, 0,
                           len(data), RAW) for i, (pack, data) in enumerate(self.data.items())]

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self.barrier.wait()  # BrokenBarrierError if fewer reads ever run at once
        return next(d for p, d in self.data.items() if blob_key(p) == key)


def test_the_store_fetch_limit_is_the_concurrency_also_above_trios_thread_default(tmp_path):
    """Regression: store reads ran in trio's default worker-thread pool (40
    threads), so ``--store-fetches 64`` had at most 40 reads in flight."""
    count = 64
    store = GatheringStore(count)
    f = ChunkFetcher(store, ChunkCache(tmp_path / "cache", 1 << 20), timeout=20.0,
                     parallel=count)
    got: list[bytes] = []

    async def main() -> None:
        async def read(entry: ChunkEntry) -> None:
            got.append(await f.get(entry))

        async with trio.open_nursery() as nursery:
            for entry in store.entries():
                nursery.start_soon(read, entry)

    trio.run(main)
    assert sorted(got) == sorted(store.data.values())


def test_a_hold_keeps_cache_writes_waiting_served_from_memory_until_released(tmp_path):
    """While a hold is on (a resumed vm's working set on its way), the cache
    files of the chunks fetched meanwhile wait and their bytes are served from
    memory; released, the files are written; a second hold's end releases
    nothing before the last one's, and a hold whose time is up lets go itself."""
    a = "sha256:" + "a" * 64
    entries, pack = run_entries([4096] * 3, a)
    f = fetcher(tmp_path, RangeStore({a: pack}))
    states = f.states
    clock = trio.testing.MockClock()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            f.tasks.nursery = nursery
            release = states.hold_writes(nursery, 60)
            other = states.hold_writes(nursery, 5)
            await f.get(entries[0])
            await trio.testing.wait_all_tasks_blocked()
            assert not f.cache.contains(entries[0].sha256.hex())
            assert states.state(entries[0].sha256) is ChunkState.IN_MEMORY
            assert await f.get(entries[0]) == pack[:4096]  # from memory
            release()
            release()  # (once is enough)
            await trio.testing.wait_all_tasks_blocked()
            assert not f.cache.contains(entries[0].sha256.hex())  # the other hold is on
            clock.jump(5)  # its time is up
            assert await written(f, entries[0])  # (the write, in a worker thread)
            await f.get(entries[1])  # no hold: written behind as before
            await f.writes_done()
            assert f.cache.contains(entries[1].sha256.hex())
            other()
            assert states._held == 0
            f.tasks.nursery = None
            nursery.cancel_scope.cancel()

    run(main, clock)


def test_holds_back_to_back_end_and_a_wait_for_the_writes_lets_the_held_go(tmp_path):
    """Holds that overlap keep writes waiting for ``HELD_WINDOW`` seconds in a
    row at most (one asked later holds nothing, so the writes go when the
    earlier ones end); whoever waits for the writes (``writes_done``: ``vm
    prefetch``, ``--prefetch full``) has them written now, held or not."""
    from layerfs.node.reads.chunkstates import HELD_WINDOW

    a = "sha256:" + "a" * 64
    entries, pack = run_entries([4096] * 2, a)
    f = fetcher(tmp_path, RangeStore({a: pack}))
    clock = trio.testing.MockClock()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            f.tasks.nursery = nursery
            first = f.states.hold_writes(nursery, 3 * HELD_WINDOW)
            await f.get(entries[0])
            clock.jump(HELD_WINDOW + 1)
            f.states.hold_writes(nursery, 3 * HELD_WINDOW)  # past the window: holds nothing
            assert not await written(f, entries[0], tries=5)
            first()
            assert await written(f, entries[0])
            f.states.hold_writes(nursery, 3 * HELD_WINDOW)
            await f.get(entries[1])
            done = trio.Event()

            async def wait_for_writes() -> None:
                await f.writes_done()  # lets it go
                done.set()

            nursery.start_soon(wait_for_writes)
            assert await written(f, entries[1])
            await done.wait()
            f.tasks.nursery = None
            nursery.cancel_scope.cancel()

    run(main, clock)


def test_a_hold_keeps_at_most_its_bytes_waiting_and_a_stop_drops_what_waits(tmp_path, monkeypatch):
    """Past ``HELD_BYTES`` of waiting writes a hold keeps no more waiting (those
    are written behind as before); a daemon that stops with writes held drops
    them (not cached, as after a crash) and ``writes_done`` does not hang."""
    import layerfs.node.reads.chunkstates as chunkstates

    monkeypatch.setattr(chunkstates, "HELD_BYTES", 4096)
    a = "sha256:" + "a" * 64
    entries, pack = run_entries([4096] * 2, a)
    f = fetcher(tmp_path, RangeStore({a: pack}))

    async def main() -> None:
        async with trio.open_nursery() as outer:
            f.tasks.nursery = outer
            async with trio.open_nursery() as inner:
                f.tasks.nursery = inner
                f.states.hold_writes(outer, 60)
                await f.get(entries[0])  # held
                await f.get(entries[1])  # past the bound: written behind
                assert await written(f, entries[1])  # (its cache write, in a worker thread)
                assert not f.cache.contains(entries[0].sha256.hex())
                inner.cancel_scope.cancel()  # the daemon stops
            with trio.fail_after(1):
                await f.writes_done()
            assert not f.cache.contains(entries[0].sha256.hex())
            f.tasks.nursery = None
            outer.cancel_scope.cancel()

    run(main)


async def written(f: ChunkFetcher, entry: ChunkEntry, tries: int = 500) -> bool:
    """Whether ``entry``'s cache file shows up within ``tries`` short real
    waits (a cache write runs in a worker thread; a standing mock clock)."""
    for _ in range(tries):
        if f.cache.contains(entry.sha256.hex()):
            return True
        await trio.to_thread.run_sync(time.sleep, 0.01)
    return False
