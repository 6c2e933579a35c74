"""The OCI image model every image source shares: descriptors, the resolved
image (manifest, config, layers bottom first) and the :class:`ImageSource`
interface a registry, an image layout or an archive implements.

A source hands out raw bytes; :func:`resolve_image` checks the manifest's
digest (when the reference names one), picks the platform of an index, and
parses the manifest and config. Blob digests are checked by whoever streams
the blob (:class:`DigestCheckedReader`), so nothing unverified is published.
"""

from __future__ import annotations

import hashlib
import io
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import BinaryIO

# Media types (OCI image spec 1.1 and Docker's schema 2).
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
# Layer media types and the compression each one means.
LAYER_COMPRESSION = {
    "application/vnd.oci.image.layer.v1.tar": "none",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar": "none",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.diff.tar.zstd": "zstd",
}
MAX_DOCUMENT = 4 << 20  # the largest manifest, index or config accepted


@dataclass(frozen=True)
class Platform:
    """``OS/ARCH[/VARIANT]``, as ``--platform`` takes it."""

    os: str
    architecture: str
    variant: str = ""


@dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor: what a blob is, its digest and size."""

    media_type: str
    digest: str  # sha256:<hex>
    size: int
    platform: Platform | None = None
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ImageLayer:
    """One layer of an image: its blob descriptor and its diff_id (the sha256
    of the uncompressed tar, from the image config's ``rootfs.diff_ids``)."""

    blob: Descriptor
    diff_id: str

    @property
    def compression(self) -> str:
        return LAYER_COMPRESSION[self.blob.media_type]


@dataclass(frozen=True)
class Image:
    """A resolved single-platform image: layers bottom first as the config lists them."""

    manifest_digest: str
    manifest: bytes
    config_digest: str
    config: bytes  # the raw image config JSON
    layers: tuple[ImageLayer, ...]


class ImageSource(ABC):
    """Where an image comes from. ``reference()`` is the tag or digest asked
    for; ``get_manifest`` returns the raw bytes and media type of the manifest
    or index it names (or of a digest); ``open_blob`` streams a blob's stored
    bytes (compressed layers as stored), unverified."""

    @abstractmethod
    def describe(self) -> str:
        """The source as the user wrote it, for error messages (no credentials)."""

    @abstractmethod
    def get_manifest(self, digest: str | None = None) -> tuple[bytes, str]:
        """The manifest or index the reference names (``digest``: that one instead)."""

    @abstractmethod
    def open_blob(self, desc: Descriptor) -> BinaryIO:
        """A stream of the blob's bytes; the caller checks its digest."""

    def pinned_digest(self) -> str | None:
        """The digest the reference itself names (``@sha256:...``, or a layout
        index's descriptor): the manifest's bytes must hash to it."""
        return None

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections or open files."""


class DigestCheckedReader(io.RawIOBase):
    """Reads ``raw`` while hashing it; at its end, checks size and sha256 against
    ``digest`` and raises ``error`` (an exception instance factory) on a mismatch."""

    def __init__(self, raw: BinaryIO, digest: str, size: int | None, what: str) -> None:
        super().__init__()
        self.raw, self.digest, self.size, self.what = raw, digest, size, what
        self.hash = hashlib.sha256()
        self.seen = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        view = memoryview(buffer).cast("B")
        data = self.raw.read(len(view))
        if not data:
            self.check()
            return 0
        view[: len(data)] = data
        self.hash.update(data)
        self.seen += len(data)
        if self.size is not None and self.seen > self.size:
            self.check()
        return len(data)

    def check(self) -> None:
        """Raise :class:`~layerfs.errors.IntegrityError` unless size and digest match."""
        from layerfs.errors import IntegrityError

        if self.size is not None and self.seen != self.size:
            raise IntegrityError(self.what, f"{self.seen} bytes, expected {self.size}")
        got = "sha256:" + self.hash.hexdigest()
        if got != self.digest:
            raise IntegrityError(self.what, f"digest {got}, expected {self.digest}")
