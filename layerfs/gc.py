"""Garbage collection: delete blobs that no ref reaches.

Reachable: every ref's manifest; a layer manifest's meta image, chunk table and
the packs its chunk table names; an env manifest's layer manifests (and theirs).
Blobs younger than the grace period are kept even when unreachable, since a
push in progress uploads its packs before it writes its ref.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .errors import LayerfsError
from .manifest import manifest_kind
from .registry import ENVS, LAYERS, Registry
from .store.base import BLOB_PREFIX

DEFAULT_GRACE = 3600.0


@dataclass
class GcReport:
    reachable: int = 0
    unreachable: list[dict] = field(default_factory=list)
    deleted: int = 0
    deleted_bytes: int = 0
    kept_young: int = 0


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


def collect(reg: Registry, dry_run: bool = True, grace: float = DEFAULT_GRACE) -> GcReport:
    live = reachable_blobs(reg)
    report = GcReport(reachable=len(live))
    now = time.time()
    for info in reg.store.list(BLOB_PREFIX):
        digest = "sha256:" + info.key[len(BLOB_PREFIX):]
        if digest in live:
            continue
        young = now - info.mtime < grace
        report.unreachable.append({"digest": digest, "size": info.size,
                                   "age_s": round(now - info.mtime, 1), "young": young})
        if young:
            report.kept_young += 1
        elif not dry_run:
            reg.store.delete(info.key)
            report.deleted += 1
            report.deleted_bytes += info.size
    return report
