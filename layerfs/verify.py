"""Check that every object of a layer is present and matches its digest."""

from __future__ import annotations

from dataclasses import dataclass, field

from .chunks import fetch_chunk
from .errors import LayerfsError
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
    from concurrent.futures import ThreadPoolExecutor

    manifest = reg.any_layer(digest)
    report = VerifyReport(f"{manifest.name}@{manifest.version}")
    try:
        if isinstance(manifest, LayerManifest):
            reg.meta_image(manifest)
        table = reg.chunk_table(manifest)
    except LayerfsError as exc:
        report.problems.append(str(exc))
        return report

    def check(entry):
        try:
            fetch_chunk(reg.store, entry)
            return None
        except LayerfsError as exc:
            return str(exc)

    with ThreadPoolExecutor(workers) as pool:
        for entry, problem in zip(table.entries, pool.map(check, table.entries), strict=True):
            report.chunks += 1
            report.bytes += entry.length
            if problem:
                report.problems.append(problem)
    return report
