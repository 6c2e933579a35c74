"""Import an OCI or Docker image as layers and an env.

Each image layer is streamed once: the stored blob through a digest check,
decompressed (gzip, zstd or none, as its media type says), the tar through a
second check against its diff_id, and into the tar layer builder; nothing is
written to disk whole. An image layer becomes the layer
``oci/sha256/<diff_id hex>@1`` (its manifest records ``oci:<diff_id>``), so
the same image layer from any image is one layer, built once. Its tar is seen
by a :class:`~layerfs.builder.oci.tarsplit.TarSplitRecorder` on the way, and the
record (what of the tar is not file content) is stored with the layer, for the
export to write that tar again. With ``fold`` consecutive layers become one
``oci/folded/<hash of their diff_ids>@1`` (without a record).
Each chain of the image that ends on a layerfs layer is recorded as the env
``oci/chains/<chain ID hex>@1`` (:mod:`.chains`: what the containerd
snapshotter looks chains up in). The env ``N@V`` (layers top first, the
image config) is written last: a
digest mismatch anywhere leaves it unwritten (layers already built from
earlier, verified layers stay; they are complete and correct).
"""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

import zstandard

from layerfs.errors import IntegrityError, UsageError, VersionExists
from layerfs.manifest import EnvLayer, TarSplitRef
from layerfs.names import check_name, check_version
from layerfs.refstore import ENVS, LAYERS, RefStore
from layerfs.tree import FileTree

from ..assembler import LayerAssembler
from ..env import EnvResult, check_layer_count, create_env
from ..layer import BuildOptions, Progress, build_layer
from ..pipeline import DEFAULT_CHUNK_SIZE, DedupIndex
from ..tarsource import TarSource, drain
from .chains import record_chains
from .fold import FoldingAssembler, fold_source
from .image import DigestCheckedReader, Image, ImageLayer, ImageSource, Platform
from .resolve import image_config, resolve_image
from .tarsplit import TarSplitRecorder, TeeReader, tar_split_ref

LAYER_VERSION = "1"
SINGLE_PREFIX = "oci/sha256/"
FOLDED_PREFIX = "oci/folded/"


@dataclass
class ImportOptions:
    name: str
    version: str
    platform: Platform | None = None  # None: the host's
    fold_size: int = 0  # 0: one layer per image layer
    chunk_size: int = DEFAULT_CHUNK_SIZE

    def check(self) -> None:
        check_name(self.name)
        check_version(self.version)
        if self.fold_size < 0:
            raise UsageError("--fold must be a positive size")


@dataclass
class ImportProgress:
    """Callbacks: a layer started (index, total), blob bytes read."""

    on_layer: Callable[[int, int], None] | None = None
    on_bytes: Callable[[int], None] | None = None


@dataclass
class ImportedLayer:
    """One layerfs layer of the env and the image layers it holds (bottom first)."""

    diff_ids: list[str]
    ref: str
    digest: str
    built: bool  # False: it was already stored and is reused
    uploaded_bytes: int


@dataclass
class ImportResult:
    env: EnvResult
    image: Image
    layers: list[ImportedLayer] = field(default_factory=list)  # top first, as in the env
    chains: list[str] = field(default_factory=list)  # the chain IDs recorded, bottom first


def layer_name(group: list[ImageLayer]) -> tuple[str, str]:
    """The layer name of a group of image layers and the origin its manifest records."""
    if len(group) == 1:
        diff = group[0].diff_id
        return SINGLE_PREFIX + diff.removeprefix("sha256:"), f"oci:{diff}"
    diff_ids = [layer.diff_id for layer in group]
    list_hash = hashlib.sha256(",".join(diff_ids).encode()).hexdigest()
    return FOLDED_PREFIX + list_hash, fold_source(diff_ids, list_hash)


def fold_groups(layers: tuple[ImageLayer, ...], fold_size: int) -> list[list[ImageLayer]]:
    """Consecutive layers, greedy from the bottom, each group's blob sizes summing
    to at most ``fold_size`` (a larger layer alone); no folding for 0."""
    groups: list[list[ImageLayer]] = []
    total = 0
    for layer in layers:
        size = layer.blob.size
        if not groups or not fold_size or total + size > fold_size:
            groups.append([])
            total = 0
        groups[-1].append(layer)
        total += size
    return groups


class CountingReader:
    """Passes reads through and reports how many bytes went by."""

    def __init__(self, raw: BinaryIO, on_bytes: Callable[[int], None] | None) -> None:
        self.raw, self.on_bytes = raw, on_bytes

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        if self.on_bytes and data:
            self.on_bytes(len(data))
        return data

    def close(self) -> None:
        self.raw.close()


def decompressed(stream: BinaryIO, compression: str) -> BinaryIO:
    if compression == "gzip":
        return gzip.GzipFile(fileobj=stream, mode="rb")  # type: ignore[return-value]
    if compression == "zstd":
        return zstandard.ZstdDecompressor().stream_reader(  # type: ignore[return-value]
            stream, read_across_frames=True)
    return stream


