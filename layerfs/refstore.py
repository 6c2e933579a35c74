"""Refs and manifests in a store: resolve, read, list and publish them.

``refs/layers/<name>/<version>`` and ``refs/envs/<name>/<version>`` hold a
manifest digest. A ref is written last and only once: publishing other content
under an existing version is :class:`VersionExists`.

A ref is trusted only as far as the manifest it points at agrees: resolving
``name@version`` (and listing refs) checks that the manifest is of the ref's
kind and names that same ``name@version`` (:class:`RefMismatch` otherwise), and
an env's layers must be the layers its manifest says they are. A ref file that
is not one ``sha256:<hex>`` line is an :class:`IntegrityError`. A meta image is
handed out only after its digest and its structure
(:mod:`layerfs.formats.erofscheck`) are checked.

A ref store may be given a ``local`` source of manifests by digest (the node's
replica): a manifest is content-addressed, so one the node holds is read from
there, checked against its digest, and never asked of the store; a digest ref
whose manifest is held resolves without the store.

A store-wide listing (:meth:`RefStore.scan_refs`, :meth:`RefStore.read_refs`)
does not stop at a bad object: a ref or manifest it cannot read is set aside as
an :class:`Unreadable` (what, and why) and the listing goes on.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

import zstandard

from .errors import (
    BadMetaImage,
    CheckerTimeout,
    IntegrityError,
    InvalidName,
    ObjectNotFound,
    RefMismatch,
    RefNotFound,
    VersionExists,
)
from .formats import lsmt
from .formats.chunktable import ChunkTable
from .formats.erofscheck import check_meta_image
from .manifest import DiskManifest, EnvManifest, LayerManifest, ManifestHead, manifest_head
from .names import DIGEST_RE, Ref, version_sort_key
from .store.base import Store, blob_key, sha256_digest

LAYERS, ENVS = "layers", "envs"
MAX_REF_BYTES = 1024  # a ref is one digest line; anything longer is not a ref
HEADS_KEPT = 4096  # manifest heads (kind, name, version) remembered by digest
MANIFESTS_KEPT = 256  # whole manifests remembered by digest (a ref check, then a fetch)
FETCHES_AT_ONCE = 8  # manifests fetched in parallel (an env's layers)
V = TypeVar("V")
BAD_OBJECT = (IntegrityError, ObjectNotFound)  # what a listing sets aside: corrupt or missing
# a meta image's structural check of its stored (zstd) bytes: (stored, raw size, blob size,
# chunk size, layer) → BadMetaImage or not, or CheckerTimeout (the daemon's checker processes)
MetaCheck = Callable[[bytes, int, int, int, str], object]
KINDS_OF = {LAYERS: ("erofs", "lsmt"), ENVS: ("env",)}
LocalManifests = Callable[[str], bytes | None]  # digest → the manifest's bytes, if held here


def ref_key(kind: str, name: str, version: str) -> str:
    return f"refs/{kind}/{name}/{version}"


def parse_ref_file(data: bytes, what: str) -> str:
    """The digest a ref file holds: one ``sha256:<hex>`` line, else an
    integrity error that quotes none of its bytes (nothing vouches for them:
    a ref may have been made to show another file's secret)."""
    if len(data) > MAX_REF_BYTES:
        raise IntegrityError(what, f"ref file of {len(data)} bytes is not a digest")
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise IntegrityError(what, "ref file is not a digest (not ASCII text)") from None
    if not DIGEST_RE.fullmatch(text):
        raise IntegrityError(what, "ref file is not a digest (expected one sha256:<64 hex> line)")
    return text


@dataclass(frozen=True)
class RefEntry:
    kind: str
    name: str
    version: str
    digest: str

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class Unreadable:
    """A ref or manifest a store-wide command could not read, and why."""

    what: str  # "env ref e@1", "layer t@1"
    reason: str  # the error's message

    def __str__(self) -> str:
        return f"skipped {self.what}: {self.reason}"


class DigestCache(Generic[V]):
    """The last ``size`` values computed from digest-checked (immutable) objects,
    by digest; thread safe."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, digest: str) -> V | None:
        with self._lock:
            value = self._items.get(digest)
            if value is not None:
                self._items.move_to_end(digest)
            return value

    def put(self, digest: str, value: V) -> V:
        with self._lock:
            self._items[digest] = value
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return value


def _decoded_meta(manifest: LayerManifest, stored: bytes) -> bytes:
    """The meta image from its stored bytes, its length and sha256 the manifest's."""
    what = f"meta image of {manifest.name}@{manifest.version}"
    try:
        image = zstandard.ZstdDecompressor().decompress(stored,
                                                        max_output_size=manifest.meta.raw_size)
    except zstandard.ZstdError as exc:
        raise IntegrityError(what, f"cannot decompress ({exc})") from None
    if len(image) != manifest.meta.raw_size or sha256_digest(image) != manifest.meta.raw_digest:
        raise IntegrityError(what, "content does not match its digest")
    return image


class RefStore:
    """Typed access to the refs and manifests of one store."""

    def __init__(self, store: Store, local: LocalManifests | None = None) -> None:
        self.store = store
        self.local = local
        self._heads: DigestCache[ManifestHead] = DigestCache(HEADS_KEPT)
        self._manifests: DigestCache[bytes] = DigestCache(MANIFESTS_KEPT)

    # -- refs --
    def read_ref(self, kind: str, name: str, version: str) -> str | None:
        try:
            data = self.store.get(ref_key(kind, name, version))
        except ObjectNotFound:
            return None
        return parse_ref_file(data, f"{kind[:-1]} ref {name}@{version}")

    def check_binding(self, kind: str, name: str, version: str, digest: str) -> ManifestHead:
        """The manifest at ``digest`` must be of ``kind`` and name ``name@version``."""
        head = self._head(digest)
        if head.kind not in KINDS_OF[kind] or (head.name, head.version) != (name, version):
            raise RefMismatch(kind[:-1], f"{name}@{version}",
                              f"{head.kind} {head.name}@{head.version}")
        return head

    def resolve(self, kind: str, text: str) -> str:
        """``name@version`` or ``sha256:...`` → manifest digest."""
        ref = Ref.parse(text)
        if ref.digest:
            if self._held(ref.digest) is None and not self.store.exists(blob_key(ref.digest)):
                raise RefNotFound("manifest", ref.digest)
            return ref.digest
        assert ref.name and ref.version
        digest = self.read_ref(kind, ref.name, ref.version)
        if digest is None:
            raise RefNotFound(kind[:-1], text)
        self.check_binding(kind, ref.name, ref.version, digest)
        return digest

    def publish(self, kind: str, name: str, version: str, digest: str,
                same: Callable[[str], bool] | None = None) -> bool:
        """Write the ref once; True if written now, False if it already names this
        manifest or one that ``same`` (given its digest) finds of the same content,
        as a concurrent build of the same source makes."""
        key = ref_key(kind, name, version)
        if self.store.put_if_absent(key, digest.encode() + b"\n"):
            return True
        winner = self.read_ref(kind, name, version)
        if winner != digest and (winner is None or same is None or not same(winner)):
            raise VersionExists(f"{name}@{version}")
        return False

    def list_refs(self, kind: str, name: str | None = None) -> list[RefEntry]:
        """Every ref of ``kind`` (or of ``name``), each a well-formed digest line
        (the first that is not: its :class:`IntegrityError`)."""
        entries, bad = self._scan(kind, name)
        if bad:
            raise bad[0]
        return entries

    def scan_refs(self, kind: str, name: str | None = None
                  ) -> tuple[list[RefEntry], list[Unreadable]]:
        """Every readable ref of ``kind`` (or of ``name``), and the others."""
        entries, bad = self._scan(kind, name)
        return entries, [Unreadable(exc.args[0], exc.args[1]) for exc in bad]

    def _scan(self, kind: str, name: str | None) -> tuple[list[RefEntry], list[IntegrityError]]:
        prefix = f"refs/{kind}/" + (f"{name}/" if name else "")
        out, bad = [], []
        for info in self.store.list(prefix):
            rest = info.key[len(f"refs/{kind}/") :]
            ref_name, _, version = rest.rpartition("/")
            what = f"{kind[:-1]} ref {rest}"
            try:
                Ref.parse(f"{ref_name}@{version}")
            except InvalidName:
                bad.append(IntegrityError(what, "not a valid name@version"))
                continue
            try:
                digest = parse_ref_file(self.store.get(info.key), what)
            except IntegrityError as exc:
                bad.append(exc)
                continue
            out.append(RefEntry(kind, ref_name, version, digest))
        out.sort(key=lambda r: (r.name, version_sort_key(r.version)))
        return out, bad

    def read_refs(self, kind: str, name: str | None, read: Callable[[str], V],
                  keep: Callable[[str], bool] | None = None
                  ) -> tuple[list[tuple[RefEntry, V]], list[Unreadable]]:
        """Each ref of ``kind`` (or of ``name``; only the names ``keep`` keeps)
        checked against the manifest it points at and that manifest as ``read``
        (given its digest) reads it; a ref or manifest that is corrupt or
        missing is set aside, with why."""
        entries, bad = self.scan_refs(kind, name)
        rows = []
        for entry in entries:
            if keep is not None and not keep(entry.name):
                continue
            try:
                self.check_binding(kind, entry.name, entry.version, entry.digest)
                rows.append((entry, read(entry.digest)))
            except BAD_OBJECT as exc:
                bad.append(Unreadable(f"{kind[:-1]} {entry}", exc.message()))
        return rows, bad

    def versions(self, kind: str, name: str) -> list[str]:
        return [r.version for r in self.list_refs(kind, name)]

    # -- manifests --
    def manifest_bytes(self, digest: str) -> bytes:
        """A manifest blob, checked against its digest. The last ones are kept:
        checking a ref and then reading its manifest is one store round trip."""
        data = self._held(digest)
        if data is None:
            data = self._manifests.put(digest, self.store.get_blob(digest))
        return data

    def _held(self, digest: str) -> bytes | None:
        """The manifest at ``digest`` if it is in memory or held locally, else None."""
        data = self._manifests.get(digest)
        if data is None and self.local is not None:
            data = self.local(digest)
            if data is not None:
                self._manifests.put(digest, data)
        return data

    def _fetch_manifests(self, digests: list[str]) -> dict[str, BaseException]:
        """Bring the manifests not yet kept into memory, in parallel, up to
        ``FETCHES_AT_ONCE`` at a time (an env's layers: one store round trip
        for them all, not one each); what failed, by digest, for the caller to
        raise in its own order (each is fetched once)."""
        missing = [d for d in dict.fromkeys(digests) if self._held(d) is None]
        if len(missing) < 2:
            return {}
        with ThreadPoolExecutor(min(len(missing), FETCHES_AT_ONCE)) as pool:
            fetches = {d: pool.submit(self.manifest_bytes, d) for d in missing}
        return {d: exc for d, f in fetches.items() if (exc := f.exception()) is not None}

    def _head(self, digest: str) -> ManifestHead:
        """The kind and name@version of the manifest at ``digest``. Kept in memory:
        a digest-checked manifest never changes, so neither does what it says."""
        head = self._heads.get(digest)
        if head is None:
            head = self._heads.put(digest, manifest_head(self.manifest_bytes(digest), digest))
        return head

    def layer(self, digest: str) -> LayerManifest:
        data = self.manifest_bytes(digest)
        kind = manifest_head(data, digest).kind
        if kind != "erofs":
            raise IntegrityError(digest, f"not an erofs layer manifest ({kind})")
        return LayerManifest.from_bytes(data, digest)

    def disk(self, digest: str) -> DiskManifest:
        data = self.manifest_bytes(digest)
        kind = manifest_head(data, digest).kind
        if kind != "lsmt":
            raise IntegrityError(digest, f"not an LSMT layer manifest ({kind})")
        return DiskManifest.from_bytes(data, digest)

    def any_layer(self, digest: str) -> LayerManifest | DiskManifest:
        data = self.manifest_bytes(digest)
        kind = manifest_head(data, digest).kind
        if kind == "lsmt":
            return DiskManifest.from_bytes(data, digest)
        if kind == "erofs":
            return LayerManifest.from_bytes(data, digest)
        raise IntegrityError(digest, f"not a layer manifest ({kind})")

    def disk_chain(self, digest: str) -> list[tuple[str, DiskManifest]]:
        """A sealed LSMT layer and its parents, top first; a missing parent is an error."""
        chain: list[tuple[str, DiskManifest]] = []
        while digest:
            if len(chain) >= lsmt.MAX_LAYERS:
                raise IntegrityError(digest, f"disk chain deeper than {lsmt.MAX_LAYERS} layers")
            try:
                manifest = self.disk(digest)
            except ObjectNotFound:
                what = chain[-1][1].parent_ref if chain else digest
                raise RefNotFound("parent layer", f"{what} ({digest})") from None
            chain.append((digest, manifest))
            digest = manifest.parent or ""
        return chain

    def env(self, digest: str) -> EnvManifest:
        """An env manifest whose layers are the layers it names: each layer given
        as ``name@version`` must have a manifest naming that ``name@version``."""
        data = self.manifest_bytes(digest)
        if manifest_head(data, digest).kind != "env":
            raise IntegrityError(digest, "not an env manifest")
        manifest = EnvManifest.from_bytes(data, digest)
        refs = [(Ref.parse(layer.ref), layer) for layer in manifest.layers]
        failed = self._fetch_manifests([layer.digest for ref, layer in refs
                                        if ref.name is not None and ref.version is not None])
        for ref, layer in refs:
            if ref.digest is not None and ref.digest != layer.digest:
                raise RefMismatch("layer", layer.ref, f"{layer.digest} in env "
                                  f"{manifest.name}@{manifest.version}")
            if ref.name is not None and ref.version is not None:
                if layer.digest in failed:
                    raise failed[layer.digest]
                self.check_binding(LAYERS, ref.name, ref.version, layer.digest)
        return manifest

    def chunk_table(self, manifest: LayerManifest | DiskManifest) -> ChunkTable:
        """The layer's chunk table; its blob and chunk sizes must be the manifest's."""
        data = self.store.get_blob(manifest.chunk_table.digest)
        table = ChunkTable.from_bytes(data, f"chunk table of {manifest.name}@{manifest.version}")
        self.check_table(manifest, table)
        return table

    @staticmethod
    def check_table(manifest: LayerManifest | DiskManifest, table: ChunkTable) -> None:
        """A chunk table's blob and chunk sizes must be its manifest's."""
        if (table.blob_size, table.chunk_size) != (manifest.blob_size, manifest.chunk_size):
            raise IntegrityError(f"chunk table of {manifest.name}@{manifest.version}",
                                 f"blob size {table.blob_size} and chunk size "
                                 f"{table.chunk_size}, the manifest says {manifest.blob_size} "
                                 f"and {manifest.chunk_size}")

    def meta_image(self, manifest: LayerManifest, check: MetaCheck | None = None) -> bytes:
        """The layer's EROFS meta image, fetched, decompressed and verified: its
        digest, then its structure (:func:`check_meta_image`; or ``check``,
        given the stored bytes, which runs while this thread decompresses and
        hashes its own copy)."""
        stored = self.store.get_blob(manifest.meta.digest)
        what = f"{manifest.name}@{manifest.version}"
        if manifest.meta.compression != "zstd":
            raise IntegrityError(f"meta image of {what}",
                                 f"unknown compression {manifest.meta.compression!r}")
        if check is None:
            image = _decoded_meta(manifest, stored)
            check_meta_image(image, manifest.blob_size, manifest.chunk_size, what)
            return image
        with ThreadPoolExecutor(1) as pool:
            decoded = pool.submit(_decoded_meta, manifest, stored)
            refused: BadMetaImage | CheckerTimeout | None = None
            try:
                check(stored, manifest.meta.raw_size, manifest.blob_size, manifest.chunk_size,
                      what)
            except (BadMetaImage, CheckerTimeout) as exc:
                refused = exc
            image = decoded.result()  # a digest that does not match is said first
        if refused is not None:
            raise refused
        return image

    def layer_by_ref(self, text: str) -> tuple[str, LayerManifest]:
        digest = self.resolve(LAYERS, text)
        return digest, self.layer(digest)

    def previous_version(self, name: str, version: str) -> str | None:
        """The highest other version of ``name`` (natural order), if any."""
        others = [v for v in self.versions(LAYERS, name) if v != version]
        return others[-1] if others else None
