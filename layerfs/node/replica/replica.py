"""The metadata replica: what a node keeps so that lookups never leave it.

``ROOT/replica.lmdb`` holds layer manifests and chunk tables, sandbox records
and access traces; ``ROOT/meta/<layer hex>.erofs`` holds each layer's meta
image, which the kernel reads directly. A layer is fetched once, verified
(manifest digest, meta image digests, chunk table digest) and written
atomically; an entry present in the replica is complete. Temporary files of
a write that failed are removed, and those a killed daemon left are removed
at start.

The local meta image is not trusted either: before every mount,
:meth:`Replica.checked_meta` opens it, hashes the open file and compares the
sha256 with the manifest's (or, right after fetching it, keeps open the file
it wrote from the verified bytes); the caller mounts that open file
(``/proc/self/fd/N``), so the bytes checked are the bytes the kernel mounts,
even if the name is replaced meanwhile. A mismatch is logged, the image
fetched again from the store and checked again.

Sandbox records and microVM drive sets (``vms``) are node state: a
restarted daemon brings them back from here. It holds containerd's snapshots
too (:mod:`.containerd.snapstore`).

It also keeps what lets the node serve while the store is away: the
manifests it used (env manifests included), by digest, handed out only if
their bytes still match the digest (:meth:`Replica.manifest`), and its last
resolution of each ``name@version`` it brought up, with the time the store
gave it (:meth:`Replica.resolution`; the rule for using it is in docs/dev/node.md),
and the store's revocation list as last copied (:meth:`Replica.revocation`).

Thread safety: LMDB transactions are used from worker threads; LMDB
serialises writers itself and readers never block.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import lmdb

from ...errors import IntegrityError
from ...formats.chunktable import ChunkTable
from ...manifest import LayerManifest
from ...names import DIGEST_RE
from ...refstore import MetaCheck, RefStore
from ...store.base import sha256_digest

log = logging.getLogger(__name__)
DBS = (b"layers", b"chunktables", b"sandboxes", b"traces", b"manifests", b"resolutions",
       b"counters", b"snapshots", b"vms", b"revocations", b"datalost")
MAX_DBS = 16  # room for more named databases: an existing replica opens with more
RESOLUTION_REFRESH = 60.0  # seconds after which a resolution the store confirms is written again
TMP_MARK = ".tmp"  # meta/<hex>.tmp<pid>-<thread>: a meta image being written
HASH_READ = 256 << 10
T = TypeVar("T")


@dataclass
class ReplicaLayer:
    digest: str
    manifest: LayerManifest
    table: ChunkTable
    meta_path: Path

    @property
    def hex(self) -> str:
        return self.digest.removeprefix("sha256:")


@dataclass(frozen=True)
class KeptResolution:
    """The node's last resolution of ``kind`` ref ``name@version``: the store
    said ``digest`` at ``made`` (seconds since the epoch)."""

    digest: str
    made: float


@dataclass(frozen=True)
class CheckedMeta:
    """A layer's meta image, open, whose bytes matched the manifest's sha256.
    Mount ``source`` (the open file itself), then ``close`` it."""

    layer: ReplicaLayer
    fd: int

    @property
    def source(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    def close(self) -> None:
        os.close(self.fd)


class Replica:
    def __init__(self, root: str | os.PathLike[str], check_meta: MetaCheck | None = None,
                 make_room: Callable[[], bool] | None = None) -> None:
        """``check_meta``: the daemon's checker processes (else in-process);
        ``make_room``: gives room back when a commit finds ROOT full (the
        daemon's held space), True if it did."""
        self.root = Path(root)
        self.meta_dir = self.root / "meta"
        self.meta_dir.mkdir(parents=True, exist_ok=True)
        self._remove_temporaries()
        self.env = lmdb.open(str(self.root / "replica.lmdb"), max_dbs=MAX_DBS, map_size=1 << 34,
                             subdir=True, lock=True)
        self.check_meta = check_meta
        self.make_room = make_room
        self.dbs = {name.decode(): self.env.open_db(name) for name in DBS}

    def close(self) -> None:
        self.env.close()

    def _write(self, change: Callable[[lmdb.Transaction], object]) -> None:
        """``change`` in a write transaction, committed. A commit that fails
        for want of room (ENOSPC; EIO, LMDB's word for a short write) is tried
        once more after ``make_room`` gave room back (the daemon's held space:
        :mod:`.sandboxes.rootspace`); the environment stays usable after a failed commit,
        which LMDB aborts whole."""
        try:
            with self.env.begin(write=True) as txn:
                change(txn)
            return
        except lmdb.Error as exc:
            if not no_room(exc) or self.make_room is None or not self.make_room():
                raise
        with self.env.begin(write=True) as txn:
            change(txn)

    def transact(self, change: Callable[[lmdb.Transaction], T]) -> T:
        """``change``'s result, run in one write transaction, committed (as
        :meth:`_write`: tried once more after ``make_room`` on a full disk)."""
        out: list[T] = []

        def run(txn: lmdb.Transaction) -> None:
            out[:] = [change(txn)]
        self._write(run)
        return out[0]

    def _remove_temporaries(self) -> None:
        """Meta images a killed daemon was writing (the daemon owns ROOT)."""
        for stale in self.meta_dir.iterdir():
            if TMP_MARK in stale.name:
                log.warning("removing stale temporary %s", stale)
                stale.unlink(missing_ok=True)

    # -- layers --
    def layer(self, digest: str) -> ReplicaLayer | None:
        with self.env.begin() as txn:
            raw = txn.get(digest.encode(), db=self.dbs["layers"])
            table = txn.get(digest.encode(), db=self.dbs["chunktables"])
        meta = self.meta_dir / (digest.removeprefix("sha256:") + ".erofs")
        if raw is None or table is None or not meta.exists():
            return None
        return ReplicaLayer(digest, LayerManifest.from_bytes(bytes(raw)),
                            ChunkTable.from_bytes(bytes(table)), meta)

    def layer_digests(self) -> list[str]:
        """The layers held."""
        with self.env.begin() as txn:
            return [bytes(k).decode() for k, _ in txn.cursor(db=self.dbs["layers"])]

    def chunk_shas(self, digest: str) -> set[str]:
        """The sha256 (hex) of each chunk of a held layer (none if not held)."""
        with self.env.begin() as txn:
            raw = txn.get(digest.encode(), db=self.dbs["chunktables"])
        if raw is None:
            return set()
        return {e.sha256.hex() for e in ChunkTable.from_bytes(bytes(raw)).entries}

    def forget_layer(self, digest: str) -> set[str]:
        """Drop a layer: its entries, the resolutions naming it, its meta
        image; the sha256 of its chunks (for the cache to drop)."""
        chunks = self.chunk_shas(digest)
        key = digest.encode()

        def change(txn: lmdb.Transaction) -> None:
            for db in ("layers", "chunktables", "manifests", "traces"):
                txn.delete(key, db=self.dbs[db])
            for name, raw in list(txn.cursor(db=self.dbs["resolutions"])):
                if json.loads(bytes(raw)).get("digest") == digest:
                    txn.delete(name, db=self.dbs["resolutions"])
        self._write(change)
        (self.meta_dir / (digest.removeprefix("sha256:") + ".erofs")).unlink(missing_ok=True)
        return chunks

    def _fetch(self, refstore: RefStore, digest: str) -> tuple[ReplicaLayer, int | None]:
        """The layer, from the replica or else from the store; when its meta
        image was written just now, also an fd of the file written, which
        holds the bytes verified in memory (no need to hash them again)."""
        have = self.layer(digest)
        if have is not None:
            return have, None
        start = time.perf_counter()
        manifest = refstore.layer(digest)
        took = [("manifest", time.perf_counter())]
        with ThreadPoolExecutor(1) as pool:  # the two objects in one round trip
            # digest and structure (erofscheck) checked
            image_get = pool.submit(refstore.meta_image, manifest, self.check_meta)
            table_bytes = refstore.store.get_blob(manifest.chunk_table.digest)
            table = ChunkTable.from_bytes(table_bytes)
            refstore.check_table(manifest, table)
            took.append(("chunk table", time.perf_counter()))
            image = image_get.result()
            took.append(("meta image", time.perf_counter()))
        meta = self.meta_dir / (digest.removeprefix("sha256:") + ".erofs")
        fd = write_atomically(meta, image)
        took.append(("written", time.perf_counter()))
        try:
            self._write(lambda txn: (
                txn.put(digest.encode(), table_bytes, db=self.dbs["chunktables"]),
                txn.put(digest.encode(), manifest.to_bytes(), db=self.dbs["layers"]),
                txn.put(digest.encode(), refstore.manifest_bytes(digest),
                        db=self.dbs["manifests"])))
        except BaseException:
            os.close(fd)
            raise
        took.append(("recorded", time.perf_counter()))
        log.debug("layer %s fetched: %s", digest,
                  ", ".join(f"{step} {(t - start) * 1000:.1f} ms" for step, t in took))
        return ReplicaLayer(digest, manifest, table, meta), fd

    def checked_meta(self, refstore: RefStore, digest: str) -> CheckedMeta:
        """The layer (fetched once) with its meta image open and checked: the
        file just written from the verified image, or the local file hashed
        now against the manifest's digest. A local image that does not match
        is fetched again (one warning line); IntegrityError if even that
        copy does not match."""
        layer, fd = self._fetch(refstore, digest)
        if fd is None:
            fd = open_matching(layer)
        if fd is None:
            log.warning("local meta image %s does not match its manifest's digest; "
                        "fetching it again", layer.meta_path)
            layer.meta_path.unlink(missing_ok=True)
            layer, fd = self._fetch(refstore, digest)
            if fd is None:
                fd = open_matching(layer)
            if fd is None:
                raise IntegrityError(f"local meta image {layer.meta_path}",
                                     "does not match the manifest's digest")
        return CheckedMeta(layer, fd)

    def verified_layer(self, refstore: RefStore, digest: str) -> ReplicaLayer:
        """The layer, its local meta image checked (and fetched again if it
        does not match) but not kept open: for handing its path to a VMM."""
        checked = self.checked_meta(refstore, digest)
        checked.close()
        return checked.layer

    def fetch_table(self, refstore: RefStore, digest: str, manifest_bytes: bytes,
                    table_digest: str) -> ChunkTable:
        """A sealed LSMT layer's chunk table (verified), kept in the replica."""
        with self.env.begin() as txn:
            have = txn.get(digest.encode(), db=self.dbs["chunktables"])
        if have is not None:
            return ChunkTable.from_bytes(bytes(have))
        table_bytes = refstore.store.get_blob(table_digest)
        table = ChunkTable.from_bytes(table_bytes)
        self._write(lambda txn: (
            txn.put(digest.encode(), table_bytes, db=self.dbs["chunktables"]),
            txn.put(digest.encode(), manifest_bytes, db=self.dbs["layers"])))
        return table

    # -- manifests and resolutions: serving while the store is away --
    def manifest(self, digest: str) -> bytes | None:
        """The manifest at ``digest`` as the node keeps it (a layer's from its
        replica entry if need be), only if its bytes match the digest."""
        key = digest.encode()
        with self.env.begin() as txn:
            for db in ("manifests", "layers"):
                raw = txn.get(key, db=self.dbs[db])
                if raw is not None and sha256_digest(bytes(raw)) == digest:
                    return bytes(raw)
        return None

    def resolution(self, kind: str, name: str, version: str) -> KeptResolution | None:
        with self.env.begin() as txn:
            raw = txn.get(resolution_key(kind, name, version), db=self.dbs["resolutions"])
        if raw is None:
            return None
        try:  # a damaged record is no resolution (the store is asked, or exit 8)
            doc = json.loads(bytes(raw))
            kept = KeptResolution(str(doc["digest"]), float(doc["made"]))
            if not DIGEST_RE.fullmatch(kept.digest) or not math.isfinite(kept.made):
                raise ValueError(kept)
        except (ValueError, KeyError, TypeError):
            log.warning("resolution of %s@%s in the replica is damaged; ignored", name, version)
            return None
        return kept

    def keep_resolution(self, kind: str, name: str, version: str, digest: str, made: float,
                        manifest: bytes) -> None:
        """The store resolved ``name@version`` to ``digest`` (whose manifest is
        ``manifest``) at ``made``: kept, unless the same one was kept less than
        ``RESOLUTION_REFRESH`` seconds before (an ``up`` writes nothing then)."""
        kept = self.resolution(kind, name, version)
        if kept is not None and kept.digest == digest and made - kept.made < RESOLUTION_REFRESH:
            return
        doc = json.dumps({"digest": digest, "made": made}).encode()
        self._write(lambda txn: (
            txn.put(resolution_key(kind, name, version), doc, db=self.dbs["resolutions"]),
            txn.put(digest.encode(), manifest, db=self.dbs["manifests"], overwrite=False)))

    def keep_manifest(self, digest: str, manifest: bytes) -> None:
        """A manifest the store gave for a digest ref, for resolving it without the store."""
        if self.manifest(digest) is None:
            self._write(lambda txn: txn.put(digest.encode(), manifest, db=self.dbs["manifests"]))

    def forget_resolution(self, kind: str, name: str, version: str) -> None:
        """The store has no such ref (any more): the node forgets it too."""
        self._write(lambda txn: txn.delete(resolution_key(kind, name, version),
                                           db=self.dbs["resolutions"]))

    # -- revocations (layerfs.leases) --
    def keep_revocations(self, revocations: dict[str, bytes]) -> None:
        """The store's revocation list (digest → its document), replacing the one kept."""
        def change(txn: lmdb.Transaction) -> None:
            db = self.dbs["revocations"]
            for key in [bytes(k) for k, _ in txn.cursor(db=db)]:
                if key.decode() not in revocations:
                    txn.delete(key, db=db)
            for digest, doc in revocations.items():
                txn.put(digest.encode(), doc, db=db)
        self._write(change)

    def revocation(self, digest: str) -> bytes | None:
        """The kept revocation of ``digest``, if it is revoked."""
        with self.env.begin() as txn:
            raw = txn.get(digest.encode(), db=self.dbs["revocations"])
        return None if raw is None else bytes(raw)

    # -- sandboxes and vms whose data is gone (.dataloss) --
    def put_data_lost(self, sid: str, layers: list[str]) -> None:
        self._write(lambda txn: txn.put(sid.encode(), json.dumps(layers).encode(),
                                        db=self.dbs["datalost"]))

    def delete_data_lost(self, sid: str) -> None:
        self._write(lambda txn: txn.delete(sid.encode(), db=self.dbs["datalost"]))

    def data_lost(self) -> dict[str, list[str]]:
        """Sandbox (or vm) id → its layers whose data the store no longer had."""
        found: dict[str, list[str]] = {}
        with self.env.begin() as txn:
            for key, raw in txn.cursor(db=self.dbs["datalost"]):
                try:
                    layers = json.loads(bytes(raw))
                except ValueError:
                    continue
                if isinstance(layers, list) and all(isinstance(x, str) for x in layers):
                    found[bytes(key).decode(errors="replace")] = layers
        return found

    # -- sandboxes --
    def put_sandbox(self, sid: str, record: dict) -> None:
        self._write(lambda txn: txn.put(sid.encode(), json.dumps(record).encode(),
                                        db=self.dbs["sandboxes"]))

    def delete_sandbox(self, sid: str) -> None:
        self._write(lambda txn: txn.delete(sid.encode(), db=self.dbs["sandboxes"]))

    def sandboxes(self) -> dict[str, dict]:
        with self.env.begin() as txn:
            return {k.decode(): json.loads(bytes(v))
                    for k, v in txn.cursor(db=self.dbs["sandboxes"])}

    # -- microVM drive sets --
    def put_vm(self, vid: str, record: dict) -> None:
        self._write(lambda txn: txn.put(vid.encode(), json.dumps(record).encode(),
                                        db=self.dbs["vms"]))

    def delete_vm(self, vid: str) -> None:
        self._write(lambda txn: txn.delete(vid.encode(), db=self.dbs["vms"]))

    def vms(self) -> dict[str, object]:
        """Each recorded vm's JSON (a record that is not JSON: its text, for
        the caller to report)."""
        out: dict[str, object] = {}
        with self.env.begin() as txn:
            for k, v in txn.cursor(db=self.dbs["vms"]):
                try:
                    out[bytes(k).decode("utf-8", "replace")] = json.loads(bytes(v))
                except ValueError:
                    out[bytes(k).decode("utf-8", "replace")] = bytes(v).decode("utf-8",
                                                                               "replace")
        return out

    # -- counters that outlive a daemon --
    def counter(self, name: str) -> int:
        with self.env.begin() as txn:
            raw = txn.get(name.encode(), db=self.dbs["counters"])
        return int(bytes(raw)) if raw else 0

    def count(self, name: str) -> int:
        """Add one to the counter ``name``; its new value."""
        value = self.counter(name) + 1
        self._write(lambda txn: txn.put(name.encode(), str(value).encode(),
                                        db=self.dbs["counters"]))
        return value

    # -- traces: a layer's first-touch chunk order --
    def trace(self, digest: str) -> list[int]:
        with self.env.begin() as txn:
            raw = txn.get(digest.encode(), db=self.dbs["traces"])
        return json.loads(bytes(raw)) if raw else []

    def put_trace(self, digest: str, order: list[int]) -> None:
        self._write(lambda txn: txn.put(digest.encode(), json.dumps(order).encode(),
                                        db=self.dbs["traces"]))


def no_room(exc: lmdb.Error) -> bool:
    """Whether an LMDB error says the file system had no room for a write."""
    return isinstance(exc, lmdb.DiskError) or any(
        os.strerror(code) in str(exc) for code in (errno.ENOSPC, errno.EIO, errno.EDQUOT))


def resolution_key(kind: str, name: str, version: str) -> bytes:
    return f"{kind}/{name}@{version}".encode()


def write_atomically(path: Path, data: bytes) -> int:
    """``data`` into ``path`` through a temporary file, renamed; a read-only fd
    of the file written. The temporary file is removed if any step fails (a
    full disk). Not fsynced: a meta image is a copy, hashed against its
    manifest before every later mount (:func:`open_matching`), so one torn by
    a power cut is fetched again, not mounted."""
    tmp = path.with_name(f"{path.stem}{TMP_MARK}{os.getpid()}-{threading.get_ident()}")
    fd = -1
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        os.rename(tmp, path)
        return fd
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise


def open_matching(layer: ReplicaLayer) -> int | None:
    """An fd of the layer's local meta image if it is a regular file whose
    size and sha256 are the manifest's, else None (closed again)."""
    want = layer.manifest.meta
    try:
        fd = os.open(layer.meta_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size == want.raw_size \
                and fd_sha256(fd) == want.raw_digest:
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def fd_sha256(fd: int) -> str:
    """``sha256:<hex>`` of the open file ``fd``'s bytes, read from offset 0."""
    h = hashlib.sha256()
    buf = bytearray(HASH_READ)  # one buffer, read into: no fresh pages per read
    view = memoryview(buf)
    offset = 0
    while n := os.preadv(fd, [buf], offset):
        h.update(view[:n])
        offset += n
    return "sha256:" + h.hexdigest()
