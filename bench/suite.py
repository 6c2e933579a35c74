"""Wall time of test files run one after another versus on pytest-xdist workers.

Runs the given test files (default: a few that use both store backends) with
plain ``pytest`` and with ``pytest -n WORKERS --dist loadfile`` (what ``make
test`` does), alternating the two sides, REPS times each; prints the medians
and their ratio and writes bench/results/suite-<commit>.json. Other jobs on
the machine slow both sides alike, since they alternate.

    python -m bench.suite [--reps 3] [--workers 2] [tests/test_x.py ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from bench import RESULTS, ROOT, git_head

DEFAULT_FILES = ["tests/test_store.py", "tests/test_builder.py", "tests/test_tar.py",
                 "tests/test_protocol.py"]


def run_once(files: list[str], workers: int) -> float:
    """Seconds one pytest run of ``files`` takes (0 workers: no xdist)."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    if workers:
        argv[4:4] = ["-n", str(workers), "--dist", "loadfile"]
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"pytest failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("files", nargs="*", default=DEFAULT_FILES)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"serial": [], "xdist": []}
    for rep in range(args.reps):
        for side, workers in (("serial", 0), ("xdist", args.workers)):
            times[side].append(round(run_once(args.files, workers), 1))
            print(f"rep {rep + 1} {side:6} {times[side][-1]:7.1f} s", flush=True)
    medians = {side: statistics.median(t) for side, t in times.items()}
    ratio = medians["serial"] / medians["xdist"]
    print("\n| side | median s | runs |\n|---|---|---|")
    for side, t in times.items():
        print(f"| {side} | {medians[side]:.1f} | {' '.join(map(str, t))} |")
    print(f"\nserial / xdist (-n {args.workers}): {ratio:.2f}x")
    out = RESULTS / f"suite-{git_head()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"commit": git_head(), "files": args.files, "workers": args.workers,
                               "seconds": times, "medians": medians,
                               "ratio": round(ratio, 2)}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
