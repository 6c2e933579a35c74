"""Layer and env manifests: the JSON documents refs point at.

Manifests are stored as blobs (named by the sha256 of their canonical JSON).
A layer manifest names its meta image and chunk table by digest; an env
manifest names its layers by reference and manifest digest, top first.

Parsing is typed and strict, by the rules of :mod:`layerfs.schema` (the
control messages' too): every field must be present (or have a default), of
its declared type (``int`` is never ``bool`` or ``float``), in range, and
digests, names, versions and references well formed; anything else, unknown
fields included, is one :class:`IntegrityError` naming the field. Strings, lists
and an env's image config are bounded by :mod:`layerfs.bounds`; a writer runs
the same parse on what it is about to publish (``checked_bytes``), so that a
field over a bound is refused there (:class:`OverLimit`), never stored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from . import schema
from .bounds import MAX_CONFIG
from .errors import IntegrityError, InvalidName, InvalidReference, OverLimit
from .formats.chunktable import ChunkTable
from .imageconfig import ImageConfig
from .names import DIGEST_RE, Ref, check_name, check_version

SCHEMA = 1
ROLES = ("base", "toolchain", "workspace", "disk")
KINDS = ("erofs", "lsmt", "env")
MIN_CHUNK, MAX_CHUNK = 4096, 16 << 20
CHUNK_SIZE_RULE = "a power of two from 4 KiB to 16 MiB"
MAX_TAR_SPLIT = 256 << 20  # stored bytes of a layer's tar-split record


def valid_chunk_size(size: int) -> bool:
    """Whether ``size`` is a chunk size a layer may have (:data:`CHUNK_SIZE_RULE`)."""
    return MIN_CHUNK <= size <= MAX_CHUNK and not size & (size - 1)


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class BlobRef:
    digest: str  # sha256 of the stored bytes
    size: int  # stored bytes


@dataclass(frozen=True)
class MetaRef:
    """The meta image, stored zstd-compressed (mostly padding and inline data)."""

    digest: str  # sha256 of the stored (compressed) bytes
    size: int  # stored bytes
    raw_digest: str  # sha256 of the EROFS image itself
    raw_size: int
    compression: str = "zstd"


@dataclass(frozen=True)
class TarSplitRef:
    """The tar-split record of an imported image layer: what of its tar is not
    file content (layerfs/builder/oci/tarsplit.py), so that an export writes that tar
    again byte for byte."""

    digest: str  # sha256 of the stored record
    size: int  # stored bytes
    diff_id: str  # sha256 of the tar it rebuilds
    tar_size: int  # bytes of that tar


@dataclass
class TreeCounts:
    """What the assembler counts: the tree half of a layer's :class:`LayerStats`."""

    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    others: int = 0
    file_bytes: int = 0  # logical bytes of regular files
    inline_bytes: int = 0  # bytes of small files kept in the meta image


@dataclass
class ChunkStats:
    """What the pipeline counts: the chunk half of a layer's :class:`LayerStats`."""

    chunks: int = 0  # chunk slots of all files (incl. holes and repeats)
    unique_chunks: int = 0
    holes: int = 0
    blob_bytes: int = 0  # logical data blob size
    stored_bytes: int = 0  # compressed bytes of the chunks this layer references
    uploaded_bytes: int = 0  # bytes of packs this push wrote
    uploaded_packs: int = 0
    reused_chunks: int = 0  # chunks found already in the store


@dataclass
class LayerStats(TreeCounts, ChunkStats):
    """A layer's counts as its manifest records them: both halves."""


@dataclass(frozen=True)
class LayerIdentity:
    """A layer's content, the part of its manifest that two builds of one source
    share: the EROFS image, the blob's chunks (where each lies in the blob and
    its sha256, not which pack holds it) and how the layer is used. Not part of
    it: the creation time, upload statistics, dedup sources and provenance."""

    kind: str
    role: str
    chunk_size: int
    blob_size: int
    meta_raw_digest: str
    meta_raw_size: int
    table_content: str  # sha256 of the chunk table's content key


def table_content(table: ChunkTable) -> str:
    """sha256 over what the blob holds (:meth:`ChunkTable.content_key`)."""
    h = hashlib.sha256()
    for offset, length, sha in table.content_key():
        h.update(offset.to_bytes(8, "little") + length.to_bytes(8, "little") + sha)
    return "sha256:" + h.hexdigest()


