"""Sealed LSMT block layers: from a raw disk image (``layerfs build-disk``) or
from a writable disk's changes (``layerfs disk commit``), published through
the same chunk / sha256 / zstd / pack / dedup path as EROFS layers.

The sealed file is chunked as one linear file (see
:mod:`layerfs.formats.lsmt` for its layout): the disk's bytes sit at
``4096 + disk offset``, so all-zero chunks are holes that are not stored and a
changed region of the disk changes the same chunks in every version.
"""

from __future__ import annotations

import os
import uuid as uuidlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass

from layerfs.errors import SourceError, UsageError
from layerfs.formats import lsmt
from layerfs.manifest import BlobRef, DiskManifest, LayerStats
from layerfs.names import check_name, check_version
from layerfs.refstore import LAYERS, RefStore

from .layer import check_chunk_size, existing_version, now_utc, publish_verified
from .pipeline import DEFAULT_CHUNK_SIZE, ChunkPipeline, DedupIndex

BLOCK = 4096
ZERO = bytes(BLOCK)

# Reads disk bytes [offset, offset + length) of the source; used to fill windows.
Reader = Callable[[int, int], bytes]


@dataclass
class DiskSource:
    """What a sealed layer holds: the disk size, its mappings, and how to read them."""

    virtual_size: int
    mappings: list[lsmt.Mapping]  # sorted; moffset = data sector in the sealed file
    read: Reader


@dataclass
class DiskResult:
    ref: str
    digest: str
    manifest: DiskManifest
    published: bool
    uploaded_bytes: int = 0  # what this push wrote (0 if the version existed already)


def deterministic_uuid(name: str, version: str) -> str:
    return str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"layerfs:{name}@{version}"))


def scan_image(path: str, parent: bool) -> DiskSource:
    """Map the non-zero 4 KiB blocks of a raw image; with a parent, zero ranges
    become zeroed entries so that they hide what the parent holds there."""
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise SourceError(path, exc.strerror) from None
    if size == 0 or size % lsmt.SECTOR:
        raise SourceError(path, f"disk image size {size} is not a positive multiple of 512")
    runs: list[tuple[int, int, bool]] = []  # (start byte, end byte, has data)
    with open(path, "rb") as f:
        pos = 0
        while pos < size:
            block = f.read(min(BLOCK, size - pos))
            if not block:
                raise SourceError(path, "image changed while reading")
            data = block != ZERO[: len(block)]
            if runs and runs[-1][2] == data and runs[-1][1] == pos:
                runs[-1] = (runs[-1][0], pos + len(block), data)
            else:
                runs.append((pos, pos + len(block), data))
            pos += len(block)
    mappings: list[lsmt.Mapping] = []
    for start, end, data in runs:
        if data or parent:
            sector, count = start // lsmt.SECTOR, (end - start) // lsmt.SECTOR
            mappings += lsmt.split_extent(sector, count, sector + BLOCK // lsmt.SECTOR,
                                          zeroed=not data)

    def read(offset: int, length: int) -> bytes:
        with open(path, "rb") as f:
            return os.pread(f.fileno(), length, offset)

    return DiskSource(size, mappings, read)


def sealed_windows(src: DiskSource, chunk_size: int, uid: str, parent_uuid: str,
                   ) -> tuple[Iterator[tuple[int, bytes]], lsmt.SealedLayout, int]:
    """The sealed file as chunk windows (holes skipped), its layout and entry count."""
    layout = lsmt.SealedLayout(src.virtual_size, chunk_size)
    data_maps = [m for m in src.mappings if not m.zeroed]
    index = lsmt.pack_index(src.mappings)
    trailer = lsmt.sealed_trailer(layout, len(src.mappings), uid, parent_uuid)

    def windows() -> Iterator[tuple[int, bytes]]:
        header = lsmt.sealed_header(src.virtual_size, uid, parent_uuid)
        yield from _data_windows(src, data_maps, chunk_size, header)
        tail = index + trailer
        for off in range(0, len(tail), chunk_size):
            yield layout.index_offset + off, tail[off : off + chunk_size]

    return windows(), layout, len(src.mappings)


