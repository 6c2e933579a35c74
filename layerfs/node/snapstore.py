"""containerd's snapshots as the node keeps them: records in the replica.

A snapshot is named by the key containerd gave it (``<namespace>/<n>/<key>``
for the ones its metadata store makes); it is ``active`` (writable: a
Prepare), ``view`` (read-only: a View) or ``committed`` (a Commit, or a lazy
chain of layerfs layers). Its record (:class:`SnapshotRecord`) is kept in the
replica's ``snapshots`` table by name, so that a restarted daemon knows every
snapshot; its files (``ROOT/snapshots/<id>/fs`` and ``work``) are named by a
number the record holds. Every change is one LMDB write transaction that
checks what containerd's own snapshotters check (a key not taken, a parent
that exists and is committed, no child left on a removed snapshot), so
concurrent requests from containerd's threads need no lock of their own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import lmdb

from .replica import Replica

ACTIVE, VIEW, COMMITTED = "active", "view", "committed"
KINDS = (ACTIVE, VIEW, COMMITTED)
MAX_NAME = 480  # bytes: LMDB keys are at most 511
MAX_LABEL = 4096  # bytes of a label's key and value together (containerd's own bound)
TARGET_LABEL = "containerd.io/snapshot.ref"  # the chain ID a Prepare's snapshot is to become
SNAPSHOT_IDS = "snapshot-ids"  # the replica counter that numbers snapshot directories
T = TypeVar("T")


class SnapshotError(Exception):
    """A request containerd's snapshotter semantics refuse; ``code`` is the
    gRPC status name it answers with."""

    code = "UNKNOWN"


class SnapshotNotFound(SnapshotError):
    code = "NOT_FOUND"


class SnapshotExists(SnapshotError):
    code = "ALREADY_EXISTS"


class SnapshotPrecondition(SnapshotError):
    code = "FAILED_PRECONDITION"


class SnapshotInvalid(SnapshotError):
    code = "INVALID_ARGUMENT"


@dataclass
class SnapshotRecord:
    """One snapshot. ``layers``: for a lazy committed snapshot, the layerfs
    layer digests (top first) whose mounts are its whole tree; empty for a
    plain one, whose tree is its ``fs`` directory over its parent's.
    ``size``/``inodes``: a plain committed snapshot's usage, taken at commit."""

    name: str
    kind: str
    id: int
    parent: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    created: float = 0.0
    updated: float = 0.0
    layers: list[str] = field(default_factory=list)
    size: int = 0
    inodes: int = 0

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> SnapshotRecord:
        doc = json.loads(raw)
        record = cls(name=str(doc["name"]), kind=str(doc["kind"]), id=int(doc["id"]),
                     parent=str(doc.get("parent", "")),
                     labels={str(k): str(v) for k, v in dict(doc.get("labels", {})).items()},
                     created=float(doc.get("created", 0)), updated=float(doc.get("updated", 0)),
                     layers=[str(d) for d in doc.get("layers", [])],
                     size=int(doc.get("size", 0)), inodes=int(doc.get("inodes", 0)))
        if record.kind not in KINDS:
            raise ValueError(f"snapshot kind {record.kind!r}")
        return record


def check_name(name: str, what: str = "key") -> bytes:
    """A snapshot name or key as the replica's key; refused if empty or too long."""
    raw = name.encode()
    if not raw:
        raise SnapshotInvalid(f"snapshot {what} must not be empty")
    if len(raw) > MAX_NAME:
        raise SnapshotInvalid(f"snapshot {what} longer than {MAX_NAME} bytes")
    return raw


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    for key, value in labels.items():
        if len(key.encode()) + len(value.encode()) > MAX_LABEL:
            raise SnapshotInvalid(f"label {key[:64]!r}: key and value longer than {MAX_LABEL} "
                                  "bytes")
    return dict(labels)


