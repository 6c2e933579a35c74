"""The chunk fetcher without a mount: single flight, failures and cancellation."""

from __future__ import annotations

import hashlib
import threading

import pytest
import trio

from layerfs.cache.chunkcache import ChunkCache
from layerfs.errors import StoreUnreachable
from layerfs.formats.chunktable import RAW, ChunkEntry
from layerfs.node.fetcher import ChunkFetcher, FetchError

DATA = b"chunk bytes " * 1000
ENTRY = ChunkEntry(0, len(DATA), hashlib.sha256(DATA).digest(), "sha256:" + "0" * 64, 0,
                   len(DATA), RAW)


class SlowStore:
    """Serves DATA for any range; the first call waits until released."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.release = threading.Event()
        self.fail = fail

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self.calls += 1
        if self.calls == 1:
            self.release.wait(10)
        if self.fail:
            raise StoreUnreachable("test store is down")
        return DATA


def fetcher(tmp_path, store, timeout: float = 5.0) -> ChunkFetcher:
    return ChunkFetcher(store, ChunkCache(tmp_path / "cache", 1 << 20), timeout=timeout)


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
            await trio.sleep(0.2)
            store.release.set()

    trio.run(main)
    assert results == [DATA] * 10 and store.calls == 1


def test_a_cancelled_owner_does_not_cancel_the_waiters(tmp_path):
    """Regression: the owner's Cancelled once reached other readers and ended the
    FUSE loop; now a waiter starts its own fetch."""
    store = SlowStore()
    f = fetcher(tmp_path, store)
    got: list[bytes] = []

    async def main() -> None:
        async def owner() -> None:
            with trio.move_on_after(0.2):
                await f.get(ENTRY)

        async def waiter() -> None:
            got.append(await f.get(ENTRY))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(owner)
            await trio.sleep(0.05)
            nursery.start_soon(waiter)
        store.release.set()

    trio.run(main)
    assert got == [DATA] and store.calls == 2


def test_a_failure_reaches_every_waiter_and_the_next_read_tries_again(tmp_path):
    store = SlowStore(fail=True)
    f = fetcher(tmp_path, store)
    errors: list[BaseException] = []

    async def main() -> None:
        async def read() -> None:
            try:
                await f.get(ENTRY)
            except FetchError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(read)
            await trio.sleep(0.1)
            store.release.set()
        store.fail = False
        await trio.sleep(2.1)  # the fail-fast window after a store failure
        assert await f.get(ENTRY) == DATA

    trio.run(main)
    assert len(errors) == 3 and store.calls == 2


def test_a_hung_store_is_eio_within_the_timeout(tmp_path):
    store = SlowStore()
    f = fetcher(tmp_path, store, timeout=0.5)

    async def main() -> None:
        start = trio.current_time()
        with pytest.raises(FetchError, match="timed out"):
            await f.get(ENTRY)
        assert trio.current_time() - start < 2

    trio.run(main)
    store.release.set()
