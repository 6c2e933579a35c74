"""Reading chunks back from the store: range read, decompress, verify.

Used by ``layerfs verify``, by tools that assemble a local copy of a layer's
data blob, and by the node's fetcher.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import zstandard

from .errors import IntegrityError
from .formats.chunktable import ZSTD, ChunkEntry, ChunkTable
from .store.base import Store, blob_key


def decode_chunk(entry: ChunkEntry, stored: bytes) -> bytes:
    """Stored bytes → the chunk's bytes, checked against its sha256."""
    if len(stored) != entry.stored_length:
        raise IntegrityError(_where(entry), f"short read ({len(stored)} bytes)")
    if entry.compression == ZSTD:
        try:
            data = zstandard.ZstdDecompressor().decompress(
                stored, max_output_size=entry.length
            )
        except zstandard.ZstdError as exc:
            raise IntegrityError(_where(entry), f"cannot decompress ({exc})") from None
    else:
        data = stored
    if len(data) != entry.length or hashlib.sha256(data).digest() != entry.sha256:
        raise IntegrityError(_where(entry), "sha256 mismatch")
    return data


def _where(entry: ChunkEntry) -> str:
    return f"chunk {entry.sha256.hex()[:16]} (pack {entry.pack[7:23]} @ {entry.pack_offset})"


def fetch_chunk(store: Store, entry: ChunkEntry) -> bytes:
    stored = store.get(blob_key(entry.pack), entry.pack_offset,
                       entry.pack_offset + entry.stored_length)
    return decode_chunk(entry, stored)


def fetch_chunks(store: Store, entries: Iterable[ChunkEntry],
                 workers: int = 8) -> Iterator[tuple[ChunkEntry, bytes]]:
    """Fetch and verify chunks in parallel, yielding them in the given order."""
    with ThreadPoolExecutor(workers) as pool:
        yield from pool.map(lambda e: (e, fetch_chunk(store, e)), entries)


def materialize_blob(store: Store, table: ChunkTable, path: str) -> None:
    """Write the layer's whole data blob to a local (sparse) file."""
    with open(path, "wb") as f:
        f.truncate(table.blob_size)
        for entry, data in fetch_chunks(store, table.entries):
            os.pwrite(f.fileno(), data, entry.blob_offset)
