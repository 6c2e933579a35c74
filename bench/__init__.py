"""The benchmarks: each module is a script run from the project root as
``python -m bench.NAME [--help]`` (with the dev extras installed: ``make deps``).

Shared helpers live here too: :mod:`bench.daemons` (the daemons a benchmark
runs, their logs, the page cache, the commit measured). The servers the
benchmarks start (SeaweedFS, a registry, OCI images) come from
:mod:`harness`, which the tests use as well. Results go to ``bench/results``
(JSON, with the commit), scratch data to ``bench/work``; docs/dev/benchmarks.md
holds every benchmark's latest run.
"""

import os
import subprocess
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent  # the project's checkout
RESULTS = BENCH / "results"
WORK = BENCH / "work"


def git_head() -> str:
    """The commit the tree is at, with ``+changes`` if files differ from it
    (``BENCH_COMMIT`` where the tree is not a git checkout: a bundle's run)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty.strip() else "")