class ImageLayerSource:
    """The image layers of one group, streamed and checked, as a layer source."""

    def __init__(self, source: ImageSource, group: list[ImageLayer], at_bottom: bool,
                 on_bytes: Callable[[int], None] | None,
                 recorder: TarSplitRecorder | None = None) -> None:
        self.source, self.group, self.at_bottom = source, group, at_bottom
        self.on_bytes = on_bytes
        self.recorder = recorder  # sees the tar of a group of one layer

    def feed(self, asm: LayerAssembler) -> None:
        if not isinstance(asm, FoldingAssembler):
            for layer in self.group:
                self._feed_layer(asm, layer)
            return
        asm.at_bottom = self.at_bottom
        for layer in self.group:
            asm.begin_layer()
            self._feed_layer(asm, layer)
            asm.end_layer()

    def _feed_layer(self, asm: LayerAssembler, layer: ImageLayer) -> None:
        what = f"{self.source.describe()} layer {layer.blob.digest}"
        raw = self.source.open_blob(layer.blob)
        counted = CountingReader(raw, self.on_bytes)
        blob = DigestCheckedReader(counted, layer.blob.digest, layer.blob.size,  # type: ignore[arg-type]
                                   what)
        try:
            plain = DigestCheckedReader(decompressed(blob, layer.compression),  # type: ignore[arg-type]
                                        layer.diff_id, None, f"{what} diff_id")
            tar: BinaryIO = plain  # type: ignore[assignment]
            if self.recorder is not None:
                tar = TeeReader(tar, self.recorder.feed)  # type: ignore[assignment]
            TarSource(what, tar, b"", sniff=False, observer=self.recorder).feed(asm)
            if self.recorder is not None:
                self.recorder.finish()
            drain(blob)  # type: ignore[arg-type]
        finally:
            raw.close()


def _record_maker(recorder: TarSplitRecorder, diff_id: str
                  ) -> Callable[[FileTree], tuple[bytes, TarSplitRef] | None]:
    def make(tree: FileTree) -> tuple[bytes, TarSplitRef] | None:
        blob = recorder.record(tree, diff_id)
        return (blob, tar_split_ref(blob, diff_id, recorder)) if blob is not None else None
    return make


def import_image(refstore: RefStore, source: ImageSource, opts: ImportOptions,
                 progress: ImportProgress | None = None) -> ImportResult:
    """Import what ``source`` names as the env ``opts.name@opts.version``."""
    opts.check()
    progress = progress or ImportProgress()
    image = resolve_image(source, opts.platform)
    config = image_config(image)
    env_ref = f"{opts.name}@{opts.version}"
    if refstore.read_ref(ENVS, opts.name, opts.version) is not None:
        existing = refstore.env(refstore.resolve(ENVS, env_ref))
        if existing.config != config:
            raise VersionExists(env_ref)
    groups = fold_groups(image.layers, opts.fold_size)
    check_layer_count(f"image {source.describe()}",
                      len({layer_name(group)[0] for group in groups}))
    done: list[ImportedLayer] = []
    below = DedupIndex()  # the chunks of the layers imported so far, each table added once
    for i, group in enumerate(groups):
        if progress.on_layer:
            progress.on_layer(i, len(groups))
        done.append(_import_group(refstore, source, group, i == 0, opts, progress, below))
    if progress.on_layer:
        progress.on_layer(len(groups), len(groups))
    chains = record_chains(refstore, [(x.diff_ids, EnvLayer(x.ref, x.digest))
                                      for x in indexable(done)])
    done.reverse()
    env = create_env(refstore, opts.name, opts.version, [x.ref for x in done], config=config)
    return ImportResult(env, image, done, chains)


def indexable(layers: list[ImportedLayer]) -> list[ImportedLayer]:
    """The layers (bottom first) whose chains the chain index can hold: up to
    the first one whose manifest cannot list its diff_ids (a fold of more
    layers than its ``source`` keeps)."""
    out = []
    for layer in layers:
        if fold_source(layer.diff_ids, "") != "oci:" + ",".join(layer.diff_ids):
            break
        out.append(layer)
    return out


def _import_group(refstore: RefStore, source: ImageSource, group: list[ImageLayer],
                  at_bottom: bool, opts: ImportOptions, progress: ImportProgress,
                  below: DedupIndex) -> ImportedLayer:
    """Reuse the group's layer if it is stored, else build it (deduplicating
    chunks against the layers below it in this image, whose chunks ``below``
    holds); its chunks join ``below``."""
    name, origin = layer_name(group)
    ref = f"{name}@{LAYER_VERSION}"
    diff_ids = [layer.diff_id for layer in group]
    existing = refstore.read_ref(LAYERS, name, LAYER_VERSION)
    if existing is not None:
        manifest = refstore.layer(existing)
        if manifest.source != origin:
            raise IntegrityError(ref, f"it records {manifest.source[:80]!r}, not {origin[:80]!r}")
        if ref not in below.refs:
            below.add_table(refstore.chunk_table(manifest), ref)
        return ImportedLayer(diff_ids, ref, existing, built=False, uploaded_bytes=0)
    build_opts = BuildOptions(name, LAYER_VERSION, chunk_size=opts.chunk_size)
    recorder = TarSplitRecorder() if len(group) == 1 else None
    layer_source = ImageLayerSource(source, group, at_bottom, progress.on_bytes, recorder)
    assembler = FoldingAssembler if len(group) > 1 else LayerAssembler
    result = build_layer(refstore, source.describe(), build_opts, Progress(), source=layer_source,
                         origin=origin, assembler=assembler, shared=below,
                         tar_split=_record_maker(recorder, diff_ids[0]) if recorder else None)
    below.add_table(refstore.chunk_table(result.manifest), ref)
    return ImportedLayer(diff_ids, ref, result.digest, built=result.published,
                         uploaded_bytes=result.uploaded_bytes)
