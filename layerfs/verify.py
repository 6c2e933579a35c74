"""Check that every object of a layer is present and matches its digest."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .chunks import fetch_run, pack_runs
from .errors import LayerfsError
from .formats.chunktable import ChunkEntry
from .manifest import LayerManifest
from .registry import Registry


@dataclass
class VerifyReport:
    ref: str
    chunks: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_layer(reg: Registry, digest: str, workers: int = 8) -> VerifyReport:
    """Read back the meta image, the chunk table and every chunk (a run of
    neighbouring chunks per range read); each problem is one line."""
    manifest = reg.any_layer(digest)
    report = VerifyReport(f"{manifest.name}@{manifest.version}")
    try:
        if isinstance(manifest, LayerManifest):
            reg.meta_image(manifest)
        table = reg.chunk_table(manifest)
    except LayerfsError as exc:
        report.problems.append(str(exc))
        return report

    def check(run: list[ChunkEntry]) -> list[tuple[ChunkEntry, str | None]]:
        try:
            results = fetch_run(reg.store, run)
        except LayerfsError as exc:  # the read itself failed: every chunk of the run
            return [(entry, str(exc)) for entry in run]
        return [(entry, str(r) if isinstance(r, LayerfsError) else None)
                for entry, r in zip(run, results, strict=True)]

    with ThreadPoolExecutor(workers) as pool:
        for checked in pool.map(check, pack_runs(table.entries)):
            for entry, problem in checked:
                report.chunks += 1
                report.bytes += entry.length
                if problem:
                    report.problems.append(problem)
    return report
