"""What the file store's write watchdog costs: puts through ``FileStore.put``
(each write in a watchdog thread, bounded by the store's timeout) against the
same writes made directly (``FileStore._put_now``, no thread), in one run, on
the same directory.

Each rep writes ``--count`` objects of ``--size`` bytes with each side,
alternating which side goes first; medians of ``--reps`` reps.

    python -m bench.store_writes [--count 500] [--size 65536] [--reps 5] [--dir /tmp/...]

Prints a table and writes bench/results/store_writes.json (with the commit).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import RESULTS, git_head
from layerfs.store.file import FileStore


def timed(put: Callable[[str, bytes], None], count: int, data: bytes, tag: str) -> float:
    start = time.perf_counter()
    for i in range(count):
        put(f"blobs/bench/{tag}/{i:06d}", data)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--size", type=int, default=65536)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the store goes (a temporary dir)")
    parser.add_argument("--out", default=str(RESULTS / "store_writes.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="store-writes-", dir=args.dir))
    store = FileStore(work / "store")
    data = os.urandom(args.size)
    sides: dict[str, Callable[[str, bytes], None]] = {
        "direct": store._put_now, "watchdog": store.put}
    times: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for rep in range(args.reps):
            order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
            for name in order:
                times[name].append(timed(sides[name], args.count, data, f"{name}{rep}"))
            shutil.rmtree(work / "store" / "blobs", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    per_put = {name: m / args.count * 1e6 for name, m in medians.items()}
    ratio = medians["watchdog"] / medians["direct"]
    print(f"{'side':10} {'median s':>9} {'us per put':>11}")
    for name in sides:
        print(f"{name:10} {medians[name]:9.3f} {per_put[name]:11.1f}")
    print(f"watchdog / direct: {ratio:.3f} ({args.count} puts of {args.size} B, "
          f"{args.reps} reps)")
    result = {"commit": git_head(), "count": args.count, "size": args.size, "reps": args.reps,
              "seconds": times, "median_seconds": medians, "us_per_put": per_put,
              "ratio_watchdog_to_direct": ratio}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
