"""Stores and fetchers for read-path tests: a store that answers ranges from
memory, a fetcher over it, trio runs."""

from __future__ import annotations

import hashlib
import os

import trio
import trio.testing

from layerfs.formats.chunktable import RAW, ChunkEntry
from layerfs.node.reads.chunkcache import ChunkCache
from layerfs.node.reads.fetcher import ChunkFetcher
from layerfs.store.base import blob_key


def fetcher(tmp_path, store, timeout: float = 5.0) -> ChunkFetcher:
    return ChunkFetcher(store, ChunkCache(tmp_path / "cache", 1 << 20), timeout=timeout)


def run(main, clock: trio.testing.MockClock | None = None) -> None:
    """``trio.run(main)`` on a mock clock, by default one that stands still."""
    trio.run(main, clock=clock or trio.testing.MockClock())


def run_entries(sizes: list[int], pack: str, start: int = 0,
                gaps: dict[int, int] | None = None) -> tuple[list[ChunkEntry], bytes]:
    """Chunks of the given sizes stored one after another in ``pack`` (with
    ``gaps[i]`` bytes before chunk i); their entries and the pack's bytes."""
    entries, stored, at = [], b"", start
    for i, size in enumerate(sizes):
        gap = (gaps or {}).get(i, 0)
        stored += b"\0" * gap
        at += gap
        data = os.urandom(size)
        entries.append(ChunkEntry(at, size, hashlib.sha256(data).digest(), pack, at, size, RAW))
        stored += data
        at += size
    return entries, b"\0" * start + stored


class RangeStore:
    """Serves ranges of packs by key; records each call."""

    def __init__(self, packs: dict[str, bytes]) -> None:
        self.packs = {blob_key(name): data for name, data in packs.items()}
        self.calls: list[tuple[str, int | None, int | None]] = []

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self.calls.append((key, start, end))
        return self.packs[key][start:end]
