"""Live restart benchmarks: the read stall of a daemon switch, and what
keeping the FUSE connection costs in steady state.

A layer of ``--files`` random files of ``--file-size`` each (chunk size
1 MiB, a ``file://`` store under the work directory) is brought up as a
sandbox. Then:

1. **Switch.** One reader thread per file streams it (1 MiB ``pread``s, the
   page cache dropped for the file before each pass) while the daemon is
   switched: ``kill -9`` and a new daemon on the same ROOT, or a new daemon
   with ``--takeover``, alternating, ``--reps`` times each. Reported: the
   p50/p99/max latency of the reads issued between the start of the switch
   and the moment the new daemon answers a ping (the time until it serves),
   or in flight at some moment of it,
   against the same for the reads done in the second before the switch, and every
   read that failed (there must be none).
2. **Steady state.** Warm (chunk cache filled) and cold (fresh ROOT) sequential
   reads of every file through a sandbox, by a daemon with live restart (the
   default) and one with ``--no-live-restart`` (libfuse mounts FUSE itself, no
   keeper), alternating, ``--reps`` times; medians and their ratio.

Needs root. ``python -m bench.restart [--files 8] [--file-size 64M] [--reps 3]``;
prints a table and writes bench/results/restart.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from bench import RESULTS, git_head
from bench.daemons import DaemonRuns, clear_dir, drop_caches, print_footer
from harness.daemonproc import DaemonProcess
from layerfs.builder.env import create_env
from layerfs.builder.layer import BuildOptions, build_layer
from layerfs.node.control import wait_ready
from layerfs.refstore import RefStore
from layerfs.sizes import parse_size
from layerfs.store.file import FileStore

MiB = 1 << 20
OUT = RESULTS / "restart.json"


class Readers:
    """Threads streaming files, each read's (start, latency, error) recorded."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.stop = threading.Event()
        self.reads: list[tuple[float, float, str | None]] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._stream, args=(p,)) for p in paths]

    def _stream(self, path: Path) -> None:
        while not self.stop.is_set():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                off = 0
                while not self.stop.is_set():
                    t0 = time.monotonic()
                    try:
                        n = len(os.pread(fd, MiB, off))
                        error = None
                    except OSError as exc:
                        n, error = 0, str(exc)
                    with self.lock:
                        self.reads.append((t0, time.monotonic() - t0, error))
                    if n == 0:
                        break
                    off += n
            finally:
                os.close(fd)

    def __enter__(self) -> Readers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def between(self, start: float, end: float) -> list[tuple[float, float, str | None]]:
        """The reads in flight at some moment from ``start`` to ``end``."""
        with self.lock:
            return [r for r in self.reads if r[0] <= end and r[0] + r[1] >= start]


