"""Leases and revocations: what nodes hold, and what they must not bring up, in the store.

A **lease** is ``leases/<node id>``: the node's id and host, when it was last
renewed and when it expires, and its holders (each sandbox, vm, writable
disk, and containerd's lazy snapshots) with the manifest digests each uses
(layers, an env's layers, a disk's base: a layer or a disk chain's top).
The node daemon writes it again every fifth of its TTL and soon after an
``up`` or ``down`` (:mod:`layerfs.node.replica.leaser`); a node that is gone stops
renewing it and it expires. ``gc`` keeps what a live lease reaches, as it
keeps what a ref reaches (:mod:`layerfs.gc`); ``rm`` and ``revoke`` name the
holders of what they touch.

A **revocation** is ``revoked/<hex>`` (the manifest's digest): the digest,
the ref it was given as, when, and why. Nodes copy the list into their
replica at each lease renewal and refuse a new ``up`` (``vm up``, ``disk
create --base``) of a revoked env or layer from then on, their store away or
not; ``unrevoke`` deletes the object. Sandboxes already up stay up: the
revoking command lists them (from the leases) for an operator to force down.

Both are small JSON documents, bounded in size; one that does not parse is
set aside as unreadable by whoever lists them.
"""

from __future__ import annotations

import json
import re
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .errors import IntegrityError, ObjectNotFound
from .names import DIGEST_RE
from .refstore import Unreadable
from .store.base import Store

LEASE_PREFIX = "leases/"
REVOKED_PREFIX = "revoked/"
MAX_DOCUMENT = 4 << 20  # bytes a lease or revocation may have
NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class Holder:
    """A sandbox (vm, disk, snapshots) on a node, and the manifests it uses."""

    kind: str  # sandbox, vm, disk, containerd
    id: str
    digests: tuple[str, ...]  # manifest digests; a sandbox's and vm's layers top first
    ref: str = ""  # what it was brought up from (an env ref, layer refs), if known

    def __str__(self) -> str:
        return f"{self.kind} {self.id}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "id": self.id, "digests": list(self.digests), "ref": self.ref}


@dataclass
class Lease:
    node: str
    host: str
    renewed: float  # seconds since the epoch, the node's clock
    expires: float
    holders: list[Holder] = field(default_factory=list)

    def live(self, now: float) -> bool:
        return self.expires > now

    def digests(self) -> set[str]:
        return {d for h in self.holders for d in h.digests}

    def to_bytes(self) -> bytes:
        return json.dumps({"node": self.node, "host": self.host, "renewed": self.renewed,
                           "expires": self.expires,
                           "holders": [h.to_json() for h in self.holders]},
                          sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, what: str) -> Lease:
        doc = _document(data, what)
        try:
            holders = [Holder(str(h["kind"]), str(h["id"]), tuple(_digests(h["digests"], what)),
                              str(h.get("ref", ""))) for h in doc["holders"]]
            return cls(str(doc["node"]), str(doc["host"]), float(doc["renewed"]),
                       float(doc["expires"]), holders)
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(what, f"bad field: {exc}") from None


@dataclass(frozen=True)
class Revocation:
    digest: str
    ref: str  # as given to `revoke`
    kind: str  # layer or env
    revoked: float
    reason: str = ""

    def to_bytes(self) -> bytes:
        return json.dumps({"digest": self.digest, "ref": self.ref, "kind": self.kind,
                           "revoked": self.revoked, "reason": self.reason},
                          sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, what: str) -> Revocation:
        doc = _document(data, what)
        try:
            digest, = _digests([doc["digest"]], what)
            return cls(digest, str(doc["ref"]), str(doc["kind"]), float(doc["revoked"]),
                       str(doc.get("reason", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(what, f"bad field: {exc}") from None


@dataclass(frozen=True)
class Held:
    """One holder of a digest: on which node, in what lease."""

    lease: Lease
    holder: Holder

    def __str__(self) -> str:
        return f"node {self.lease.node} ({self.lease.host}) {self.holder}"


def _document(data: bytes, what: str) -> dict[str, Any]:
    if len(data) > MAX_DOCUMENT:
        raise IntegrityError(what, f"over {MAX_DOCUMENT} bytes")
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise IntegrityError(what, f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise IntegrityError(what, "not a JSON object")
    return doc


def _digests(values: object, what: str) -> list[str]:
    if not isinstance(values, list) or not all(
            isinstance(v, str) and DIGEST_RE.match(v) for v in values):
        raise IntegrityError(what, "digests: not a list of sha256 digests")
    return list(values)


def lease_key(node: str) -> str:
    return LEASE_PREFIX + node


def revocation_key(digest: str) -> str:
    return REVOKED_PREFIX + digest.removeprefix("sha256:")


def new_node_id() -> str:
    """This host's name (the characters a key allows) and a random suffix."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip(".-")[:64] or "node"
    return f"{host}-{uuid.uuid4().hex[:8]}"


def write_lease(store: Store, lease: Lease) -> None:
    store.put(lease_key(lease.node), lease.to_bytes())


def read_leases(store: Store) -> tuple[list[Lease], list[Unreadable]]:
    """Every lease in the store (expired ones too), and those that cannot be read."""
    leases: list[Lease] = []
    bad: list[Unreadable] = []
    for info in store.list(LEASE_PREFIX):
        node = info.key.removeprefix(LEASE_PREFIX)
        what = f"lease {node}"
        try:
            lease = Lease.from_bytes(store.get(info.key), what)
            if lease.node != node:  # (gc deletes an expired lease by its node's key)
                raise IntegrityError(what, f"it names node {lease.node!r}")
            leases.append(lease)
        except ObjectNotFound:
            continue  # (deleted since the listing)
        except IntegrityError as exc:
            bad.append(Unreadable(what, exc.message()))
    return leases, bad


def live_leases(store: Store, now: float | None = None) -> list[Lease]:
    """The leases not expired at ``now`` (unreadable ones left out)."""
    moment = time.time() if now is None else now
    return [lease for lease in read_leases(store)[0] if lease.live(moment)]


def holders_of(leases: list[Lease], digest: str, layers: list[str] | None = None) -> list[Held]:
    """Who in ``leases`` holds ``digest``: a holder that uses it; for an env
    (``layers``: its layers, top first), a holder whose layers are exactly those."""
    found = []
    for lease in leases:
        for holder in lease.holders:
            if digest in holder.digests or (layers and list(holder.digests) == layers):
                found.append(Held(lease, holder))
    return found


def write_revocation(store: Store, revocation: Revocation) -> None:
    store.put(revocation_key(revocation.digest), revocation.to_bytes())


def delete_revocation(store: Store, digest: str) -> bool:
    """Remove the revocation of ``digest``; False if there was none."""
    key = revocation_key(digest)
    if store.head(key) is None:
        return False
    store.delete(key)
    return True


def read_revocations(store: Store) -> tuple[list[Revocation], list[Unreadable]]:
    found: list[Revocation] = []
    bad: list[Unreadable] = []
    for info in store.list(REVOKED_PREFIX):
        what = f"revocation {info.key.removeprefix(REVOKED_PREFIX)}"
        try:
            found.append(Revocation.from_bytes(store.get(info.key), what))
        except ObjectNotFound:
            continue
        except IntegrityError as exc:
            bad.append(Unreadable(what, exc.message()))
    return found, bad
