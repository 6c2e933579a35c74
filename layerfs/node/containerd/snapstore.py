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

Two indexes, kept in the same transactions, make every check a lookup, so
that no call's cost grows with the number of snapshots: ``snapshot-children``
(a parent's name to its children's, duplicates sorted) and
``snapshot-chains`` (a lazy snapshot by the chain it holds and its parent).
Only a snapshot layerfs made from layers it verified has a ``chain`` (a field
of its record no request sets): a ``containerd.io/snapshot.ref`` label a
caller puts on a snapshot names nothing.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import lmdb

from ..replica.replica import Replica

ACTIVE, VIEW, COMMITTED = "active", "view", "committed"
KINDS = (ACTIVE, VIEW, COMMITTED)
MAX_NAME = 480  # bytes: LMDB keys (and sorted duplicates) are at most 511
MAX_LABEL = 4096  # bytes of a label's key and value together (containerd's own bound)
MAX_LABELS = 64  # labels on one snapshot (containerd and its CRI plugin set a handful)
MAX_LABELS_BYTES = 16 << 10  # their keys and values together
TARGET_LABEL = "containerd.io/snapshot.ref"  # the chain ID a Prepare's snapshot is to become
SNAPSHOT_IDS = "snapshot-ids"  # the replica counter that numbers snapshot directories
CHILDREN_DB = b"snapshot-children"  # parent name -> child names (sorted duplicates)
CHAINS_DB = b"snapshot-chains"  # chain_key(chain, parent) -> the lazy snapshot's name
INDEXED = "snapshot-indexes"  # counter: the version of the indexes built (0: none yet)
INDEX_VERSION = 1
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


class SnapshotsClosed(SnapshotError):
    """The daemon stops: no record is read or written any more."""

    code = "UNAVAILABLE"


@dataclass
class SnapshotRecord:
    """One snapshot. ``layers``: for a lazy committed snapshot, the layerfs
    layer digests (top first) whose mounts are its whole tree; empty for a
    plain one, whose tree is its ``fs`` directory over its parent's.
    ``chain``: the chain ID those layers were verified to make (set by
    layerfs only, on a lazy snapshot; never from a request).
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
    chain: str = ""

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> SnapshotRecord:
        doc = json.loads(raw)
        layers = [str(d) for d in doc.get("layers", [])]
        labels = {str(k): str(v) for k, v in dict(doc.get("labels", {})).items()}
        # a lazy record written before chains were kept: layerfs alone sets layers, and
        # its Prepare's label named the chain it verified
        chain = str(doc.get("chain", labels.get(TARGET_LABEL, "") if layers else ""))
        record = cls(name=str(doc["name"]), kind=str(doc["kind"]), id=int(doc["id"]),
                     parent=str(doc.get("parent", "")), labels=labels,
                     created=float(doc.get("created", 0)), updated=float(doc.get("updated", 0)),
                     layers=layers, size=int(doc.get("size", 0)),
                     inodes=int(doc.get("inodes", 0)), chain=chain)
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
    """``labels`` if each, their number and their total size are within bounds."""
    if len(labels) > MAX_LABELS:
        raise SnapshotInvalid(f"{len(labels)} labels: a snapshot has at most {MAX_LABELS}")
    total = 0
    for key, value in labels.items():
        size = len(key.encode()) + len(value.encode())
        if size > MAX_LABEL:
            raise SnapshotInvalid(f"label {key[:64]!r}: key and value longer than {MAX_LABEL} "
                                  "bytes")
        total += size
    if total > MAX_LABELS_BYTES:
        raise SnapshotInvalid(f"labels of {total} bytes: a snapshot's are at most "
                              f"{MAX_LABELS_BYTES}")
    return dict(labels)


def chain_key(chain: str, parent: str) -> bytes:
    """The ``snapshot-chains`` key of chain ID ``chain`` on ``parent`` (a
    digest: the two together may be longer than an LMDB key)."""
    return hashlib.sha256(json.dumps([chain, parent]).encode()).digest()


class Gate:
    """Counts the threads using the records; :meth:`close` waits for them and
    lets no more in, so the replica is never closed under one."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.inside = 0
        self.closed = False

    def __enter__(self) -> None:
        with self.cond:
            if self.closed:
                raise SnapshotsClosed("the layerfs daemon is stopping")
            self.inside += 1

    def __exit__(self, *_: object) -> None:
        with self.cond:
            self.inside -= 1
            self.cond.notify_all()

    def close(self, timeout: float) -> int:
        """No more entries; wait up to ``timeout`` seconds for those inside;
        how many are left."""
        with self.cond:
            self.closed = True
            self.cond.wait_for(lambda: self.inside == 0, timeout)
            return self.inside


