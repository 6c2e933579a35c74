"""Many cold readers against raw parallel ranged GETs, per ``--store-fetches``.

The layer of bench/node.py (random data: large files of 64-256 MiB; the same
generated source and file:// store under its work dir, and the same source
built into a SeaweedFS S3 bucket on 127.0.0.1). The large files, one after
another, are cut into ``--readers`` equal slices (whole MiBs).

* **readers**: a ``layerfs daemon`` with ``--store-fetches N`` on a fresh,
  empty ROOT; one sandbox of the layer; page cache dropped; one thread per
  slice reads it with 1 MiB preads through the sandbox's rootfs, all at once;
  bytes read / time from the first read to the last one's end.
* **raw GETs** (the baseline): the chunk table's entries of the large files,
  cut into as many runs of consecutive entries (about the same bytes per
  reader), one thread each (each its own store client) doing one ranged GET
  per chunk, one after another; stored bytes / time.

``--latency-ms``: S3 through lazy_vs_prefetch.py's delaying proxy (both
sides), as over a network where requests in flight, not CPU, bound the rate.

Each rep runs the baseline and every N, the order reversed on odd reps;
ratios are medians over reps of readers / that rep's baseline. Needs root.

    python -m bench.store_fetches [--values 8,16,32,64,128] [--readers 64]
        [--stores file,s3] [--size 1G] [--reps 3] [--latency-ms 0] [--quick]

Prints a table and writes bench/results/store_fetches.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import RESULTS, WORK, git_head
from bench import node as nodebench
from bench.daemons import DaemonRuns, clear_dir, drop_caches, print_footer
from harness.daemonproc import detach_mounts
from layerfs.formats.chunktable import ChunkEntry
from layerfs.refstore import RefStore
from layerfs.sizes import parse_size
from layerfs.store.base import Store, blob_key
from layerfs.store.file import FileStore

MiB = 1 << 20
TARGET = 0.8  # readers / raw GETs at 64 readers


@dataclass(frozen=True)
class Segment:
    """Bytes ``[offset, offset + length)`` of one file of the layer."""

    path: str
    offset: int
    length: int


@dataclass(frozen=True)
class StoreSide:
    """One store the layer is in: how to open it, the daemon's options, the layer."""

    name: str
    open: Callable[[], Store]
    daemon_args: list[str]
    ref: str
    entries: list[ChunkEntry]


def slices(files: list[tuple[str, int]], readers: int) -> list[list[Segment]]:
    """The files, one after another, cut into ``readers`` slices of whole MiBs."""
    total = sum(size for _, size in files)
    each = max(MiB, total // readers // MiB * MiB)
    out: list[list[Segment]] = [[] for _ in range(readers)]
    reader, room = 0, each
    for path, size in files:
        pos = 0
        while pos < size and reader < readers:
            take = min(room, size - pos)
            out[reader].append(Segment(path, pos, take))
            pos += take
            room -= take
            if room == 0:
                reader, room = reader + 1, each
    return out


def read_slice(rootfs: Path, segments: list[Segment]) -> int:
    buf = bytearray(MiB)
    view = memoryview(buf)
    total = 0
    for seg in segments:
        fd = os.open(rootfs / seg.path, os.O_RDONLY)
        try:
            pos, end = seg.offset, seg.offset + seg.length
            while pos < end:
                n = os.preadv(fd, [view[:min(MiB, end - pos)]], pos)
                if n <= 0:
                    break
                pos += n
                total += n
        finally:
            os.close(fd)
    return total


def all_at_once(jobs: list[Callable[[], int]]) -> tuple[int, float]:
    """Run the jobs in a thread each, started together; (bytes, seconds)."""
    gate = threading.Barrier(len(jobs) + 1)

    def job(fn: Callable[[], int]) -> int:
        gate.wait()
        return fn()

    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(job, fn) for fn in jobs]
        gate.wait()
        start = time.perf_counter()
        total = sum(f.result() for f in futures)
    return total, time.perf_counter() - start


def get_entries(store_open: Callable[[], Store], entries: list[ChunkEntry]) -> Callable[[], int]:
    def run() -> int:
        store = store_open()
        try:
            return sum(len(store.get(blob_key(e.pack), e.pack_offset,
                                     e.pack_offset + e.stored_length)) for e in entries)
        finally:
            with contextlib.suppress(AttributeError):
                store.close()  # type: ignore[attr-defined]
    return run


