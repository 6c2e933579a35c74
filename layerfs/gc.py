"""Garbage collection: delete blobs that no ref reaches, and leftovers of
interrupted writes.

Reachable: every ref's manifest; a layer manifest's meta image, chunk table and
the packs its chunk table names; an env manifest's layer manifests (and theirs).
An unreachable blob is deleted only if it was last written or refreshed more
than the grace period before this run started, and only after a fresh look at
its age right before the delete: a push refreshes every blob it reuses before it
writes its ref (see docs/builder.md, "gc and concurrent pushes"). Temporary
files of the file store (``.tmp~*``, left by a killed writer) older than the
grace period are deleted too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .errors import LayerfsError
from .manifest import manifest_kind
from .registry import ENVS, LAYERS, Registry
from .store.base import BLOB_PREFIX, ObjectInfo, Store

DEFAULT_GRACE = 3600.0


@dataclass
class GcReport:
    reachable: int = 0
    unreachable: list[dict] = field(default_factory=list)
    deleted: int = 0
    deleted_bytes: int = 0
    kept_young: int = 0
    temporaries: list[dict] = field(default_factory=list)  # leftovers of interrupted writes
    deleted_temporaries: int = 0


def reachable_blobs(reg: Registry) -> set[str]:
    seen: set[str] = set()
    todo = [r.digest for r in reg.list_refs(LAYERS) + reg.list_refs(ENVS)]
    while todo:
        digest = todo.pop()
        if digest in seen:
            continue
        seen.add(digest)
        kind = manifest_kind(reg.store.get_blob(digest))
        if kind == "env":
            todo.extend(layer.digest for layer in reg.env(digest).layers)
        elif kind == "erofs":
            manifest = reg.layer(digest)
            seen.update((manifest.meta.digest, manifest.chunk_table.digest))
            if manifest.tar_split is not None:
                seen.add(manifest.tar_split.digest)
            seen.update(reg.chunk_table(manifest).packs())
        elif kind == "lsmt":
            disk = reg.disk(digest)
            seen.add(disk.chunk_table.digest)
            seen.update(reg.chunk_table(disk).packs())
            if disk.parent:
                todo.append(disk.parent)
        else:
            raise LayerfsError(f"manifest {digest} has unknown kind {kind!r}; gc stopped")
    return seen


def _entry(info: ObjectInfo, now: float, cutoff: float) -> dict:
    return {"size": info.size, "age_s": round(now - info.mtime, 1),
            "young": info.mtime >= cutoff}


def _still_old(store: Store, key: str, cutoff: float) -> bool:
    """Look again right before deleting: a push may have refreshed the blob since
    the listing (or another gc deleted it)."""
    info = store.head(key)
    return info is not None and info.mtime < cutoff


def collect(reg: Registry, dry_run: bool = True, grace: float = DEFAULT_GRACE) -> GcReport:
    cutoff = time.time() - grace  # taken before the refs are read
    live = reachable_blobs(reg)
    report = GcReport(reachable=len(live))
    now = time.time()
    for info in reg.store.list(BLOB_PREFIX):
        digest = "sha256:" + info.key[len(BLOB_PREFIX):]
        if digest in live:
            continue
        entry = {"digest": digest} | _entry(info, now, cutoff)
        report.unreachable.append(entry)
        if entry["young"]:
            report.kept_young += 1
        elif not dry_run:
            if not _still_old(reg.store, info.key, cutoff):
                entry["young"] = True
                report.kept_young += 1
                continue
            reg.store.delete(info.key)
            report.deleted += 1
            report.deleted_bytes += info.size
    _collect_temporaries(reg.store, report, dry_run, now, cutoff)
    return report


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
