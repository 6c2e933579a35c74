"""Garbage collection: delete blobs that no ref reaches, and leftovers of
interrupted writes.

Reachable: every ref's manifest; a layer manifest's meta image, chunk table and
the packs its chunk table names; an env manifest's layer manifests (and theirs).
An unreachable blob is deleted only if it was last written or refreshed more
than the grace period before this run started, and only after a fresh look at
its age right before the delete: a push refreshes every blob it reuses before it
writes its ref (see docs/dev/builder.md, "gc and concurrent pushes"). Temporary
files of the file store (``.tmp~*``, left by a killed writer) older than the
grace period are deleted too.

What a live node lease names (:mod:`layerfs.leases`: the layers, envs'
layers and disk chains a node's sandboxes, vms and disks use) is reached the
same way, whatever the refs say, and reported as kept for that node and
holder; a lease past its expiry keeps nothing (reported; deleted a day
after it expired). A manifest a live lease names that the store no longer has
is reported (that node's sandbox has lost its data), not set aside.

Before the walk, refs whose expiry has passed are removed
(:func:`layerfs.retention.expire_refs`; a layer an env names is kept), so the
blobs only they reached are freed by the same run.

A ref, manifest or chunk table gc cannot read (corrupt, missing, of an unknown
kind) is set aside as an :class:`~layerfs.refstore.Unreadable` and the walk
goes on; but what it references cannot be known, so gc then deletes no blob at
all (a sweep could take what the bad object's repaired copy needs): it still
reports what is unreachable and still deletes old temporaries (no manifest
references those), and the command exits with the integrity error code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .errors import IntegrityError, ObjectNotFound
from .leases import Lease, lease_key, read_leases
from .manifest import EnvManifest, manifest_head
from .refstore import BAD_OBJECT, ENVS, LAYERS, RefStore, Unreadable
from .retention import ExpiryReport, expire_refs
from .store.base import BLOB_PREFIX, ObjectInfo, Store

DEFAULT_GRACE = 3600.0
LEASE_FORGET = 86400.0  # seconds after its expiry that gc deletes a lease


@dataclass
class KeptForLease:
    """What gc kept for one holder of a live lease that no ref reaches."""

    node: str
    host: str
    holder: str  # "sandbox s1"
    digest: str  # the manifest the holder uses
    blobs: int  # blobs first reached through it (0: an earlier holder's, shared)
    gone: bool = False  # the store no longer has the manifest: the holder's data is lost

    def to_json(self) -> dict:
        return {"node": self.node, "host": self.host, "holder": self.holder,
                "digest": self.digest, "blobs": self.blobs, "gone": self.gone}

    def line(self) -> str:
        where = f"node {self.node} ({self.host}) {self.holder}"
        if self.gone:
            return f"lease of {where} names {self.digest}, which the store no longer has"
        if not self.blobs:
            return f"kept for {where}: {self.digest} (shared with a holder above)"
        return f"kept for {where}: {self.digest} ({self.blobs} blobs no ref reaches)"


@dataclass
class GcReport:
    reachable: int = 0
    unreachable: list[dict] = field(default_factory=list)
    deleted: int = 0
    deleted_bytes: int = 0
    kept_young: int = 0
    temporaries: list[dict] = field(default_factory=list)  # leftovers of interrupted writes
    deleted_temporaries: int = 0
    unreadable: list[Unreadable] = field(default_factory=list)  # set aside; no blob deleted
    expiry: ExpiryReport = field(default_factory=lambda: ExpiryReport([], [], 0, []))
    kept_for_leases: list[KeptForLease] = field(default_factory=list)
    live_leases: list[str] = field(default_factory=list)  # node ids
    expired_leases: list[dict] = field(default_factory=list)  # {"node", "expired", "deleted"}

    @property
    def swept(self) -> bool:
        """Whether unreachable blobs may be deleted: every ref and manifest was read."""
        return not self.unreadable


@dataclass
class Reachable:
    """The blobs the refs reach, and what could not be read on the way."""

    blobs: set[str] = field(default_factory=set)
    unreadable: list[Unreadable] = field(default_factory=list)


def reachable_blobs(refstore: RefStore, leave_out: set[tuple[str, str]] | None = None) -> Reachable:
    """The blobs the refs reach (but the refs ``leave_out``: (kind, name@version))."""
    found = Reachable()
    todo: list[tuple[str, str]] = []  # (manifest digest, the ref it was reached from)
    for kind in (LAYERS, ENVS):
        entries, bad = refstore.scan_refs(kind)
        found.unreadable += bad
        todo += [(entry.digest, f"{kind[:-1]} {entry}") for entry in entries
                 if (kind, str(entry)) not in (leave_out or set())]
    _walk(refstore, todo, found)
    return found


def _walk(refstore: RefStore, todo: list[tuple[str, str]], found: Reachable,
          missing_ok: bool = False) -> list[str]:
    """Add to ``found`` what the manifests in ``todo`` reach; with ``missing_ok``
    a missing manifest is returned, not set aside as unreadable."""
    missing: list[str] = []
    while todo:
        digest, via = todo.pop()
        if digest in found.blobs:
            continue
        found.blobs.add(digest)
        try:
            _reach(refstore, digest, via, found.blobs, todo)
        except ObjectNotFound as exc:
            if not missing_ok:
                found.unreadable.append(Unreadable(f"manifest {digest} of {via}", exc.message()))
            missing.append(digest)
        except BAD_OBJECT as exc:
            found.unreadable.append(Unreadable(f"manifest {digest} of {via}", exc.message()))
    return missing


def keep_leased(refstore: RefStore, leases: list[Lease], now: float, found: Reachable,
                report: GcReport) -> None:
    """Add what each live lease reaches to ``found``; reported for each holder of
    a manifest no ref reaches, with the blobs first reached through it."""
    by_refs = set(found.blobs)
    for lease in leases:
        if not lease.live(now):
            continue
        report.live_leases.append(lease.node)
        for holder in lease.holders:
            for digest in holder.digests:
                before = len(found.blobs)
                if digest in by_refs:
                    continue
                missing = _walk(refstore, [(digest, f"lease {lease.node} {holder}")], found,
                                missing_ok=True)
                report.kept_for_leases.append(KeptForLease(
                    lease.node, lease.host, str(holder), digest,
                    len(found.blobs) - before - len(missing), digest in missing))


def _reach(refstore: RefStore, digest: str, via: str, seen: set[str],
           todo: list[tuple[str, str]]) -> None:
    """Add what the manifest at ``digest`` references: blobs to ``seen``,
    manifests to ``todo``."""
    data = refstore.store.get_blob(digest)
    kind = manifest_head(data, digest).kind
    if kind == "env":  # (its layers' manifests are each walked, read or set aside)
        todo.extend((layer.digest, via) for layer in EnvManifest.from_bytes(data, digest).layers)
    elif kind == "erofs":
        manifest = refstore.layer(digest)
        seen.update((manifest.meta.digest, manifest.chunk_table.digest))
        if manifest.tar_split is not None:
            seen.add(manifest.tar_split.digest)
        seen.update(refstore.chunk_table(manifest).packs())
    elif kind == "lsmt":
        disk = refstore.disk(digest)
        seen.add(disk.chunk_table.digest)
        seen.update(refstore.chunk_table(disk).packs())
        if disk.parent:
            todo.append((disk.parent, via))
    else:  # (manifest_head checked it against KINDS)
        raise IntegrityError(f"manifest {digest}", f"unknown kind {kind!r}")


def _entry(info: ObjectInfo, now: float, cutoff: float) -> dict:
    return {"size": info.size, "age_s": round(now - info.mtime, 1),
            "young": info.mtime >= cutoff}


def _still_old(store: Store, key: str, cutoff: float) -> bool:
    """Look again right before deleting: a push may have refreshed the blob since
    the listing (or another gc deleted it)."""
    info = store.head(key)
    return info is not None and info.mtime < cutoff


def collect(refstore: RefStore, dry_run: bool = True, grace: float = DEFAULT_GRACE) -> GcReport:
    cutoff = time.time() - grace  # taken before the refs are read
    expiry = expire_refs(refstore, time.time(), dry_run, grace)
    # (a dry run removed nothing: what would be reachable once it did)
    leave_out = {(e.kind, str(e)) for e in expiry.removed} if dry_run else set()
    found = reachable_blobs(refstore, leave_out) if leave_out else reachable_blobs(refstore)
    report = GcReport(unreadable=found.unreadable, expiry=expiry)
    now = time.time()
    leases, bad = read_leases(refstore.store)
    report.unreadable += bad  # (what such a lease holds is unknown: no sweep)
    keep_leased(refstore, leases, now, found, report)
    _forget_expired(refstore.store, leases, now, dry_run, report)
    live = found.blobs
    report.reachable = len(live)
    for info in refstore.store.list(BLOB_PREFIX):
        digest = "sha256:" + info.key[len(BLOB_PREFIX):]
        if digest in live:
            continue
        entry = {"digest": digest} | _entry(info, now, cutoff)
        report.unreachable.append(entry)
        if entry["young"]:
            report.kept_young += 1
        elif not dry_run and report.swept:
            if not _still_old(refstore.store, info.key, cutoff):
                entry["young"] = True
                report.kept_young += 1
                continue
            refstore.store.delete(info.key)
            report.deleted += 1
            report.deleted_bytes += info.size
    _collect_temporaries(refstore.store, report, dry_run, now, cutoff)
    return report


def _forget_expired(store: Store, leases: list[Lease], now: float, dry_run: bool,
                    report: GcReport) -> None:
    """Expired leases reported; those expired over ``LEASE_FORGET`` ago deleted."""
    for lease in leases:
        if lease.live(now):
            continue
        old = now - lease.expires > LEASE_FORGET
        if old and not dry_run:
            store.delete(lease_key(lease.node))
        report.expired_leases.append({"node": lease.node, "host": lease.host,
                                      "expired": lease.expires, "deleted": old and not dry_run})


def _collect_temporaries(store: Store, report: GcReport, dry_run: bool, now: float,
                         cutoff: float) -> None:
    """Temporary files of interrupted writes; a write in progress keeps its file young."""
    for info in store.list_temporaries():
        entry = {"key": info.key} | _entry(info, now, cutoff)
        report.temporaries.append(entry)
        if not entry["young"] and not dry_run:
            store.delete_temporary(info.key)
            report.deleted_temporaries += 1
            report.deleted_bytes += info.size
