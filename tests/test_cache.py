"""The chunk cache's files: whole and partial reads, damage, the older format."""

from __future__ import annotations

import hashlib
import os

import xxhash

from layerfs.cache.chunkcache import ChunkCache
from layerfs.cache.chunkfile import BLOCK, HEADER, HEADER_V1, MAGIC_V1

DATA = os.urandom(BLOCK * 6 + 1000)
SHA = hashlib.sha256(DATA).hexdigest()


def cached(tmp_path) -> ChunkCache:
    cache = ChunkCache(tmp_path / "cache", 64 << 20)
    cache.write(SHA, DATA)
    return cache


def test_whole_and_partial_reads(tmp_path):
    cache = cached(tmp_path)
    assert cache.read(SHA) == DATA
    for lo, hi in [(0, 1), (0, BLOCK), (BLOCK - 1, BLOCK + 1), (5 * BLOCK + 7, len(DATA)),
                   (len(DATA), len(DATA)), (123, 4 * BLOCK + 5)]:
        assert cache.read_range(SHA, lo, hi) == DATA[lo:hi], (lo, hi)
    assert cache.snapshot()["hits"] == 7


def test_a_damaged_block_is_never_served(tmp_path):
    cache = cached(tmp_path)
    path = cache._path(SHA)
    raw = bytearray(path.read_bytes())
    raw[len(raw) - len(DATA) + 3 * BLOCK + 10] ^= 1  # one bit of block 3
    path.write_bytes(raw)
    assert cache.read_range(SHA, 0, BLOCK) == DATA[:BLOCK]  # blocks 0 and 1 are intact
    assert cache.read_range(SHA, 2 * BLOCK, 3 * BLOCK + 20) is None
    assert not path.exists() and cache.snapshot()["corrupt"] == 1
    assert cache.read(SHA) is None  # gone from the index: a miss, fetched again


def test_a_restarted_cache_learns_block_layouts_from_headers(tmp_path):
    cached(tmp_path)
    cache = ChunkCache(tmp_path / "cache", 64 << 20)  # after a restart: nothing in memory
    assert SHA not in cache._layouts
    assert cache.read_range(SHA, BLOCK + 3, BLOCK + 50) == DATA[BLOCK + 3 : BLOCK + 50]
    assert SHA in cache._layouts
    path = cache._path(SHA)
    raw = bytearray(path.read_bytes())
    raw[HEADER.size + 8 * 2] ^= 1  # the stored digest of block 2
    path.write_bytes(raw)
    # the digests known in memory still check the data, which is intact
    assert cache.read_range(SHA, 2 * BLOCK, 2 * BLOCK + 9) == DATA[2 * BLOCK : 2 * BLOCK + 9]
    fresh = ChunkCache(tmp_path / "cache", 64 << 20)
    assert fresh.read_range(SHA, 2 * BLOCK, 2 * BLOCK + 9) is None  # read from the header
    assert SHA not in fresh._layouts and not path.exists()
    fresh.write(SHA, DATA)  # fetched again: the new file's layout is the one kept
    assert fresh.read_range(SHA, 2 * BLOCK, 2 * BLOCK + 9) == DATA[2 * BLOCK : 2 * BLOCK + 9]


def test_a_torn_file_is_never_served(tmp_path):
    cache = cached(tmp_path)
    path = cache._path(SHA)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 5)
    assert cache.read_range(SHA, len(DATA) - 10, len(DATA)) is None
    cache.write(SHA, DATA)
    with open(cache._path(SHA), "r+b") as f:
        f.truncate(HEADER.size + 3)
    assert cache.read(SHA) is None
    assert cache.snapshot()["corrupt"] == 2


def test_files_of_the_first_format_are_still_read(tmp_path):
    cache = ChunkCache(tmp_path / "cache", 64 << 20)
    path = cache._path(SHA)
    path.parent.mkdir(parents=True)
    path.write_bytes(HEADER_V1.pack(MAGIC_V1, xxhash.xxh3_64_intdigest(DATA), len(DATA)) + DATA)
    cache = ChunkCache(tmp_path / "cache", 64 << 20)  # indexes it at start
    assert cache.read(SHA) == DATA
    assert cache.read_range(SHA, 10, BLOCK * 2) == DATA[10 : BLOCK * 2]
    raw = path.read_bytes()
    path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    assert cache.read(SHA) is None and not path.exists()
