"""Refs and manifests in a store: resolve, read, list and publish them.

``refs/layers/<name>/<version>`` and ``refs/envs/<name>/<version>`` hold a
manifest digest. A ref is written last and only once: publishing other content
under an existing version is :class:`VersionExists`.
"""

from __future__ import annotations

from dataclasses import dataclass

import zstandard

from .errors import IntegrityError, ObjectNotFound, RefNotFound, VersionExists
from .formats.chunktable import ChunkTable
from .manifest import DiskManifest, EnvManifest, LayerManifest, manifest_kind
from .names import Ref, check_digest, version_sort_key
from .store.base import Store, blob_key, sha256_digest

LAYERS, ENVS = "layers", "envs"
MAX_CHAIN = 255


def ref_key(kind: str, name: str, version: str) -> str:
    return f"refs/{kind}/{name}/{version}"


@dataclass(frozen=True)
class RefEntry:
    kind: str
    name: str
    version: str
    digest: str

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


class Registry:
    """Typed access to the refs and manifests of one store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # -- refs --
    def read_ref(self, kind: str, name: str, version: str) -> str | None:
        try:
            text = self.store.get_text(ref_key(kind, name, version)).strip()
        except ObjectNotFound:
            return None
        return check_digest(text)

    def resolve(self, kind: str, text: str) -> str:
        """``name@version`` or ``sha256:...`` → manifest digest."""
        ref = Ref.parse(text)
        if ref.digest:
            if not self.store.exists(blob_key(ref.digest)):
                raise RefNotFound("manifest", ref.digest)
            return ref.digest
        assert ref.name and ref.version
        digest = self.read_ref(kind, ref.name, ref.version)
        if digest is None:
            raise RefNotFound(kind[:-1], text)
        return digest

    def publish(self, kind: str, name: str, version: str, digest: str) -> bool:
        """Write the ref once; True if written now, False if it already said this."""
        key = ref_key(kind, name, version)
        if self.store.put_if_absent(key, digest.encode() + b"\n"):
            return True
        if self.read_ref(kind, name, version) != digest:
            raise VersionExists(f"{name}@{version}")
        return False

    def list_refs(self, kind: str, name: str | None = None) -> list[RefEntry]:
        prefix = f"refs/{kind}/" + (f"{name}/" if name else "")
        out = []
        for info in self.store.list(prefix):
            rest = info.key[len(f"refs/{kind}/") :]
            ref_name, _, version = rest.rpartition("/")
            digest = self.store.get_text(info.key).strip()
            out.append(RefEntry(kind, ref_name, version, digest))
        out.sort(key=lambda r: (r.name, version_sort_key(r.version)))
        return out

    def versions(self, kind: str, name: str) -> list[str]:
        return [r.version for r in self.list_refs(kind, name)]

    # -- manifests --
    def layer(self, digest: str) -> LayerManifest:
        manifest = LayerManifest.from_bytes(self.store.get_blob(digest))
        if manifest.kind != "erofs":
            raise IntegrityError(digest, f"not an erofs layer manifest ({manifest.kind})")
        return manifest

    def disk(self, digest: str) -> DiskManifest:
        manifest = DiskManifest.from_bytes(self.store.get_blob(digest))
        if manifest.kind != "lsmt":
            raise IntegrityError(digest, f"not an LSMT layer manifest ({manifest.kind})")
        return manifest

    def any_layer(self, digest: str) -> LayerManifest | DiskManifest:
        data = self.store.get_blob(digest)
        kind = manifest_kind(data)
        if kind == "lsmt":
            return DiskManifest.from_bytes(data)
        if kind == "erofs":
            return LayerManifest.from_bytes(data)
        raise IntegrityError(digest, f"not a layer manifest ({kind})")

    def disk_chain(self, digest: str) -> list[tuple[str, DiskManifest]]:
        """A sealed LSMT layer and its parents, top first; a missing parent is an error."""
        chain: list[tuple[str, DiskManifest]] = []
        while digest:
            if len(chain) >= MAX_CHAIN:
                raise IntegrityError(digest, f"disk chain deeper than {MAX_CHAIN} layers")
            try:
                manifest = self.disk(digest)
            except ObjectNotFound:
                what = chain[-1][1].parent_ref if chain else digest
                raise RefNotFound("parent layer", f"{what} ({digest})") from None
            chain.append((digest, manifest))
            digest = manifest.parent or ""
        return chain

    def env(self, digest: str) -> EnvManifest:
        manifest = EnvManifest.from_bytes(self.store.get_blob(digest))
        if manifest.kind != "env":
            raise IntegrityError(digest, "not an env manifest")
        return manifest

    def chunk_table(self, manifest: LayerManifest | DiskManifest) -> ChunkTable:
        data = self.store.get_blob(manifest.chunk_table.digest)
        return ChunkTable.from_bytes(data, f"chunk table of {manifest.name}@{manifest.version}")

    def meta_image(self, manifest: LayerManifest) -> bytes:
        """The layer's EROFS meta image, fetched, decompressed and verified."""
        stored = self.store.get_blob(manifest.meta.digest)
        what = f"meta image of {manifest.name}@{manifest.version}"
        if manifest.meta.compression != "zstd":
            raise IntegrityError(what, f"unknown compression {manifest.meta.compression!r}")
        try:
            image = zstandard.ZstdDecompressor().decompress(
                stored, max_output_size=manifest.meta.raw_size)
        except zstandard.ZstdError as exc:
            raise IntegrityError(what, f"cannot decompress ({exc})") from None
        if len(image) != manifest.meta.raw_size or sha256_digest(image) != manifest.meta.raw_digest:
            raise IntegrityError(what, "content does not match its digest")
        return image

    def layer_by_ref(self, text: str) -> tuple[str, LayerManifest]:
        digest = self.resolve(LAYERS, text)
        return digest, self.layer(digest)

    def previous_version(self, name: str, version: str) -> str | None:
        """The highest other version of ``name`` (natural order), if any."""
        others = [v for v in self.versions(LAYERS, name) if v != version]
        return others[-1] if others else None
