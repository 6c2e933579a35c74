"""The node's steady read path, old code against new: bench/node.py's warm
(cached) and cold (uncached, file:// store) sequential reads through a
sandbox, run alternately with the fetcher modules of an older commit and of
the work tree.

Each round runs ``bench/node.py --only warm,cold`` once with each code, the
order reversed on odd rounds; then ``--micro-rounds`` rounds of the same
alternation in-process (``--micro-one``, a process per run: ``ChunkFetcher.get``
of 300 chunks of 64 KiB from an in-memory store, then three times from the
cache with no memory LRU; µs per get, wall and CPU of all the process's
threads, the median of three runs), the CPU side
of the same path without the page cache and FUSE. The old code is ``git show OLD:<module>`` of
each of ``--modules``, copied into place for its runs (the daemons are new
processes each run, so they import what is in place) and the work tree's
files put back after every run, also when the run fails. Reports, per code,
the median over rounds of each run's median MB/s and daemon CPU seconds, and
new/old ratios. Needs root (as bench/node.py).

    python -m bench.read_path_ab [--old 3063ee8] [--rounds 3]
        [--node-args "--quick --read-size 200M --reps 3"] [--micro-rounds 7]

Prints a table and writes bench/results/read_path-<commit>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import RESULTS, ROOT, WORK, git_head

MODULES = "layerfs/node/reads/fetcher.py,layerfs/node/reads/failfast.py"


def node_run(node_args: list[str], out: Path) -> dict[str, Any]:
    """One bench/node.py run of the warm and cold reads; its result JSON."""
    subprocess.run([sys.executable, "-m", "bench.node", "--only", "warm,cold",
                    "--out", str(out), *node_args], cwd=ROOT, check=True)
    return json.loads(out.read_text())


def numbers(result: dict[str, Any]) -> dict[str, float]:
    warm, cold = result["warm_read"], result["cold_read"]
    return {"warm_mb_s": warm["layerfs_p50_mb_s"],
            "warm_daemon_cpu_s": statistics.median(warm["daemon_cpu_s"]),
            "cold_mb_s": cold["layerfs_p50_mb_s"],
            "cold_daemon_cpu_s": statistics.median(cold["daemon_cpu_s"])}


def micro_one() -> dict[str, float]:
    """This process's fetcher: µs per ``get`` from the store, then from the cache."""
    import trio

    from layerfs.formats.chunktable import RAW, ChunkEntry
    from layerfs.node.reads.chunkcache import ChunkCache
    from layerfs.node.reads.fetcher import ChunkFetcher

    size, count = 64 << 10, 300
    chunks = [os.urandom(size) for _ in range(count)]
    pack = b"".join(chunks)
    entries = [ChunkEntry(i * size, size, hashlib.sha256(c).digest(), "sha256:" + "a" * 64,
                          i * size, size, RAW) for i, c in enumerate(chunks)]

    class MemoryStore:
        def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
            return pack[start:end]

        def head(self, key: str) -> None:
            return None

    def one(cache_dir: str) -> dict[str, float]:
        fetcher = ChunkFetcher(MemoryStore(), ChunkCache(cache_dir, 1 << 30),  # type: ignore[arg-type]
                               timeout=30.0, memory=0)
        out: dict[str, float] = {}

        async def run() -> None:
            start, cpu = time.perf_counter(), time.process_time()
            for entry in entries:
                await fetcher.get(entry)
            await fetcher.writes_done()
            out["store_get_us"] = (time.perf_counter() - start) / count * 1e6
            out["store_get_cpu_us"] = (time.process_time() - cpu) / count * 1e6
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(3):
                for entry in entries:
                    await fetcher.get(entry)
            out["cached_get_us"] = (time.perf_counter() - start) / (3 * count) * 1e6
            out["cached_get_cpu_us"] = (time.process_time() - cpu) / (3 * count) * 1e6

        trio.run(run)
        return out

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        runs = [one(os.path.join(tmp, str(n))) for n in range(3)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def micro_run() -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-m", "bench.read_path_ab", "--micro-one"], cwd=ROOT,
                          check=True,
                          capture_output=True, text=True)
    return json.loads(proc.stdout)


def alternate(rounds: int, modules: list[Path], old: dict[Path, bytes],
              new: dict[Path, bytes], measure: Any) -> dict[str, list[dict[str, float]]]:
    """``measure()`` with each code per round, the order reversed on odd rounds;
    the work tree's files back in place after every run."""
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for rnd in range(rounds):
        for code in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
            for m in modules:
                m.write_bytes(old[m] if code == "old" else new[m])
            try:
                print(f"round {rnd + 1}, {code} code", flush=True)
                runs[code].append(measure(rnd, code))
            finally:
                for m in modules:
                    m.write_bytes(new[m])
            print(f"  {runs[code][-1]}", flush=True)
    return runs


def summary(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    keys = list(runs["new"][0])
    medians = {code: {k: round(statistics.median(r[k] for r in runs[code]), 2) for k in keys}
               for code in runs}
    ratios = {k: round(medians["new"][k] / medians["old"][k], 3) for k in keys}
    print(f"{'':22} {'old':>9} {'new':>9} {'new/old':>8}")
    for k in keys:
        print(f"{k:22} {medians['old'][k]:9.2f} {medians['new'][k]:9.2f} {ratios[k]:8.3f}")
    return {"runs": runs, "medians": medians, "ratios": ratios}


def main() -> None:
    if sys.argv[1:] == ["--micro-one"]:
        print(json.dumps(micro_one()))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="3063ee8", help="the commit of the old code")
    ap.add_argument("--modules", default=MODULES, help="the files swapped, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--node-args", default="--quick --read-size 200M --reps 3",
                    help="bench/node.py options of every run")
    ap.add_argument("--micro-rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    head = git_head()
    modules = [ROOT / m for m in args.modules.split(",")]
    new = {m: m.read_bytes() for m in modules}
    old = {m: subprocess.run(["git", "-C", str(ROOT), "show",
                              f"{args.old}:{m.relative_to(ROOT)}"],
                             capture_output=True, check=True).stdout for m in modules}
    started = time.perf_counter()
    work = WORK / "read_path_ab"
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"commit": head, "old": args.old, "modules": args.modules}
    try:
        if args.rounds:
            result["node"] = summary(alternate(
                args.rounds, modules, old, new,
                lambda rnd, code: numbers(node_run(shlex.split(args.node_args),
                                                   work / f"{code}-{rnd}.json"))))
            result["node"].update(rounds=args.rounds, node_args=args.node_args)
        if args.micro_rounds:
            result["micro"] = summary(alternate(args.micro_rounds, modules, old, new,
                                                lambda rnd, code: micro_run()))
            result["micro"]["rounds"] = args.micro_rounds
    finally:
        for m in modules:
            m.write_bytes(new[m])
    result["runtime_s"] = round(time.perf_counter() - started, 1)
    result["method"] = ("alternating old and new fetcher modules per round (order reversed on "
                        "odd rounds); node: bench/node.py --only warm,cold, medians over rounds "
                        "of each run's median; micro: in-process ChunkFetcher.get, µs per get")
    out = Path(args.out or RESULTS / f"read_path-{head.split('+')[0]}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
