"""Build a layer from a source and publish it: packs, chunk table, meta, manifest, ref.

The publish recipe, one for layers and sealed disks (both are ``layers/`` refs;
:func:`layerfs.builder.disk.publish_disk` follows it too). A version is
immutable, and its content (not its manifest's bytes, which hold the creation
time and upload counts) says whether two pushes are the same:

1. :func:`existing_version`: if ``name@version`` exists, the push compares
   content without uploading: the same is a success that writes nothing,
   other content is :class:`VersionExists`;
2. the push uploads its blobs and its manifest;
3. :func:`publish_verified` writes the ref once. A concurrent push of the same
   content that got there first is a success too (the loser reports the
   winner's manifest); then every blob this push reused, or holds, is checked
   to have survived a concurrent gc.

``same`` is the kind's comparison: given a manifest's digest, whether it has
this push's content. A layer's content is
:class:`~layerfs.manifest.LayerIdentity`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Protocol

import zstandard

from layerfs.errors import BlobVanished, SourceError, UsageError, VersionExists
from layerfs.formats.erofs import ErofsError, write_meta_image
from layerfs.manifest import (
    CHUNK_SIZE_RULE,
    ROLES,
    BlobRef,
    LayerIdentity,
    LayerManifest,
    LayerStats,
    MetaRef,
    TarSplitRef,
    table_content,
    valid_chunk_size,
)
from layerfs.names import check_name, check_version
from layerfs.refstore import LAYERS, RefStore, ref_key
from layerfs.store.base import blob_key, sha256_digest
from layerfs.tree import FileTree

from .assembler import LayerAssembler
from .dirsource import DirectorySource, UpperSource
from .pipeline import DEFAULT_CHUNK_SIZE, DEFAULT_PACK_SIZE, ChunkPipeline, DedupIndex
from .tarsource import TarSource, open_tar

META_ZSTD_LEVEL = 9
VERIFY_WORKERS = 8
Same = Callable[[str], bool]  # a manifest's digest -> whether it has this content


@dataclass
class BuildOptions:
    name: str
    version: str
    role: str = "base"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    dedup_with: list[str] = field(default_factory=list)
    pack_size: int = DEFAULT_PACK_SIZE
    workers: int = max(2, min(4, os.cpu_count() or 2))

    def check(self) -> None:
        check_name(self.name)
        check_version(self.version)
        if self.role not in ROLES:
            raise UsageError(f"invalid role {self.role!r} (expected one of {', '.join(ROLES)})")
        check_chunk_size(self.chunk_size)


def check_chunk_size(chunk_size: int) -> None:
    """UsageError unless ``chunk_size`` is one a layer may have."""
    if not valid_chunk_size(chunk_size):
        raise UsageError(f"chunk size {chunk_size} must be {CHUNK_SIZE_RULE}")


@dataclass
class BuildResult:
    ref: str
    digest: str
    manifest: LayerManifest
    published: bool  # False: the version existed with this content; nothing written
    uploaded_bytes: int = 0  # what this push wrote (0 if the version existed already)
    uploaded_packs: int = 0


@dataclass
class Progress:
    on_file: Callable[[], None] | None = None
    on_bytes: Callable[[int], None] | None = None
    on_warning: Callable[[str], None] | None = None


class LayerSource(Protocol):
    """What a build reads: entries fed once, in order, to an assembler."""

    def feed(self, asm: LayerAssembler) -> None: ...


def open_source(path: str) -> DirectorySource | TarSource:
    """A directory, or a tar opened once (a FIFO or pipe cannot be read twice)."""
    if path != "-" and not os.path.lexists(path):
        raise SourceError(path, "no such file or directory")
    if os.path.isdir(path):
        return DirectorySource(path)
    return open_tar(path)


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def build_layer(refstore: RefStore, src: str, opts: BuildOptions,
                progress: Progress | None = None,
                source: DirectorySource | TarSource | UpperSource | LayerSource | None = None,
                origin: str = "", assembler: type[LayerAssembler] = LayerAssembler,
                tar_split: Callable[[FileTree], tuple[bytes, TarSplitRef] | None] | None = None,
                shared: DedupIndex | None = None) -> BuildResult:
    """Build ``src`` (or, if given, ``source``, named ``src`` in errors) into a layer;
    ``origin`` is recorded in the manifest (``oci:<diff_id>`` for an image layer),
    and so is the tar-split record ``tar_split`` makes of the finished tree, if any
    (stored as one more blob). ``shared``: chunks of other layers, loaded once by
    the caller for many builds, that this one may reuse too; the refs among them
    whose chunks it reuses join the manifest's ``dedup_sources``."""
    opts.check()
    source = source or open_source(src)
    store = refstore.store
    existing = refstore.read_ref(LAYERS, opts.name, opts.version)
    index, sources, old = _dedup_index(refstore, opts, existing, shared)
    progress = progress or Progress()
    pipeline = ChunkPipeline(store, index, opts.chunk_size, upload=existing is None,
                             pack_size=opts.pack_size, workers=opts.workers,
                             on_bytes=progress.on_bytes)
    asm = assembler(pipeline, on_file=progress.on_file, on_warning=progress.on_warning)
    try:
        source.feed(asm)
        tree = asm.finish()
        result = pipeline.finish()
        asm.place_chunks(result.file_chunks)
        split = tar_split(tree) if tar_split else None
    finally:
        pipeline.close()
    try:
        meta = write_meta_image(tree, result.blob_blocks, opts.chunk_size.bit_length() - 1)
    except ErofsError as exc:
        raise SourceError(src, str(exc)) from None
    table = result.table.to_bytes()
    if shared is not None:
        sources += [ref for ref in shared.sources_of(result.table) if ref not in sources]
    ref = f"{opts.name}@{opts.version}"
    identity = LayerIdentity("erofs", opts.role, opts.chunk_size, result.table.blob_size,
                             sha256_digest(meta), len(meta), table_content(result.table))

    def same(other: str) -> bool:  # (the existing version's manifest is loaded already)
        if old is not None and other == existing:
            return old[0].identity(old[1]) == identity
        return _same_layer(refstore, other, identity)

    if existing_version(ref, existing, same) and old is not None:
        return BuildResult(ref, existing or "", old[0], published=False)

    stats = LayerStats(**asdict(asm.counts), **asdict(result.stats))
    table_digest, up_table = store.put_blob(table)
    packed_meta = zstandard.ZstdCompressor(level=META_ZSTD_LEVEL).compress(meta)
    meta_digest, up_meta = store.put_blob(packed_meta)
    stats.uploaded_bytes += len(table) * up_table + len(packed_meta) * up_meta
    held = {table_digest: table, meta_digest: packed_meta}
    if split is not None:
        _, up_split = store.put_blob(split[0], split[1].digest)
        stats.uploaded_bytes += len(split[0]) * up_split
        held[split[1].digest] = split[0]
    manifest = LayerManifest(
        name=opts.name, version=opts.version, role=opts.role, chunk_size=opts.chunk_size,
        meta=MetaRef(meta_digest, len(packed_meta), sha256_digest(meta), len(meta)),
        chunk_table=BlobRef(table_digest, len(table)),
        blob_size=result.table.blob_size, created=now_utc(), stats=stats,
        dedup_sources=sources, source=origin, tar_split=split[1] if split else None,
    )
    manifest_bytes = manifest.checked_bytes()
    digest, _ = store.put_blob(manifest_bytes)
    held[digest] = manifest_bytes
    named, created = publish_verified(refstore, opts.name, opts.version, digest, result.reused,
                                      held, same)
    if not created:  # a concurrent build of the same source published first
        return BuildResult(ref, named, refstore.layer(named) if named != digest else manifest,
                           False, stats.uploaded_bytes, stats.uploaded_packs)
    return BuildResult(ref, digest, manifest, True, stats.uploaded_bytes, stats.uploaded_packs)


