"""The order the test files are handed to pytest-xdist workers: longest first.

Under ``--dist loadfile`` a worker runs one file at a time, in the order the
files come; a long file handed out last keeps one worker busy while the others
have nothing left (the cluster and guest tests, a minute or two each, come
last in xdist's own order: by number of tests). So the conftest orders the
files by their seconds in the last full run, which it keeps in pytest's cache
(``.pytest_cache``, key :data:`CACHE_KEY`); a file with no record yet counts
the average seconds of a test per test; with no record at all the order is
xdist's (the most tests first). Only the order changes: every test runs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import pytest

CACHE_KEY = "layerfs/module-seconds"


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def recorded(config: pytest.Config) -> dict[str, float]:
    """The seconds per test file of the last full run ({} without the cache)."""
    cache = getattr(config, "cache", None)
    found = cache.get(CACHE_KEY, {}) if cache is not None else {}
    return {str(k): float(v) for k, v in found.items()} if isinstance(found, dict) else {}


def longest_first(items: list[pytest.Item], seconds: dict[str, float]) -> list[pytest.Item]:
    """``items`` with their files in order of expected seconds, most first; the
    tests of a file keep their order."""
    by_module: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_module[module_of(item.nodeid)].append(item)
    known = [(seconds[m], len(tests)) for m, tests in by_module.items() if m in seconds]
    per_test = sum(s for s, _ in known) / max(1, sum(n for _, n in known)) if known else 1.0

    def expected(module: str) -> float:
        return seconds.get(module, per_test * len(by_module[module]))

    order = sorted(by_module, key=lambda m: -expected(m))  # stable: ties keep their order
    return [item for module in order for item in by_module[module]]


def merged(old: dict[str, float], reports: Iterable[tuple[str, float]]) -> dict[str, float]:
    """``old`` with the files of ``reports`` (nodeid, seconds of a phase) replaced
    by their sums in this run."""
    ran: dict[str, float] = defaultdict(float)
    for nodeid, duration in reports:
        ran[module_of(nodeid)] += duration
    return {**old, **{m: round(s, 2) for m, s in ran.items()}}
