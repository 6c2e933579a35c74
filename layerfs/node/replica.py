"""The metadata replica: what a node keeps so that lookups never leave it.

``ROOT/replica.lmdb`` holds layer manifests and chunk tables, sandbox records
and access traces; ``ROOT/meta/<layer hex>.erofs`` holds each layer's meta
image, which the kernel reads directly. A layer is fetched once, verified
(manifest digest, meta image digests, chunk table digest) and written
atomically; an entry present in the replica is complete.

Thread safety: LMDB transactions are used from worker threads; LMDB
serialises writers itself and readers never block.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import lmdb

from ..formats.chunktable import ChunkTable
from ..manifest import LayerManifest
from ..registry import Registry

DBS = (b"layers", b"chunktables", b"sandboxes", b"traces")


@dataclass
class ReplicaLayer:
    digest: str
    manifest: LayerManifest
    table: ChunkTable
    meta_path: Path

    @property
    def hex(self) -> str:
        return self.digest.removeprefix("sha256:")


class Replica:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.meta_dir = self.root / "meta"
        self.meta_dir.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(self.root / "replica.lmdb"), max_dbs=8, map_size=1 << 34,
                             subdir=True, lock=True)
        self.dbs = {name.decode(): self.env.open_db(name) for name in DBS}

    def close(self) -> None:
        self.env.close()

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

    def fetch_layer(self, reg: Registry, digest: str) -> ReplicaLayer:
        """Pull a layer's manifest, meta image and chunk table (verified) once."""
        have = self.layer(digest)
        if have is not None:
            return have
        manifest = reg.layer(digest)
        table_bytes = reg.store.get_blob(manifest.chunk_table.digest)
        table = ChunkTable.from_bytes(table_bytes)
        reg.check_table(manifest, table)
        image = reg.meta_image(manifest)  # digest and structure (erofscheck) checked
        meta = self.meta_dir / (digest.removeprefix("sha256:") + ".erofs")
        tmp = meta.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(image)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, meta)
        with self.env.begin(write=True) as txn:
            txn.put(digest.encode(), table_bytes, db=self.dbs["chunktables"])
            txn.put(digest.encode(), manifest.to_bytes(), db=self.dbs["layers"])
        return ReplicaLayer(digest, manifest, table, meta)

    def fetch_table(self, reg: Registry, digest: str, manifest_bytes: bytes,
                    table_digest: str) -> ChunkTable:
        """A sealed LSMT layer's chunk table (verified), kept in the replica."""
        with self.env.begin() as txn:
            have = txn.get(digest.encode(), db=self.dbs["chunktables"])
        if have is not None:
            return ChunkTable.from_bytes(bytes(have))
        table_bytes = reg.store.get_blob(table_digest)
        table = ChunkTable.from_bytes(table_bytes)
        with self.env.begin(write=True) as txn:
            txn.put(digest.encode(), table_bytes, db=self.dbs["chunktables"])
            txn.put(digest.encode(), manifest_bytes, db=self.dbs["layers"])
        return table

    # -- sandboxes --
    def put_sandbox(self, sid: str, record: dict) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(sid.encode(), json.dumps(record).encode(), db=self.dbs["sandboxes"])

    def delete_sandbox(self, sid: str) -> None:
        with self.env.begin(write=True) as txn:
            txn.delete(sid.encode(), db=self.dbs["sandboxes"])

    def sandboxes(self) -> dict[str, dict]:
        with self.env.begin() as txn:
            return {k.decode(): json.loads(bytes(v))
                    for k, v in txn.cursor(db=self.dbs["sandboxes"])}

    # -- traces: a layer's first-touch chunk order --
    def trace(self, digest: str) -> list[int]:
        with self.env.begin() as txn:
            raw = txn.get(digest.encode(), db=self.dbs["traces"])
        return json.loads(bytes(raw)) if raw else []

    def put_trace(self, digest: str, order: list[int]) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(digest.encode(), json.dumps(order).encode(), db=self.dbs["traces"])
