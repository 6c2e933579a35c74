"""Reading chunks back from the store: range read, decompress, verify.

Chunks that lie one after another in a pack form a run, which one range read
fetches; each chunk of it is still decoded and verified on its own. Used by
``layerfs verify``, by tools that assemble a local copy of a layer's data
blob, and by the node's fetcher.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain
from typing import TypeVar

import zstandard

from .errors import IntegrityError
from .formats.chunktable import ZSTD, ChunkEntry, ChunkTable
from .store.base import Store, blob_key

T = TypeVar("T")

RUN_SPAN = 4 << 20  # at most this many stored bytes in one range read of a run
RUN_GAP = 64 << 10  # a run reads over at most this many bytes between two chunks


@dataclass(frozen=True)
class FetchedChunk:
    """A chunk as read from the store: its verified bytes, and the zstd frame
    they were stored as (None for a chunk stored raw)."""

    data: bytes
    frame: bytes | None


def decode_chunk(entry: ChunkEntry, stored: bytes | memoryview) -> bytes:
    """Stored bytes → the chunk's bytes, checked against its sha256."""
    data = decode_view(entry, stored)
    return data if isinstance(data, bytes) else bytes(data)


def decode_view(entry: ChunkEntry, stored: bytes | memoryview) -> bytes | memoryview:
    """:func:`decode_chunk` without a copy of a chunk stored raw: ``stored``
    itself (a view, while it lives), checked."""
    if len(stored) != entry.stored_length:
        raise IntegrityError(_where(entry), f"short read ({len(stored)} bytes)")
    data: bytes | memoryview
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
    return fetch_chunk_frame(store, entry).data


def fetch_chunk_frame(store: Store, entry: ChunkEntry) -> FetchedChunk:
    """One chunk, verified, with the frame it was stored as."""
    stored = store.get(blob_key(entry.pack), entry.pack_offset,
                       entry.pack_offset + entry.stored_length)
    return _fetched(entry, stored)


def _fetched(entry: ChunkEntry, stored: bytes | memoryview) -> FetchedChunk:
    data = decode_chunk(entry, stored)
    return FetchedChunk(data, bytes(stored) if entry.compression == ZSTD else None)


def pack_runs(entries: Iterable[ChunkEntry], span: int = RUN_SPAN,
              gap: int = RUN_GAP) -> Iterator[list[ChunkEntry]]:
    """The entries, in the order given, cut into runs: each next entry of a run
    starts in the same pack at most ``gap`` bytes after the previous one ends,
    and a run's stored bytes from its first to its last entry are at most
    ``span`` (a single entry may be longer)."""
    run: list[ChunkEntry] = []
    for entry in entries:
        if run:
            last = run[-1]
            after = entry.pack_offset - (last.pack_offset + last.stored_length)
            end = entry.pack_offset + entry.stored_length
            if (entry.pack != last.pack or not 0 <= after <= gap
                    or end - run[0].pack_offset > span):
                yield run
                run = []
        run.append(entry)
    if run:
        yield run


def fetch_run(store: Store, run: list[ChunkEntry]) -> list[bytes | IntegrityError]:
    """One range read for a run (see :func:`pack_runs`); each chunk's bytes, or
    the IntegrityError that chunk alone failed with."""
    return [r if isinstance(r, IntegrityError) else r.data for r in fetch_run_frames(store, run)]


def _run_slices(store: Store, run: list[ChunkEntry]) -> Iterator[tuple[ChunkEntry, memoryview]]:
    """One range read of ``run`` (see :func:`pack_runs`): each entry with its
    stored bytes, a view of the read."""
    base = run[0].pack_offset
    stored = memoryview(store.get(blob_key(run[0].pack), base,
                                  run[-1].pack_offset + run[-1].stored_length))
    for entry in run:
        at = entry.pack_offset - base
        yield entry, stored[at:at + entry.stored_length]


def fetch_run_views(store: Store, run: list[ChunkEntry]
                    ) -> list[bytes | memoryview | IntegrityError]:
    """One range read of ``run``, each chunk decoded and checked, those
    stored raw as views of the read (no copy): for a caller that writes them
    out at once."""
    return _decoded_run(store, run, decode_view)


def fetch_run_frames(store: Store, run: list[ChunkEntry]) -> list[FetchedChunk | IntegrityError]:
    """:func:`fetch_run`, each chunk with the frame it was stored as."""
    return _decoded_run(store, run, _fetched)


def _decoded_run(store: Store, run: list[ChunkEntry],
                 decode: Callable[[ChunkEntry, memoryview], T]) -> list[T | IntegrityError]:
    """One range read of ``run``, each chunk through ``decode`` (its
    IntegrityError in its place)."""
    out: list[T | IntegrityError] = []
    for entry, stored in _run_slices(store, run):
        try:
            out.append(decode(entry, stored))
        except IntegrityError as exc:
            out.append(exc)
    return out


def fetch_chunks(store: Store, entries: Iterable[ChunkEntry],
                 workers: int = 8) -> Iterator[tuple[ChunkEntry, bytes]]:
    """Fetch and verify chunks in parallel, a run per range read, yielding them
    in the given order; raises the first IntegrityError."""
    def one(run: list[ChunkEntry]) -> list[tuple[ChunkEntry, bytes]]:
        out = []
        for entry, result in zip(run, fetch_run(store, run), strict=True):
            if isinstance(result, IntegrityError):
                raise result
            out.append((entry, result))
        return out

    with ThreadPoolExecutor(workers) as pool:
        yield from chain.from_iterable(pool.map(one, pack_runs(entries)))


def materialize_blob(store: Store, table: ChunkTable, path: str) -> None:
    """Write the layer's whole data blob to a local (sparse) file."""
    with open(path, "wb") as f:
        f.truncate(table.blob_size)
        for entry, data in fetch_chunks(store, table.entries):
            os.pwrite(f.fileno(), data, entry.blob_offset)