def quantiles(latencies: list[float]) -> dict:
    ordered = sorted(latencies)
    if not ordered:
        return {"reads": 0}
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"reads": len(ordered), "p50_ms": round(pick(0.5) * 1000, 2),
            "p99_ms": round(pick(0.99) * 1000, 2), "max_ms": round(ordered[-1] * 1000, 2)}


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.store_url = "file://" + str(work / "store")
        self.oddities: list[str] = []
        self.daemons = DaemonRuns(work, self.oddities, "4G")

    def layer(self) -> list[str]:
        """Build the layer once (reused while its marker matches)."""
        src = self.work / "src"
        key = f"{self.args.files}x{self.args.file_size}"
        marker = self.work / "marker"
        if not marker.exists() or marker.read_text() != key:
            clear_dir(src, self.oddities)
            clear_dir(self.work / "store", self.oddities)
            (src / "data").mkdir(parents=True)
            for i in range(self.args.files):
                with open(src / "data" / f"f{i}", "wb") as f:
                    for _ in range(parse_size(self.args.file_size) // MiB):
                        f.write(os.urandom(MiB))
            store = FileStore(str(self.work / "store"))
            build_layer(RefStore(store), str(src), BuildOptions("big", "1", chunk_size=MiB))
            create_env(RefStore(store), "e", "1", ["big@1"])
            marker.write_text(key)
        return [f"data/f{i}" for i in range(self.args.files)]

    def node(self, tag: str, *extra: str) -> DaemonProcess:
        root = clear_dir(self.work / "roots" / tag, self.oddities)
        self.daemons.daemon_args = list(extra)
        return self.daemons.start(root, tag, ["--store", self.store_url])

    def switch(self, files: list[str], how: str) -> dict:
        node = self.node(how)
        try:
            rootfs = Path(node.request("up", id="s", env="e@1")["sandbox"]["rootfs"])
            with Readers([rootfs / f for f in files]) as readers:
                time.sleep(1.0)
                t0 = time.monotonic()
                old = node.proc
                assert old is not None
                if how == "kill":
                    node.kill()
                else:
                    node.extra_args = ["--takeover"]
                node.proc = None
                node.start(timeout=120)
                if how == "takeover":
                    old.wait(120)
                proc = node.proc
                assert proc is not None
                wait_ready(node.root, lambda: proc.poll() is None, 120)
                served = time.monotonic()
                time.sleep(1.0)
            during = readers.between(t0, served)
            before = [r for r in readers.reads if t0 - 1.0 <= r[0] and r[0] + r[1] < t0]
            failed = [r for r in readers.reads if r[2] is not None]
            node.extra_args = []
            node.request("down", id="s")
        finally:
            self.daemons.finish(node, remove_root=True)
        return {"serves_after_s": round(served - t0, 3),
                "during": quantiles([r[1] for r in during]),
                "before": quantiles([r[1] for r in before]),
                "failed_reads": len(failed), "first_failure": failed[0][2] if failed else None}

    def read_all(self, rootfs: Path, files: list[str]) -> float:
        drop_caches()
        t0 = time.monotonic()
        total = 0
        for f in files:
            with open(rootfs / f, "rb", buffering=0) as fh:
                while chunk := fh.read(MiB):
                    total += len(chunk)
        return total / MiB / (time.monotonic() - t0)

    def steady(self, files: list[str], live: bool) -> tuple[float, float]:
        """Cold then warm read throughput (MB/s) of every file, on a fresh ROOT."""
        node = self.node("live" if live else "nolive", *([] if live else ["--no-live-restart"]))
        try:
            rootfs = Path(node.request("up", id="s", env="e@1")["sandbox"]["rootfs"])
            cold = self.read_all(rootfs, files)
            warm = self.read_all(rootfs, files)
            node.request("down", id="s")
        finally:
            self.daemons.finish(node, remove_root=True)
        return cold, warm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--file-size", default="64M")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", default="bench/work/restart")
    ap.add_argument("--steady-only", action="store_true",
                    help="only the steady-state reads (no kill or takeover)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/restart.py needs root")
    started = time.monotonic()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    bench = Bench(args, work)
    files = bench.layer()
    switches: dict[str, list[dict]] = {"kill": [], "takeover": []}
    steady: dict[str, list[tuple[float, float]]] = {"live": [], "nolive": []}
    try:
        for rep in range(args.reps):
            for how in (() if args.steady_only else
                        ("kill", "takeover") if rep % 2 == 0 else ("takeover", "kill")):
                switches[how].append(bench.switch(files, how))
                print(f"  {how}: {json.dumps(switches[how][-1])}", flush=True)
            for live in ((True, False) if rep % 2 == 0 else (False, True)):
                steady["live" if live else "nolive"].append(bench.steady(files, live))
                print(f"  steady live={live}: cold/warm MB/s "
                      f"{steady['live' if live else 'nolive'][-1]}", flush=True)
    finally:
        bench.daemons.stop_all()
    result = report(args, switches, steady)
    result["logs"] = bench.daemons.scan_logs()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = OUT.with_name("restart-steady.json") if args.steady_only else OUT
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_footer(result["logs"], bench.oddities, f"{time.monotonic() - started:.0f} s")


def median_of(rows: list[dict], *path: str) -> float:
    values = []
    for row in rows:
        for key in path:
            row = row[key]
        values.append(row)
    return statistics.median(values)


def report(args: argparse.Namespace, switches: dict, steady: dict) -> dict:
    print(f"\n{args.files} readers, {args.file_size} files, {args.reps} reps (medians)")
    print("| switch | serves after | reads during | p50 | p99 | max | before: p50 / p99 "
          "| failed reads |")
    print("|---|---|---|---|---|---|---|---|")
    out: dict = {"commit": git_head(), "files": args.files, "file_size": args.file_size,
                 "reps": args.reps, "switches": switches, "steady": {}}
    for how, rows in switches.items():
        if not rows:
            continue
        print(f"| {how} | {median_of(rows, 'serves_after_s'):.2f} s "
              f"| {median_of(rows, 'during', 'reads'):.0f} "
              f"| {median_of(rows, 'during', 'p50_ms'):.0f} ms "
              f"| {median_of(rows, 'during', 'p99_ms'):.0f} ms "
              f"| {median_of(rows, 'during', 'max_ms'):.0f} ms "
              f"| {median_of(rows, 'before', 'p50_ms'):.1f} / "
              f"{median_of(rows, 'before', 'p99_ms'):.1f} ms "
              f"| {sum(r['failed_reads'] for r in rows)} |")
    print("\n| steady state | live restart | --no-live-restart | ratio of medians "
          "| median of per-rep ratios |")
    print("|---|---|---|---|---|")
    for i, what in enumerate(("cold read", "warm read")):
        live = statistics.median(r[i] for r in steady["live"])
        base = statistics.median(r[i] for r in steady["nolive"])
        pairs = statistics.median(a[i] / b[i] for a, b in zip(steady["live"], steady["nolive"],
                                                              strict=True))
        out["steady"][what] = {"live_mb_s": [round(r[i], 1) for r in steady["live"]],
                               "no_live_mb_s": [round(r[i], 1) for r in steady["nolive"]],
                               "ratio": round(live / base, 4), "per_rep_ratio": round(pairs, 4)}
        print(f"| {what} | {live:.0f} MB/s | {base:.0f} MB/s | {live / base:.3f} "
              f"| {pairs:.3f} |")
    return out


if __name__ == "__main__":
    main()