def runs_of(entries: list[ChunkEntry], parts: int) -> list[list[ChunkEntry]]:
    """``entries`` cut into ``parts`` runs of consecutive entries of about equal bytes."""
    total = sum(e.stored_length for e in entries)
    out: list[list[ChunkEntry]] = [[]]
    done = 0
    for e in entries:
        if done >= total * len(out) / parts and len(out) < parts:
            out.append([])
        out[-1].append(e)
        done += e.stored_length
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, files: list[tuple[str, int]]):
        self.args = args
        self.work = work
        self.oddities: list[str] = []
        self.daemons = DaemonRuns(work, self.oddities, "16G", request_timeout=900,
                                  daemon_args=DaemonRuns.options(args))
        self.slices = slices(files, args.readers)
        self.cpu: dict[tuple[str, int], list[float]] = {}  # daemon CPU s per readers run

    def readers(self, side: StoreSide, fetches: int) -> tuple[int, float]:
        root = clear_dir(self.work / "roots" / "fetches", self.oddities)
        node = self.daemons.start(root, f"{side.name}-{fetches}",
                                  [*side.daemon_args, "--store-fetches", str(fetches)])
        try:
            rootfs = Path(node.request("up", id="r", layers=[side.ref])["sandbox"]["rootfs"])
            drop_caches()
            cpu0 = node.proc_status()["cpu_s"]
            result = all_at_once([lambda s=s: read_slice(rootfs, s) for s in self.slices])
            self.cpu.setdefault((side.name, fetches), []).append(
                round(node.proc_status()["cpu_s"] - cpu0, 2))
            node.request("down", id="r")
        finally:
            self.daemons.finish(node, remove_root=True)
        return result

    def raw(self, side: StoreSide, wanted: int) -> tuple[int, float]:
        chosen: list[ChunkEntry] = []
        for e in side.entries:
            if sum(c.length for c in chosen) >= wanted:
                break
            chosen.append(e)
        drop_caches()
        return all_at_once([get_entries(side.open, run)
                            for run in runs_of(chosen, self.args.readers)])

    def side(self, side: StoreSide) -> dict:
        wanted = sum(seg.length for s in self.slices for seg in s)
        raw: list[tuple[int, float]] = []
        lfs: dict[int, list[tuple[int, float]]] = {n: [] for n in self.args.values}
        for rep in range(self.args.reps):
            steps: list[Callable[[], None]] = [lambda: raw.append(self.raw(side, wanted))]
            steps += [lambda n=n: lfs[n].append(self.readers(side, n)) for n in self.args.values]
            for step in (steps if rep % 2 == 0 else steps[::-1]):
                step()
            print(f"  {side.name} rep {rep + 1}: raw GETs {nodebench.mbps(*raw[-1]):.0f} MB/s; "
                  + ", ".join(f"N={n} {nodebench.mbps(*lfs[n][-1]):.0f}" for n in lfs), flush=True)
        out: dict[str, Any] = {"raw_get_mb_s": [round(nodebench.mbps(*r), 1) for r in raw],
                               "bytes": raw[0][0], "values": {}}
        for n, samples in lfs.items():
            ratios = [nodebench.mbps(*s) / nodebench.mbps(*r)
                      for s, r in zip(samples, raw, strict=True)]
            out["values"][str(n)] = {
                "readers_mb_s": [round(nodebench.mbps(*s), 1) for s in samples],
                "bytes": samples[0][0], "ratio": round(statistics.median(ratios), 4),
                "daemon_cpu_s": self.cpu.get((side.name, n), []),
                "per_rep_ratio": [round(r, 4) for r in ratios]}
        return out


def large_entries(store: Store, digest: str, chunk_size: int = MiB) -> list[ChunkEntry]:
    """The chunk table's whole-size chunks (the large files'), by blob offset."""
    refstore = RefStore(store)
    table = refstore.chunk_table(refstore.layer(digest))
    return [e for e in table.entries if e.length == chunk_size]


