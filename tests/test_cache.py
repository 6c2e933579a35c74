"""The chunk cache's files: whole and partial reads, damage, files of another chunk, and
the earlier formats."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import struct

import pytest
import xxhash
import zstandard
from support import MiB, need_root, small_ext4

from layerfs.node.reads.chunkcache import ChunkCache
from layerfs.node.reads.chunkfile import BLOCK, HEADER, ZSTD_HEADER, ZSTD_MAGIC, Damaged, blocks_of

DATA = os.urandom(BLOCK * 6 + 1000)
SHA = hashlib.sha256(DATA).hexdigest()
HEADER_V1 = struct.Struct("<8sQQ")  # the first format: magic, xxh3 of all, length
HEADER_V2 = struct.Struct("<8sQIIQ")  # the second: magic, length, block, blocks, xxh3


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


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.reads\.chunkcache: cache file \S+ is damaged")
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


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.reads\.chunkcache: cache file \S+ is damaged")
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


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.reads\.chunkcache: cache file \S+ is damaged")
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


OTHER = os.urandom(BLOCK * 6 + 1000)  # another chunk of the same length
OTHER_SHA = hashlib.sha256(OTHER).hexdigest()


def swapped(tmp_path) -> ChunkCache:
    """A cache whose file for SHA was replaced by the (valid) file of OTHER."""
    cache = cached(tmp_path)
    cache.write(OTHER_SHA, OTHER)
    os.replace(cache._path(OTHER_SHA), cache._path(SHA))
    return cache


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.reads\.chunkcache: cache file \S+ is damaged")
def test_a_file_of_another_chunk_is_never_served(tmp_path, caplog):
    cache = swapped(tmp_path)
    assert cache.read(SHA) is None
    assert cache.snapshot()["corrupt"] == 1 and not cache._path(SHA).exists()
    assert f"holds chunk {OTHER_SHA}" in caplog.text
    swapped(tmp_path / "2")
    fresh = ChunkCache(tmp_path / "2" / "cache", 64 << 20)  # no layout in memory
    assert fresh.read_range(SHA, 10, 20) is None
    assert fresh.snapshot()["corrupt"] == 1 and SHA not in fresh._layouts


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.reads\.chunkcache: cache file \S+ is damaged")
def test_a_file_of_another_chunk_fails_the_block_digests_kept_in_memory(tmp_path):
    cache = swapped(tmp_path)
    assert SHA in cache._layouts
    assert cache.read_range(SHA, 10, 20) is None
    assert cache.snapshot()["corrupt"] == 1 and not cache._path(SHA).exists()


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.reads\.chunkcache: cache file \S+ is damaged")
def test_a_bad_file_found_by_two_readers_is_counted_once(tmp_path):
    cache = swapped(tmp_path)
    path = cache._path(SHA)
    late = os.open(path, os.O_RDONLY)  # a second reader, which opened it too
    try:
        inode = os.fstat(late).st_ino
        assert cache.read(SHA) is None  # the first reader drops it
        cache._unusable(SHA, path, inode, Damaged("found late"))
        assert cache.snapshot()["corrupt"] == 1
        cache.write(SHA, DATA)  # fetched again; the late reader must not drop the new file
        cache._unusable(SHA, path, inode, Damaged("found late"))
        assert cache.read(SHA) == DATA and cache.snapshot()["corrupt"] == 1
    finally:
        os.close(late)


def test_files_of_earlier_formats_are_dropped(tmp_path):
    cache = ChunkCache(tmp_path / "cache", 64 << 20)
    path = cache._path(SHA)
    path.parent.mkdir(parents=True)
    v1 = HEADER_V1.pack(b"LFSCACH1", xxhash.xxh3_64_intdigest(DATA), len(DATA)) + DATA
    v2 = HEADER_V2.pack(b"LFSCACH2", len(DATA), BLOCK, blocks_of(len(DATA)),
                        xxhash.xxh3_64_intdigest(DATA)) + bytes(8 * blocks_of(len(DATA))) + DATA
    for old in (v1, v2):
        path.write_bytes(old)
        cache = ChunkCache(tmp_path / "cache", 64 << 20)  # indexes it at start
        assert cache.read(SHA) is None and not path.exists()
        path.write_bytes(old)
        cache = ChunkCache(tmp_path / "cache", 64 << 20)
        assert cache.read_range(SHA, 10, 20) is None and not path.exists()
        assert cache.snapshot()["outdated"] == 1 and cache.snapshot()["corrupt"] == 0
        cache.write(SHA, DATA)  # fetched again, in the current format
        assert cache.read(SHA) == DATA


# -- the zstd form (--cache-form stored) --

TEXT = b"".join(b"line %d of a compressible chunk\n" % i for i in range(20000))
TEXT_SHA = hashlib.sha256(TEXT).hexdigest()
FRAME = zstandard.ZstdCompressor().compress(TEXT)


def zstd_cached(tmp_path) -> ChunkCache:
    cache = ChunkCache(tmp_path / "cache", 64 << 20, compressed=True)
    cache.write(TEXT_SHA, TEXT, FRAME)
    return cache


def test_a_compressed_cache_keeps_the_frame_and_reads_it_back_whole_or_in_part(tmp_path):
    cache = zstd_cached(tmp_path)
    path = cache._path(TEXT_SHA)
    assert path.read_bytes()[:8] == ZSTD_MAGIC
    assert path.stat().st_size == ZSTD_HEADER.size + len(FRAME) < len(TEXT) // 4
    assert cache.snapshot()["bytes_written"] == path.stat().st_size
    assert cache.read(TEXT_SHA) == TEXT
    assert cache.reads_whole(TEXT_SHA)  # a part needs the whole file: all of it comes back
    assert cache.read_range(TEXT_SHA, 10, 20) == TEXT
    fresh = ChunkCache(tmp_path / "cache", 64 << 20)  # a restart, as a plain cache
    assert not fresh.reads_whole(TEXT_SHA)  # not known until its header is read
    assert fresh.read_range(TEXT_SHA, 10, 20) == TEXT and fresh.reads_whole(TEXT_SHA)
    fresh.write(SHA, DATA, b"ignored: this cache keeps chunks plain")
    assert fresh._path(SHA).read_bytes()[:8] == b"LFSCACH3" and fresh.read(SHA) == DATA


def test_a_chunk_without_a_frame_is_kept_plain_in_a_compressed_cache(tmp_path):
    cache = ChunkCache(tmp_path / "cache", 64 << 20, compressed=True)
    cache.write(SHA, DATA)  # stored raw in the store: no frame
    assert cache._path(SHA).read_bytes()[:8] == b"LFSCACH3"
    assert cache.read_range(SHA, 5, 9) == DATA[5:9] and not cache.reads_whole(SHA)


def test_a_block_layers_chunks_are_kept_plain_in_a_compressed_cache(tmp_path):
    """A guest reads a disk's or its RAM's chunks in blocks: kept plain, a
    part is read alone; once no block layer names them, frames are kept again."""
    cache = ChunkCache(tmp_path / "cache", 64 << 20, compressed=True)
    cache.keep_plain([TEXT_SHA])
    cache.keep_plain([TEXT_SHA])  # (two disks' chains)
    cache.write(TEXT_SHA, TEXT, FRAME)
    assert cache._path(TEXT_SHA).read_bytes()[:8] == b"LFSCACH3"
    assert not cache.reads_whole(TEXT_SHA) and cache.read(TEXT_SHA) == TEXT
    cache.forget_plain([TEXT_SHA])
    cache.forget_plain([TEXT_SHA])
    other = b"another compressible chunk\n" * 5000
    cache.keep_plain([TEXT_SHA])
    cache.forget_plain([TEXT_SHA])
    sha = hashlib.sha256(other).hexdigest()
    cache.write(sha, other, zstandard.ZstdCompressor().compress(other))
    assert cache._path(sha).read_bytes()[:8] == ZSTD_MAGIC


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.reads\.chunkcache: cache file \S+ is damaged")
@pytest.mark.parametrize("damage", ["frame bit", "torn", "header length", "other chunk"])
def test_a_damaged_compressed_file_is_never_served(tmp_path, damage):
    cache = zstd_cached(tmp_path)
    path = cache._path(TEXT_SHA)
    raw = bytearray(path.read_bytes())
    if damage == "frame bit":
        raw[ZSTD_HEADER.size + len(FRAME) // 2] ^= 1
    elif damage == "torn":
        del raw[-7:]
    elif damage == "header length":  # decompresses, but not to the length the header says
        raw[8:16] = (len(TEXT) - 1).to_bytes(8, "little")
    else:  # a file of another chunk put in this one's place
        raw[32:64] = hashlib.sha256(b"another chunk").digest()
    path.write_bytes(raw)
    assert cache.read(TEXT_SHA) is None
    assert not path.exists() and cache.snapshot()["corrupt"] == 1


def test_a_full_file_system_evicts_and_then_serves_without_caching(tmp_path):
    """A cache bounded above what its file system holds: a write that meets
    ENOSPC evicts the least recently used files and is tried again (the newest
    chunk is cached); with nothing left to evict it fails (the caller serves
    the chunk from memory), counted, and leaves no temporary file behind."""
    need_root()
    with small_ext4(tmp_path, 16 * MiB) as small:
        cache = ChunkCache(small / "cache", 1 << 30)
        chunks = [os.urandom(1 << 20) for _ in range(24)]  # 24 MiB on a 16 MiB file system
        for data in chunks:
            cache.write(sha(data), data)
        stats = cache.snapshot()
        assert stats["no_space_evictions"] > 0 and stats["evictions"] > 0
        assert cache.read(sha(chunks[-1])) == chunks[-1]
        shutil.rmtree(small / "cache")
        empty = ChunkCache(small / "empty", 1 << 30)
        fill_up(small / "filler")
        data = os.urandom(1 << 20)
        with pytest.raises(OSError) as failed:
            empty.write(sha(data), data)
        assert failed.value.errno == errno.ENOSPC
        assert not empty.contains(sha(data)) and empty.snapshot()["not_cached"] == 1
        assert list((small / "empty" / "tmp").iterdir()) == []


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fill_up(path) -> None:
    """Write ``path`` until its file system is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, bytes(1 << 20)):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