@dataclass
class LayerManifest:
    name: str
    version: str
    role: str
    chunk_size: int
    meta: MetaRef
    chunk_table: BlobRef
    blob_size: int
    created: str
    stats: LayerStats = field(default_factory=LayerStats)
    dedup_sources: list[str] = field(default_factory=list)
    source: str = ""  # what it was built from, where that names it: "oci:<diff_id>"
    kind: str = "erofs"
    schema: int = SCHEMA
    tar_split: TarSplitRef | None = None  # an image layer's tar, kept (absent: none)

    def to_bytes(self) -> bytes:
        doc = asdict(self)
        if self.tar_split is None:
            del doc["tar_split"]  # the manifests of layers without one are as before
        return canonical_json(doc)

    def identity(self, table: ChunkTable) -> LayerIdentity:
        """What decides that two builds made the same layer (``table``: its chunk table)."""
        return LayerIdentity(self.kind, self.role, self.chunk_size, self.blob_size,
                             self.meta.raw_digest, self.meta.raw_size, table_content(table))

    def checked_bytes(self) -> bytes:
        """:meth:`to_bytes`, after the parse every reader runs (:class:`OverLimit`)."""
        data = self.to_bytes()
        self._parse(data, f"layer {self.name}@{self.version}")
        return data

    @classmethod
    def from_bytes(cls, data: bytes, digest: str = "") -> LayerManifest:
        return _reading(cls._parse, data, _what("layer manifest", digest))

    @classmethod
    def _parse(cls, data: bytes, what: str) -> LayerManifest:
        manifest = _typed(cls, _load(data, what), what, "")
        _check_layer(manifest, what)
        _check_meta(manifest.meta, what)
        if manifest.tar_split is not None:
            _check_tar_split(manifest, manifest.tar_split, what)
        return manifest


@dataclass
class DiskManifest:
    """A sealed LSMT block layer (a disk image or a writable disk's snapshot)."""

    name: str
    version: str
    chunk_size: int
    chunk_table: BlobRef
    blob_size: int  # size of the sealed LSMT file
    virtual_size: int  # disk size in bytes
    uuid: str
    parent: str | None  # manifest digest of the parent layer
    parent_ref: str | None
    index_offset: int
    index_entries: int  # including padding
    created: str
    stats: LayerStats = field(default_factory=LayerStats)
    dedup_sources: list[str] = field(default_factory=list)
    role: str = "disk"
    kind: str = "lsmt"
    schema: int = SCHEMA

    def to_bytes(self) -> bytes:
        return canonical_json(asdict(self))

    def checked_bytes(self) -> bytes:
        """:meth:`to_bytes`, after the parse every reader runs (:class:`OverLimit`)."""
        data = self.to_bytes()
        self._parse(data, f"disk layer {self.name}@{self.version}")
        return data

    @classmethod
    def from_bytes(cls, data: bytes, digest: str = "") -> DiskManifest:
        return _reading(cls._parse, data, _what("disk manifest", digest))

    @classmethod
    def _parse(cls, data: bytes, what: str) -> DiskManifest:
        manifest = _typed(cls, _load(data, what), what, "")
        _check_layer(manifest, what)
        if manifest.parent is not None:
            _check_digest(manifest.parent, what, "parent")
        if manifest.parent_ref is not None:
            _check_ref(manifest.parent_ref, what, "parent_ref")
        return manifest


@dataclass
class EnvLayer:
    ref: str  # name@version as given
    digest: str  # manifest digest it resolved to


@dataclass
class EnvManifest:
    name: str
    version: str
    layers: list[EnvLayer]  # top first
    created: str
    config: ImageConfig | None = None  # from an imported image, or kept by `env create --on`
    kind: str = "env"
    schema: int = SCHEMA

    def to_bytes(self) -> bytes:
        doc = asdict(dataclasses.replace(self, config=None))
        doc["config"] = self.config.to_json() if self.config else None
        return canonical_json(doc)

    def content_key(self) -> list[object]:
        """What decides that two envs are the same: their layers and image config."""
        config = canonical_json(self.config.to_json()) if self.config else b""
        return [*(layer.digest for layer in self.layers), config]

    def checked_bytes(self) -> bytes:
        """:meth:`to_bytes`, after the parse every reader runs (:class:`OverLimit`)."""
        data = self.to_bytes()
        self._parse(data, f"env {self.name}@{self.version}")
        return data

    @classmethod
    def from_bytes(cls, data: bytes, digest: str = "") -> EnvManifest:
        return _reading(cls._parse, data, _what("env manifest", digest))

    @classmethod
    def _parse(cls, data: bytes, what: str) -> EnvManifest:
        manifest = _typed(cls, _load(data, what), what, "")
        _check_head(manifest.kind, manifest.name, manifest.version, what)
        if manifest.config is not None:
            _check_config_size(manifest.config, what)
        if not manifest.layers:
            raise IntegrityError(what, "field layers: empty")
        for i, layer in enumerate(manifest.layers):
            _check_ref(layer.ref, what, f"layers[{i}].ref")
            _check_digest(layer.digest, what, f"layers[{i}].digest")
        return manifest


def check_image_config(config: ImageConfig, what: str) -> None:
    """Refuse (:class:`OverLimit`) an image config an env manifest could not hold:
    the check :meth:`EnvManifest.checked_bytes` makes, before anything is built."""
    _typed(ImageConfig, json.loads(canonical_json(config.to_json())), what, "config")
    _check_config_size(config, what)


