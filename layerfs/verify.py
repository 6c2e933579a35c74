"""Check that every object of a layer is present and matches its digest, and
say per object what was found.

The objects of a layer are its meta image (erofs layers), its chunk table and
each pack its chunks lie in. Each is one of :class:`Found`: ``ok``,
``missing``, ``unavailable`` (the store answers but cannot serve it),
``unreachable`` (the store did not answer), ``denied``, ``corrupt`` (a digest
mismatch, a malformed object), or ``error`` (another store error). A pack is
as bad as its worst chunk. ``verify`` exits as the worst object found
(:data:`WORST_FIRST`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .chunks import fetch_run, pack_runs
from .errors import (
    AccessDenied,
    IntegrityError,
    LayerfsError,
    ObjectNotFound,
    ObjectUnavailable,
    StoreError,
    StoreUnreachable,
)
from .formats.chunktable import ChunkEntry
from .manifest import LayerManifest
from .refstore import RefStore


class Found(enum.Enum):
    OK = "ok"
    MISSING = "missing"
    UNAVAILABLE = "unavailable"
    UNREACHABLE = "unreachable"
    DENIED = "denied"
    CORRUPT = "corrupt"
    ERROR = "error"


# worst first: what is lost for sure, then what cannot be served, then what could not be asked
WORST_FIRST = (Found.CORRUPT, Found.MISSING, Found.UNAVAILABLE, Found.DENIED,
               Found.UNREACHABLE, Found.ERROR, Found.OK)
EXIT_CODES = {Found.CORRUPT: IntegrityError.exit_code, Found.MISSING: ObjectNotFound.exit_code,
              Found.UNAVAILABLE: ObjectUnavailable.exit_code,
              Found.DENIED: AccessDenied.exit_code,
              Found.UNREACHABLE: StoreUnreachable.exit_code, Found.ERROR: StoreError.exit_code,
              Found.OK: 0}  # fmt: skip


def found_of(exc: LayerfsError) -> Found:
    """What an error met reading an object says about it."""
    kinds: tuple[tuple[type[LayerfsError], Found], ...] = (
        (IntegrityError, Found.CORRUPT), (ObjectNotFound, Found.MISSING),
        (ObjectUnavailable, Found.UNAVAILABLE), (StoreUnreachable, Found.UNREACHABLE),
        (AccessDenied, Found.DENIED))
    return next((found for cls, found in kinds if isinstance(exc, cls)), Found.ERROR)


def worst(founds: list[Found]) -> Found:
    return min(founds, key=WORST_FIRST.index, default=Found.OK)


@dataclass
class ObjectCheck:
    """One object of a layer and what reading it back found."""

    what: str  # "meta image", "chunk table", "pack"
    digest: str
    found: Found = Found.OK
    chunks: int = 0  # of a pack: its chunks this layer uses
    bad_chunks: int = 0
    detail: str = ""  # the first problem's message

    def note(self, exc: LayerfsError | None, chunks: int = 1) -> None:
        """Count ``chunks`` read back; ``exc`` is what they failed with, if anything."""
        self.chunks += chunks
        if exc is None:
            return
        self.bad_chunks += chunks
        self.found = worst([self.found, found_of(exc)])
        self.detail = self.detail or str(exc)


@dataclass
class VerifyReport:
    ref: str
    chunks: int = 0
    bytes: int = 0
    objects: list[ObjectCheck] = field(default_factory=list)

    @property
    def found(self) -> Found:
        return worst([o.found for o in self.objects])

    @property
    def ok(self) -> bool:
        return self.found is Found.OK

    @property
    def problems(self) -> list[str]:
        return [o.detail for o in self.objects if o.found is not Found.OK]


def _check_object(report: VerifyReport, what: str, digest: str,
                  read: Callable[[], object]) -> bool:
    """Read one whole object (``read()``), noting what was found; True if ok."""
    check = ObjectCheck(what, digest)
    report.objects.append(check)
    try:
        read()
    except LayerfsError as exc:
        check.note(exc)
        return False
    check.note(None)
    return True


def verify_layer(refstore: RefStore, digest: str, workers: int = 8) -> VerifyReport:
    """Read back the meta image, the chunk table and every chunk (a run of
    neighbouring chunks per range read); one :class:`ObjectCheck` per object."""
    manifest = refstore.any_layer(digest)
    report = VerifyReport(f"{manifest.name}@{manifest.version}")
    if isinstance(manifest, LayerManifest):
        _check_object(report, "meta image", manifest.meta.digest,
                      lambda: refstore.meta_image(manifest))
        split = manifest.tar_split
        if split is not None:
            _check_object(report, "tar-split record", split.digest,
                          lambda: refstore.store.get_blob(split.digest))
    tables = []
    if not _check_object(report, "chunk table", manifest.chunk_table.digest,
                         lambda: tables.append(refstore.chunk_table(manifest))):
        return report

    def check(run: list[ChunkEntry]) -> list[tuple[ChunkEntry, LayerfsError | None]]:
        try:
            results = fetch_run(refstore.store, run)
        except LayerfsError as exc:  # the read itself failed: every chunk of the run
            return [(entry, exc) for entry in run]
        return [(entry, r if isinstance(r, LayerfsError) else None)
                for entry, r in zip(run, results, strict=True)]

    packs: dict[str, ObjectCheck] = {}
    with ThreadPoolExecutor(workers) as pool:
        for checked in pool.map(check, pack_runs(tables[0].entries)):
            for entry, problem in checked:
                pack = packs.setdefault(entry.pack, ObjectCheck("pack", entry.pack))
                pack.note(problem)
                report.chunks += 1
                report.bytes += entry.length
    report.objects += sorted(packs.values(), key=lambda o: o.digest)
    return report