def _data_windows(src: DiskSource, maps: list[lsmt.Mapping], chunk_size: int,
                  header: bytes) -> Iterator[tuple[int, bytes]]:
    """Windows of [0, index offset) that hold the header or mapped data."""
    by_window: dict[int, list[lsmt.Mapping]] = {0: []}
    for m in maps:
        first = (lsmt.HT_SPACE + m.offset * lsmt.SECTOR) // chunk_size
        last = (lsmt.HT_SPACE + m.end * lsmt.SECTOR - 1) // chunk_size
        for w in range(first, last + 1):
            by_window.setdefault(w, []).append(m)
    for w in sorted(by_window):
        start = w * chunk_size
        buf = bytearray(chunk_size)
        if w == 0:
            buf[: len(header)] = header
        for m in by_window[w]:
            lo = max(start, lsmt.HT_SPACE + m.offset * lsmt.SECTOR)
            hi = min(start + chunk_size, lsmt.HT_SPACE + m.end * lsmt.SECTOR)
            buf[lo - start : hi - start] = src.read(lo - lsmt.HT_SPACE, hi - lo)
        end = min(chunk_size, lsmt.HT_SPACE + src.virtual_size - start)
        yield start, bytes(buf[:end]) if end < chunk_size else bytes(buf)


def publish_disk(refstore: RefStore, src: DiskSource, name: str, version: str,
                 parent_ref: str | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 dedup_with: Iterable[str] = ()) -> DiskResult:
    check_name(name)
    check_version(version)
    check_chunk_size(chunk_size)
    store = refstore.store
    parent, parent_uuid, index, sources = None, "", DedupIndex(), []
    if parent_ref:
        parent = refstore.resolve(LAYERS, parent_ref)
        chain = refstore.disk_chain(parent)
        if len(chain) >= lsmt.MAX_LAYERS:
            raise UsageError(f"{parent_ref} already has {len(chain)} layers; "
                             f"the limit is {lsmt.MAX_LAYERS}")
        parent_uuid = chain[0][1].uuid
        for _, m in chain:
            index.add_table(refstore.chunk_table(m))
        sources.append(parent_ref)
    existing = refstore.read_ref(LAYERS, name, version)
    for ref in dedup_with:
        index.add_table(refstore.chunk_table(refstore.any_layer(refstore.resolve(LAYERS, ref))))
        sources.append(ref)
    if existing:
        index.add_table(refstore.chunk_table(refstore.disk(existing)))
    uid = deterministic_uuid(name, version)
    windows, layout, entries = sealed_windows(src, chunk_size, uid, parent_uuid)
    pipeline = ChunkPipeline(store, index, chunk_size, upload=existing is None)
    try:
        pipeline.add_windows(windows)
        pipeline.set_blob_size(layout.file_size(entries))
        result = pipeline.finish()
    finally:
        pipeline.close()
    ref = f"{name}@{version}"
    content = result.table.content_key()

    seen: dict[str, DiskManifest] = {}

    def same(other: str) -> bool:
        if other not in seen:
            seen[other] = refstore.disk(other)
        old = seen[other]
        return (old.parent == parent and old.virtual_size == src.virtual_size
                and refstore.chunk_table(old).content_key() == content)

    if existing_version(ref, existing, same):
        return DiskResult(ref, existing or "", seen[existing or ""], published=False)
    table = result.table.to_bytes()
    table_digest, up = store.put_blob(table)
    stats = LayerStats(**asdict(result.stats))
    stats.uploaded_bytes += len(table) * up
    stats.file_bytes = sum(m.length for m in src.mappings if not m.zeroed) * lsmt.SECTOR
    manifest = DiskManifest(
        name=name, version=version, chunk_size=chunk_size,
        chunk_table=BlobRef(table_digest, len(table)), blob_size=result.table.blob_size,
        virtual_size=src.virtual_size, uuid=uid, parent=parent, parent_ref=parent_ref,
        index_offset=layout.index_offset, index_entries=entries + (-entries % lsmt.INDEX_ALIGN),
        created=now_utc(), stats=stats, dedup_sources=sources)
    manifest_bytes = manifest.checked_bytes()
    digest, _ = store.put_blob(manifest_bytes)
    held = {table_digest: table, digest: manifest_bytes}
    named, created = publish_verified(refstore, name, version, digest, result.reused, held, same)
    if not created:  # a concurrent push of the same disk published first
        return DiskResult(ref, named, refstore.disk(named) if named != digest else manifest,
                          published=False)
    return DiskResult(ref, digest, manifest, published=True, uploaded_bytes=stats.uploaded_bytes)


def build_disk(refstore: RefStore, image: str, name: str, version: str,
               parent_ref: str | None = None,
               chunk_size: int = DEFAULT_CHUNK_SIZE,
               dedup_with: Iterable[str] = ()) -> DiskResult:
    """Import a raw disk image as a sealed LSMT layer."""
    if not os.path.isfile(image):
        raise SourceError(image, "not a regular file" if os.path.exists(image) else
                          "no such file or directory")
    src = scan_image(image, parent=parent_ref is not None)
    return publish_disk(refstore, src, name, version, parent_ref, chunk_size, dedup_with)