def _check_config_size(config: ImageConfig, what: str) -> None:
    size = len(canonical_json(config.to_json()))
    if size > MAX_CONFIG:
        raise OverLimit(what, "config", f"{size} bytes of JSON", MAX_CONFIG)


@dataclass(frozen=True)
class ManifestHead:
    """What every manifest says of itself: its kind and ``name@version``."""

    kind: str
    name: str
    version: str


def manifest_head(data: bytes, digest: str = "") -> ManifestHead:
    """The kind, name and version of any manifest, checked (the rest is not parsed)."""
    what = _what("manifest", digest)
    doc = _load(data, what)
    try:
        head = schema.parse(ManifestHead, doc, extra=True)
    except schema.SchemaError as exc:
        raise IntegrityError(what, exc.text) from None
    _check_head(head.kind, head.name, head.version, what)
    return head


def manifest_kind(data: bytes) -> str:
    return manifest_head(data).kind


# -- the typed parse --

def _what(kind: str, digest: str) -> str:
    return f"{kind} {digest}" if digest else kind


def _reading(parse: Callable[[bytes, str], Any], data: bytes, what: str) -> Any:
    """``parse(data, what)`` for a reader: a field over a bound is corrupt data."""
    try:
        return parse(data, what)
    except OverLimit as exc:
        _, path, amount, limit = exc.args
        raise IntegrityError(what, f"field {path}: {amount}, over the limit of {limit}") from None


def _load(data: bytes, what: str) -> dict:
    try:
        doc = schema.loads(data)
    except schema.SchemaError:
        raise IntegrityError(what, "not JSON") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or type(doc["schema"]) is not int:
        raise IntegrityError(what, "unknown schema")
    return doc


def _typed(cls: type, doc: object, what: str, path: str) -> Any:
    """``doc`` (parsed JSON) as an instance of dataclass ``cls``, every field typed
    (:mod:`layerfs.schema`); over a bound: :class:`OverLimit`."""
    try:
        return schema.parse(cls, doc, path=path)
    except schema.OverBound as exc:
        raise OverLimit(what, exc.path, exc.amount, exc.limit) from None
    except schema.SchemaError as exc:
        raise IntegrityError(what, exc.text) from None


# -- what the fields mean --

def _check_head(kind: str, name: str, version: str, what: str) -> None:
    if kind not in KINDS:
        raise IntegrityError(what, f"field kind: unknown kind {kind[:32]!r}")
    try:
        check_name(name)
        check_version(version)
    except InvalidName as exc:
        raise IntegrityError(what, str(exc)) from None


def _check_digest(digest: str, what: str, path: str) -> None:
    if not DIGEST_RE.fullmatch(digest):
        raise IntegrityError(what, f"field {path}: not sha256:<64 hex>")


def _check_ref(text: str, what: str, path: str) -> None:
    try:
        Ref.parse(text)
    except (InvalidName, InvalidReference):
        raise IntegrityError(what, f"field {path}: not name@version or sha256:<hex>") from None


def _check_layer(manifest: LayerManifest | DiskManifest, what: str) -> None:
    _check_head(manifest.kind, manifest.name, manifest.version, what)
    want = "erofs" if isinstance(manifest, LayerManifest) else "lsmt"
    if manifest.kind != want:
        raise IntegrityError(what, f"field kind: {manifest.kind} in a {want} manifest")
    if manifest.role not in ROLES or (manifest.role == "disk") != (want == "lsmt"):
        raise IntegrityError(what, f"field role: {manifest.role[:32]!r}")
    if not valid_chunk_size(manifest.chunk_size):
        raise IntegrityError(what, f"field chunk_size: not {CHUNK_SIZE_RULE}")
    _check_digest(manifest.chunk_table.digest, what, "chunk_table.digest")
    for i, source in enumerate(manifest.dedup_sources):
        _check_ref(source, what, f"dedup_sources[{i}]")


def _check_meta(meta: MetaRef, what: str) -> None:
    _check_digest(meta.digest, what, "meta.digest")
    _check_digest(meta.raw_digest, what, "meta.raw_digest")
    if meta.compression != "zstd":
        raise IntegrityError(what, f"field meta.compression: unknown {meta.compression[:32]!r}")


def _check_tar_split(manifest: LayerManifest, ref: TarSplitRef, what: str) -> None:
    _check_digest(ref.digest, what, "tar_split.digest")
    _check_digest(ref.diff_id, what, "tar_split.diff_id")
    if ref.size > MAX_TAR_SPLIT:
        raise IntegrityError(what, f"field tar_split.size: more than {MAX_TAR_SPLIT >> 20} MiB")
    if manifest.source != f"oci:{ref.diff_id}":
        raise IntegrityError(what, "field tar_split.diff_id: not the layer's source")