def _same_layer(refstore: RefStore, digest: str, identity: LayerIdentity) -> bool:
    """Whether the layer manifest at ``digest`` has this content."""
    manifest = refstore.layer(digest)
    return manifest.identity(refstore.chunk_table(manifest)) == identity


def _dedup_index(refstore: RefStore, opts: BuildOptions, existing: str | None,
                 shared: DedupIndex | None):
    """Chunks already stored that this build may reference instead of uploading."""
    index = DedupIndex(below=shared)
    sources: list[str] = []
    old = None
    if existing is not None:
        manifest = refstore.layer(existing)
        old = (manifest, refstore.chunk_table(manifest))
        index.add_table(old[1])
    prev = refstore.previous_version(opts.name, opts.version)
    refs = ([f"{opts.name}@{prev}"] if prev else []) + list(opts.dedup_with)
    for ref in refs:
        _, manifest = refstore.layer_by_ref(ref)
        index.add_table(refstore.chunk_table(manifest))
        sources.append(ref)
    return index, sources, old


# -- the publish recipe (layers and sealed disks) --

def existing_version(ref: str, existing: str | None, same: Same) -> bool:
    """Step 1: True if ``existing`` (the digest ``ref`` names, if any) has this
    content: nothing to publish. False if there is none. Other content:
    :class:`VersionExists`."""
    if existing is None:
        return False
    if not same(existing):
        raise VersionExists(ref)
    return True


def publish_verified(refstore: RefStore, name: str, version: str, digest: str,
                     reused: set[str], held: dict[str, bytes], same: Same) -> tuple[str, bool]:
    """Step 3: write the ref, then check that the blobs a concurrent gc could
    have taken meanwhile are still there: the packs this push reused and the
    blobs it holds (``held``: digest → bytes; written again if gone). A reused
    pack that is gone takes the ref back (if this call wrote it) and fails the
    push. Returns the digest the ref names and whether this call wrote it; the
    digest is ``digest`` or that of another push's manifest that got there
    first and that ``same`` accepts (that push checks its own blobs)."""
    created = refstore.publish(LAYERS, name, version, digest, same)
    if not created:
        winner = refstore.read_ref(LAYERS, name, version)
        if winner is not None and winner != digest:
            return winner, False
    digests = sorted(reused | held.keys())
    with ThreadPoolExecutor(VERIFY_WORKERS, thread_name_prefix="verify") as pool:
        present = list(pool.map(lambda d: refstore.store.exists(blob_key(d)), digests))
    missing = [d for d, ok in zip(digests, present, strict=True) if not ok]
    lost = [d for d in missing if d not in held]
    for d in missing:
        if d in held:
            refstore.store.put_blob(held[d], d)
    if lost:
        if created:
            refstore.store.delete(ref_key(LAYERS, name, version))
        raise BlobVanished(f"pack {lost[0]}", f"{name}@{version} was published")
    return digest, created
