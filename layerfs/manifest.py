"""Layer and env manifests: the JSON documents refs point at.

Manifests are stored as blobs (named by the sha256 of their canonical JSON).
A layer manifest names its meta image and chunk table by digest; an env
manifest names its layers by reference and manifest digest, top first.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import IntegrityError

SCHEMA = 1
ROLES = ("base", "toolchain", "workspace", "disk")


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


@dataclass
class LayerStats:
    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    others: int = 0
    file_bytes: int = 0  # logical bytes of regular files
    inline_bytes: int = 0  # bytes of small files kept in the meta image
    chunks: int = 0  # chunk slots of all files (incl. holes and repeats)
    unique_chunks: int = 0
    holes: int = 0
    blob_bytes: int = 0  # logical data blob size
    stored_bytes: int = 0  # compressed bytes of the chunks this layer references
    uploaded_bytes: int = 0  # bytes of packs this push wrote
    uploaded_packs: int = 0
    reused_chunks: int = 0  # chunks found already in the store


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
    kind: str = "erofs"
    schema: int = SCHEMA

    def to_bytes(self) -> bytes:
        return canonical_json(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> LayerManifest:
        doc = _load(data, "layer manifest")
        try:
            doc["meta"] = MetaRef(**doc["meta"])
            doc["chunk_table"] = BlobRef(**doc["chunk_table"])
            doc["stats"] = LayerStats(**doc.get("stats", {}))
            return cls(**doc)
        except (KeyError, TypeError) as exc:
            raise IntegrityError("layer manifest", f"missing or unknown field: {exc}") from None


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

    @classmethod
    def from_bytes(cls, data: bytes) -> DiskManifest:
        doc = _load(data, "disk manifest")
        try:
            doc["chunk_table"] = BlobRef(**doc["chunk_table"])
            doc["stats"] = LayerStats(**doc.get("stats", {}))
            return cls(**doc)
        except (KeyError, TypeError) as exc:
            raise IntegrityError("disk manifest", f"missing or unknown field: {exc}") from None


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
    kind: str = "env"
    schema: int = SCHEMA

    def to_bytes(self) -> bytes:
        return canonical_json(asdict(self))

    def content_key(self) -> list[str]:
        return [layer.digest for layer in self.layers]

    @classmethod
    def from_bytes(cls, data: bytes) -> EnvManifest:
        doc = _load(data, "env manifest")
        try:
            doc["layers"] = [EnvLayer(**x) for x in doc["layers"]]
            return cls(**doc)
        except (KeyError, TypeError) as exc:
            raise IntegrityError("env manifest", f"missing or unknown field: {exc}") from None


def _load(data: bytes, what: str) -> dict:
    try:
        doc = json.loads(data)
    except ValueError:
        raise IntegrityError(what, "not JSON") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise IntegrityError(what, "unknown schema")
    return doc


def manifest_kind(data: bytes) -> str:
    return str(_load(data, "manifest").get("kind", ""))