class SnapshotStore:
    """The snapshot records in the replica (worker threads only: LMDB)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.db = replica.dbs["snapshots"]

    def _change(self, change: Callable[[lmdb.Transaction], T]) -> T:
        return self.replica.transact(change)

    def _get(self, txn: lmdb.Transaction, name: str) -> SnapshotRecord | None:
        raw = txn.get(check_name(name), db=self.db)
        return SnapshotRecord.from_bytes(bytes(raw)) if raw is not None else None

    def _put(self, txn: lmdb.Transaction, record: SnapshotRecord) -> None:
        txn.put(check_name(record.name), record.to_bytes(), db=self.db)

    def get(self, name: str) -> SnapshotRecord:
        with self.replica.env.begin() as txn:
            record = self._get(txn, name)
        if record is None:
            raise SnapshotNotFound(f"snapshot {name} does not exist")
        return record

    def all(self) -> list[SnapshotRecord]:
        with self.replica.env.begin() as txn:
            return [SnapshotRecord.from_bytes(bytes(v)) for _, v in txn.cursor(db=self.db)]

    def find_target(self, target: str, parent: str) -> SnapshotRecord | None:
        """The committed snapshot of ``containerd.io/snapshot.ref`` ``target`` on ``parent``."""
        with self.replica.env.begin() as txn:
            return self._find_target(txn, target, parent)

    def _find_target(self, txn: lmdb.Transaction, target: str,
                     parent: str) -> SnapshotRecord | None:
        for _, raw in txn.cursor(db=self.db):
            other = SnapshotRecord.from_bytes(bytes(raw))
            if other.kind == COMMITTED and other.parent == parent \
                    and other.labels.get(TARGET_LABEL) == target:
                return other
        return None

    def _next_id(self, txn: lmdb.Transaction) -> int:
        """A number no snapshot had, counted in the transaction that uses it."""
        counters = self.replica.dbs["counters"]
        raw = txn.get(SNAPSHOT_IDS.encode(), db=counters)
        value = (int(bytes(raw)) if raw else 0) + 1
        txn.put(SNAPSHOT_IDS.encode(), str(value).encode(), db=counters)
        return value

    def create(self, record: SnapshotRecord, same_target: str = "") -> SnapshotRecord:
        """Add ``record`` (a new key, its parent committed), numbered now. With ``same_target``
        (a lazy chain), an existing committed snapshot of that
        ``containerd.io/snapshot.ref`` and parent is returned instead, and
        nothing is added."""
        def change(txn: lmdb.Transaction) -> SnapshotRecord:
            if self._get(txn, record.name) is not None:
                raise SnapshotExists(f"snapshot {record.name} already exists")
            if record.parent:
                parent = self._get(txn, record.parent)
                if parent is None:
                    raise SnapshotNotFound(f"parent snapshot {record.parent} does not exist")
                if parent.kind != COMMITTED:
                    raise SnapshotInvalid(f"parent {record.parent} is not a committed snapshot")
            if same_target:
                other = self._find_target(txn, same_target, record.parent)
                if other is not None:
                    return other
            record.id = self._next_id(txn)
            self._put(txn, record)
            return record
        return self._change(change)

    def commit(self, key: str, name: str, labels: dict[str, str], size: int,
               inodes: int) -> SnapshotRecord:
        """The active snapshot ``key`` becomes the committed snapshot ``name``
        (same files, same parent)."""
        def change(txn: lmdb.Transaction) -> SnapshotRecord:
            active = self._get(txn, key)
            if active is None:
                raise SnapshotNotFound(f"snapshot {key} does not exist")
            if active.kind != ACTIVE:
                raise SnapshotPrecondition(f"snapshot {key} is not active")
            if self._get(txn, name) is not None:
                raise SnapshotExists(f"snapshot {name} already exists")
            now = time.time()
            done = SnapshotRecord(name=name, kind=COMMITTED, id=active.id, parent=active.parent,
                                  labels=labels, created=now, updated=now, size=size,
                                  inodes=inodes)
            txn.delete(check_name(key), db=self.db)
            self._put(txn, done)
            return done
        return self._change(change)

    def remove(self, key: str) -> SnapshotRecord:
        """Delete the record of ``key``, which no snapshot may have as parent."""
        def change(txn: lmdb.Transaction) -> SnapshotRecord:
            record = self._get(txn, key)
            if record is None:
                raise SnapshotNotFound(f"snapshot {key} does not exist")
            for _, raw in txn.cursor(db=self.db):
                if SnapshotRecord.from_bytes(bytes(raw)).parent == key:
                    raise SnapshotPrecondition(f"cannot remove snapshot {key}: it has children")
            txn.delete(check_name(key), db=self.db)
            return record
        return self._change(change)

    def update_labels(self, name: str, labels: dict[str, str],
                      paths: list[str]) -> SnapshotRecord:
        """containerd's Update: only labels change; ``paths`` (the field mask)
        ``labels`` or ``labels.<key>`` each, or none for all labels."""
        def change(txn: lmdb.Transaction) -> SnapshotRecord:
            record = self._get(txn, name)
            if record is None:
                raise SnapshotNotFound(f"snapshot {name} does not exist")
            if not paths:
                record.labels = dict(labels)
            for path in paths:
                if path == "labels":
                    record.labels = dict(labels)
                elif path.startswith("labels."):
                    key = path.removeprefix("labels.")
                    if key in labels:
                        record.labels[key] = labels[key]
                    else:
                        record.labels.pop(key, None)
                else:
                    raise SnapshotInvalid(f"cannot update {path!r} of snapshot {name}")
            check_labels(record.labels)
            record.updated = time.time()
            self._put(txn, record)
            return record
        return self._change(change)