@contextlib.contextmanager
def store_sides(names: list[str], work: Path, src: Path, layer: dict,
                latency_ms: float) -> Iterator[list[StoreSide]]:
    """The stores the layer is in; S3 reached through a delaying proxy if
    ``latency_ms`` (lazy_vs_prefetch.Throttle: no rate limit, that delay each way)."""
    sides = []
    file_dir = str(work / "store")
    if "file" in names:
        store = FileStore(file_dir)
        sides.append(StoreSide("file", lambda: FileStore(file_dir),
                               ["--store", f"file://{file_dir}"], layer["digest"],
                               large_entries(store, layer["digest"])))
    if "s3" not in names:
        yield sides
        return
    from bench import corpus
    from bench.lazy_vs_prefetch import Throttle, store_port
    from layerfs.store.s3 import S3Store

    with corpus.seaweedfs(work / "seaweedfs") as server, contextlib.ExitStack() as stack:
        store = S3Store(corpus.BUCKET, "node", endpoint=server.endpoint)
        digest, _ = nodebench.ensure_layer(store, src, f"bench/node-{layer['label'].lower()}",
                                           f"g{nodebench.GEN}-{nodebench.SEED}")
        endpoint = server.endpoint
        if latency_ms > 0:
            throttle = Throttle("proxy", 0.0, latency_ms)
            host, port = throttle.start(*store_port(server.endpoint))
            stack.callback(throttle.stop)
            endpoint = f"http://{host}:{port}"
        sides.append(StoreSide("s3", lambda: S3Store(corpus.BUCKET, "node", endpoint=endpoint),
                               ["--store", f"s3://{corpus.BUCKET}/node", "--s3-endpoint",
                                endpoint], digest, large_entries(store, digest)))
        store.close()
        yield sides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", default="8,16,32,64,128", help="--store-fetches values")
    ap.add_argument("--readers", type=int, default=64)
    ap.add_argument("--stores", default="file,s3")
    ap.add_argument("--size", default="1G", help="the layer (bench/node.py's of that size)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=0.0,
                    help="S3 through a proxy adding this one-way delay, each direction")
    ap.add_argument("--quick", action="store_true", help="a 200M layer, N=16,64, one rep")
    DaemonRuns.add_arguments(ap)
    ap.add_argument("--work", default=str(WORK / "node"))
    ap.add_argument("--out", default=str(RESULTS / "store_fetches.json"))
    args = ap.parse_args()
    if args.quick:
        args.size, args.values, args.reps = "200M", "16,64", 1
    args.values = [int(v) for v in args.values.split(",")]
    if os.geteuid() != 0:
        sys.exit("bench/store_fetches.py needs root (FUSE, EROFS and overlay mounts)")
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    detach_mounts(work / "roots")
    started = time.perf_counter()
    label = nodebench.label_of(args.size)
    src = work / "src" / f"data-{label.lower()}"
    info = nodebench.generate_data(src, parse_size(label))
    digest, _ = nodebench.ensure_layer(FileStore(str(work / "store")), src,
                                       f"bench/node-{label.lower()}",
                                       f"g{nodebench.GEN}-{nodebench.SEED}")
    layer = {"digest": digest, "label": label}
    files = [(p, (src / p).stat().st_size) for p in info["large_files"]]
    bench = Bench(args, work, files)
    result: dict[str, Any] = {}
    try:
        with store_sides(args.stores.split(","), work, src, layer, args.latency_ms) as sides:
            for side in sides:
                print(f"{args.readers} cold readers, {side.name} store, --store-fetches "
                      f"{args.values}", flush=True)
                result[side.name] = bench.side(side)
    finally:
        bench.daemons.stop_all()
        detach_mounts(work / "roots")
    out = {"commit": git_head(),
           "params": {"readers": args.readers, "values": args.values, "size": label,
                      "reps": args.reps, "miss_span": args.miss_span, "quick": args.quick,
                      "s3_latency_ms": args.latency_ms},
           "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
           "stores": result, "daemon_logs": bench.daemons.scan_logs(),
           "oddities": bench.oddities, "runtime_s": round(time.perf_counter() - started, 1),
           "method": __doc__.split("\n\n", 2)[1].replace("\n", " ")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n{args.readers} cold readers of a {label} layer: MB/s, ratio to raw ranged GETs")
    print(f"{'store':6} {'raw GETs':>9} " + " ".join(f"{'N=' + str(n):>14}" for n in args.values))
    for name, r in result.items():
        raw = statistics.median(r["raw_get_mb_s"])
        cells = [f"{statistics.median(v['readers_mb_s']):6.0f} ({v['ratio']:.2f})"
                 for v in r["values"].values()]
        print(f"{name:6} {raw:9.0f} " + " ".join(f"{c:>14}" for c in cells))
    print(f"target: >= {TARGET} at {args.readers} readers")
    print_footer(out["daemon_logs"], bench.oddities, f"{out['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