class SnapshotStore:
    """The snapshot records in the replica (worker threads only: LMDB)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.db = replica.dbs["snapshots"]
        self.children = replica.env.open_db(CHILDREN_DB, dupsort=True)
        self.chains = replica.env.open_db(CHAINS_DB)
        self.gate = Gate()
        if replica.counter(INDEXED) != INDEX_VERSION:
            self.replica.transact(self._reindex)

    def _change(self, change: Callable[[lmdb.Transaction], T]) -> T:
        with self.gate:
            return self.replica.transact(change)

    def _read(self, read: Callable[[lmdb.Transaction], T]) -> T:
        with self.gate, self.replica.env.begin() as txn:
            return read(txn)

    # -- the indexes --
    def _reindex(self, txn: lmdb.Transaction) -> None:
        """Both indexes made again from the records (a replica from before
        them), and marked as built."""
        txn.drop(self.children, delete=False)
        txn.drop(self.chains, delete=False)
        for _, raw in txn.cursor(db=self.db):
            self._index(txn, SnapshotRecord.from_bytes(bytes(raw)))
        txn.put(INDEXED.encode(), str(INDEX_VERSION).encode(), db=self.replica.dbs["counters"])

    def _index(self, txn: lmdb.Transaction, record: SnapshotRecord) -> None:
        if record.parent:
            txn.put(record.parent.encode(), record.name.encode(), db=self.children)
        if record.chain:
            txn.put(chain_key(record.chain, record.parent), record.name.encode(), db=self.chains)

    def _unindex(self, txn: lmdb.Transaction, record: SnapshotRecord) -> None:
        if record.parent:
            txn.delete(record.parent.encode(), record.name.encode(), db=self.children)
        if record.chain:
            key = chain_key(record.chain, record.parent)
            if txn.get(key, db=self.chains) == record.name.encode():
                txn.delete(key, db=self.chains)

    def index_problems(self) -> list[str]:
        """What the indexes hold that the records do not say, or lack (a full
        scan: for tests and checks, never on a request's path)."""
        def read(txn: lmdb.Transaction) -> list[str]:
            want_children: set[tuple[bytes, bytes]] = set()
            want_chains: dict[bytes, bytes] = {}
            for _, raw in txn.cursor(db=self.db):
                record = SnapshotRecord.from_bytes(bytes(raw))
                if record.parent:
                    want_children.add((record.parent.encode(), record.name.encode()))
                if record.chain:
                    want_chains[chain_key(record.chain, record.parent)] = record.name.encode()
            children = {(bytes(k), bytes(v)) for k, v in txn.cursor(db=self.children)}
            chains = {bytes(k): bytes(v) for k, v in txn.cursor(db=self.chains)}
            problems = [f"child index lacks {p!r} -> {c!r}" for p, c in want_children - children]
            problems += [f"child index has {p!r} -> {c!r}" for p, c in children - want_children]
            if chains != want_chains:
                problems.append(f"chain index {sorted(chains.values())} for "
                                f"{sorted(want_chains.values())}")
            return problems
        return self._read(read)

    # -- lookups --
    def _get(self, txn: lmdb.Transaction, name: str) -> SnapshotRecord | None:
        raw = txn.get(check_name(name), db=self.db)
        return SnapshotRecord.from_bytes(bytes(raw)) if raw is not None else None

    def _put(self, txn: lmdb.Transaction, record: SnapshotRecord) -> None:
        txn.put(check_name(record.name), record.to_bytes(), db=self.db)

    def get(self, name: str) -> SnapshotRecord:
        record = self._read(lambda txn: self._get(txn, name))
        if record is None:
            raise SnapshotNotFound(f"snapshot {name} does not exist")
        return record

    def all(self) -> list[SnapshotRecord]:
        return self._read(lambda txn: list(self._records(txn)))

    def _records(self, txn: lmdb.Transaction) -> Iterator[SnapshotRecord]:
        for _, raw in txn.cursor(db=self.db):
            yield SnapshotRecord.from_bytes(bytes(raw))

    def ids(self) -> set[int]:
        """The directory numbers of every snapshot."""
        return {r.id for r in self.all()}

    def lineage(self, name: str, limit: int) -> list[SnapshotRecord]:
        """``name``'s record and its ancestors', child first, down to the first
        lazy one (whose layers are the whole tree below), in one read; at most
        ``limit`` + 1 of them (the caller refuses a longer line)."""
        def read(txn: lmdb.Transaction) -> list[SnapshotRecord]:
            line: list[SnapshotRecord] = []
            at = name
            while at and len(line) <= limit:
                record = self._get(txn, at)
                if record is None:
                    raise SnapshotNotFound(f"snapshot {at} does not exist")
                line.append(record)
                if record.layers:
                    break
                at = record.parent
            return line
        return self._read(read)

    def find_target(self, target: str, parent: str) -> SnapshotRecord | None:
        """The lazy snapshot layerfs made of chain ``target`` on ``parent``."""
        return self._read(lambda txn: self._find_target(txn, target, parent))

    def _find_target(self, txn: lmdb.Transaction, target: str,
                     parent: str) -> SnapshotRecord | None:
        name = txn.get(chain_key(target, parent), db=self.chains)
        if name is None:
            return None
        record = self._get(txn, bytes(name).decode())
        if record is None or record.chain != target or record.parent != parent:
            return None  # (the indexes are kept with the records: never)
        return record

    def _next_id(self, txn: lmdb.Transaction) -> int:
        """A number no snapshot had, counted in the transaction that uses it."""
        counters = self.replica.dbs["counters"]
        raw = txn.get(SNAPSHOT_IDS.encode(), db=counters)
        value = (int(bytes(raw)) if raw else 0) + 1
        txn.put(SNAPSHOT_IDS.encode(), str(value).encode(), db=counters)
        return value

    # -- changes: one write transaction each, lookups only --
    def create(self, record: SnapshotRecord) -> SnapshotRecord:
        """Add ``record`` (a new key, its parent committed), numbered now. A
        lazy one (its ``chain`` set): if a lazy snapshot of that chain and
        parent is there already, that one is returned and nothing is added."""
        def change(txn: lmdb.Transaction) -> SnapshotRecord:
            if self._get(txn, record.name) is not None:
                raise SnapshotExists(f"snapshot {record.name} already exists")
            if record.parent:
                parent = self._get(txn, record.parent)
                if parent is None:
                    raise SnapshotNotFound(f"parent snapshot {record.parent} does not exist")
                if parent.kind != COMMITTED:
                    raise SnapshotInvalid(f"parent {record.parent} is not a committed snapshot")
            if record.chain:
                other = self._find_target(txn, record.chain, record.parent)
                if other is not None:
                    return other
            record.id = self._next_id(txn)
            self._put(txn, record)
            self._index(txn, record)
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
            self._unindex(txn, active)
            txn.delete(check_name(key), db=self.db)
            self._put(txn, done)
            self._index(txn, done)
            return done
        return self._change(change)

    def remove(self, key: str) -> SnapshotRecord:
        """Delete the record of ``key``, which no snapshot may have as parent."""
        def change(txn: lmdb.Transaction) -> SnapshotRecord:
            record = self._get(txn, key)
            if record is None:
                raise SnapshotNotFound(f"snapshot {key} does not exist")
            if txn.get(check_name(key), db=self.children) is not None:
                raise SnapshotPrecondition(f"cannot remove snapshot {key}: it has children")
            self._unindex(txn, record)
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
