"""The floor of a cold read's work on this machine, without the daemon.

A cold read through a sandbox has the node take each chunk from the store,
check its sha256 and keep it on the node's disk, and the reader read it. This
benchmark does that work alone, in this process, with no daemon, no FUSE and
no fanotify, over the packs of ``bench.node``'s 512 MiB layer (its ``file://``
store under ``bench/work/node``: run ``python -m bench.node --only cold
--sizes 512M`` once first), each variant with the same worker threads (each
1 MiB piece read with ``pread``, hashed with ``hashlib``, written with
``pwrite``: calls that release the interpreter lock, so the threads run in
parallel), against the store GET of the same packs ``bench.node`` takes as
its baseline:

- ``get``: every pack read whole by 4 threads (``bench.node``'s baseline);
- ``local-erofs``: the layer's large files read as ``bench.node``'s sandbox
  reads them (one reader, 1 MiB reads) from a kernel EROFS mount of a
  complete local copy of the layer, its blob read with ``directio`` as the
  node mounts layers: no fetch, no check, nothing written; what a cold read
  through a sandbox could at most reach;
- ``through``: read, sha256, and the node's own write of a partial blob
  file's chunk (``partialblobs.write_through``: write, ``sync_file_range``,
  ``DONTNEED``);
- ``through+readback``: the same, then the piece read back with O_DIRECT (the
  layer's EROFS mount reads the partial file so) and copied once (the
  reader's read out of the mount's page cache): the shipped path's work;
- ``behind``: read, sha256, two copies (the reply into the mount's page
  cache, the reader's read out of it), a buffered write left to the kernel's
  writeback (the time stops before the writeback ends): a node that serves
  the reader from memory and writes its cache behind;
- ``memory``: read, sha256, the two copies: no disk cache at all;
- ``node`` and ``node --kernel-reads``: the same files read through a
  sandbox of a real daemon on an empty ROOT, as ``bench.node``'s cold read
  (over FUSE blob files, and over partial blob files); their CPU is the
  daemon's.

Variants alternate in a rotating order, the page cache dropped before each;
medians of per-rep ratios to ``get``. CPU is this process's (user + system,
all threads); the kernel's writeback threads are not in it. Prints a table
and writes bench/results/fill_floor.json with the commit.

    python -m bench.fill_floor [--reps 3] [--threads 4]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import RESULTS, WORK, git_head
from bench.daemons import DaemonRuns, clear_dir, cpu_seconds, drop_caches
from bench.node import ensure_local_copy, get_packs, read_files
from harness.daemonproc import detach_mounts
from layerfs.errors import LayerfsError
from layerfs.mounts import mount_erofs, umount
from layerfs.node.reads.partialblobs import write_through
from layerfs.refstore import RefStore
from layerfs.store.base import blob_key
from layerfs.store.file import FileStore

MiB = 1 << 20
WORK_VARIANTS = ("through", "through+readback", "behind", "memory")
NODE_VARIANTS = {"node": [], "node --kernel-reads": ["--kernel-reads"]}
VARIANTS = ("get", "local-erofs", *WORK_VARIANTS, *NODE_VARIANTS)


def layer_packs(store_dir: Path, ref: str) -> list[str]:
    """The digests of the packs the layer ``ref`` references."""
    refstore = RefStore(FileStore(str(store_dir)))
    digest = refstore.resolve("layers", ref)
    return refstore.chunk_table(refstore.layer(digest)).packs()


class Pieces:
    """The packs cut into 1 MiB pieces, each with its place in one output file."""

    def __init__(self, store_dir: Path, packs: list[str]) -> None:
        self.packs = packs
        self.work: list[tuple[Path, int, int, int]] = []  # pack, offset, length, out offset
        out = 0
        for pack in (store_dir / blob_key(p) for p in packs):
            size = pack.stat().st_size
            for offset in range(0, size, MiB):
                length = min(MiB, size - offset)
                self.work.append((pack, offset, length, out))
                out += (length + 4095) & ~4095  # block-aligned, as the mount reads
        self.total = sum(length for _, _, length, _ in self.work)
        self.size = out


def run_pieces(pieces: Pieces, threads: int, step: Callable[[bytes, int], None]) -> None:
    """``step(data, out_offset)`` for every piece, read from its pack by
    ``threads`` threads, each taking a pack's pieces in turn."""
    by_pack: dict[Path, list[tuple[int, int, int]]] = {}
    for pack, offset, length, out in pieces.work:
        by_pack.setdefault(pack, []).append((offset, length, out))

    def one_pack(pack: Path) -> None:
        fd = os.open(pack, os.O_RDONLY)
        try:
            for offset, length, out in by_pack[pack]:
                step(os.pread(fd, length, offset), out)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one_pack, by_pack))


class LocalCopy:
    """The layer mounted from a complete local copy, and its large files."""

    def __init__(self, work: Path, store_dir: Path, ref: str) -> None:
        refstore = RefStore(FileStore(str(store_dir)))
        digest = refstore.resolve("layers", ref)
        self.meta, self.blob = ensure_local_copy(FileStore(str(store_dir)), digest,
                                                 work / "local" / "floor")
        self.mnt = work / "mnt" / "floor"
        detach_mounts(self.mnt)
        self.mnt.mkdir(parents=True, exist_ok=True)
        mount_erofs(str(self.meta), str(self.blob), str(self.mnt), directio=True)
        self.files = sorted(p for p in self.mnt.rglob("*")
                            if p.is_file() and p.stat().st_size >= 16 * MiB)

    def close(self) -> None:
        umount(str(self.mnt))


class Nodes:
    """Daemons on fresh ROOTs, each reading the layer cold through a sandbox."""

    def __init__(self, work: Path, store_dir: Path, ref: str, oddities: list[str]) -> None:
        self.work, self.ref, self.oddities = work / "floor", ref, oddities
        self.store_args = ["--store", f"file://{store_dir}"]
        self.runs = {name: DaemonRuns(self.work / name.replace(" ", ""), oddities, "16G",
                                      request_timeout=900, daemon_args=extra)
                     for name, extra in NODE_VARIANTS.items()}

    def read(self, name: str, local: LocalCopy) -> tuple[int, float, float]:
        """(bytes, seconds, the daemon's CPU seconds) of the cold read."""
        runs = self.runs[name]
        root = clear_dir(self.work / "root", self.oddities)
        node = runs.start(root, name.replace(" ", ""), self.store_args)
        try:
            rootfs = Path(node.request("up", id="f", layers=[self.ref])["sandbox"]["rootfs"])
            drop_caches()
            assert node.proc is not None
            cpu0 = cpu_seconds(node.proc.pid)
            nbytes, seconds = read_files([rootfs / p.relative_to(local.mnt)
                                          for p in local.files])
            cpu = cpu_seconds(node.proc.pid) - cpu0
            node.request("down", id="f")
        finally:
            runs.finish(node, remove_root=True)
        return nbytes, seconds, cpu


def variant(name: str, pieces: Pieces, out: Path, threads: int,
            store_dir: Path, local: LocalCopy) -> tuple[int, float, float, float]:
    """(bytes, seconds, CPU seconds, seconds of the writeback after, if any)."""
    out.unlink(missing_ok=True)
    fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, pieces.size)
    direct = os.open(out, os.O_RDONLY | os.O_DIRECT)
    buffers = [mmap.mmap(-1, MiB) for _ in range(threads * 2)]

    def through(data: bytes, at: int) -> None:
        hashlib.sha256(data).digest()
        write_through(fd, data, at)  # (the node's own write of a partial file's chunk)

    def readback(data: bytes, at: int) -> None:
        through(data, at)
        buf = buffers.pop()
        try:
            n = os.preadv(direct, [memoryview(buf)[:(len(data) + 4095) & ~4095]], at)
            bytes(memoryview(buf)[1:n])  # the reader's copy out of the mount's cache
        finally:
            buffers.append(buf)

    def behind(data: bytes, at: int) -> None:
        memory(data, at)
        os.pwrite(fd, data, at)

    def memory(data: bytes, at: int) -> None:
        hashlib.sha256(data).digest()
        reply = bytes(memoryview(data)[1:])  # the reply into the mount's cache
        bytes(memoryview(reply)[1:])  # the reader's copy out of it

    steps = {"through": through, "through+readback": readback, "behind": behind,
             "memory": memory}
    nbytes = pieces.total
    try:
        drop_caches()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        if name == "get":
            get_packs(FileStore(str(store_dir)), pieces.packs, threads)
        elif name == "local-erofs":
            nbytes, _ = read_files(local.files)
        else:
            run_pieces(pieces, threads, steps[name])
        seconds = time.perf_counter() - start
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        os.fsync(fd)
        after = time.perf_counter() - start if name == "behind" else 0.0
    finally:
        os.close(direct)
        os.close(fd)
        out.unlink(missing_ok=True)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return nbytes, seconds, cpu, after


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--work", default=str(WORK / "node"))
    ap.add_argument("--ref", default="bench/node-512m@g1-42")
    ap.add_argument("--out", default=str(RESULTS / "fill_floor.json"))
    args = ap.parse_args()
    work = Path(args.work)
    store_dir = work / "store"
    if os.geteuid() != 0:
        sys.exit("bench/fill_floor.py needs root (drop_caches, EROFS mounts, the daemons)")
    try:
        pieces = Pieces(store_dir, layer_packs(store_dir, args.ref))
    except (OSError, LayerfsError) as exc:
        sys.exit(f"no layer {args.ref} in {store_dir} ({exc}): run "
                 "`python -m bench.node --only cold --sizes 512M` first")
    out = work / "fill_floor.out"
    local = LocalCopy(work, store_dir, args.ref)
    oddities: list[str] = []
    nodes = Nodes(work, store_dir, args.ref, oddities)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    try:
        for rep in range(args.reps):
            order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]
            for name in order:
                run_variant(name, rep, pieces, out, args, local, nodes, runs)
    finally:
        local.close()
        for daemons in nodes.runs.values():
            daemons.stop_all()
    for odd in oddities:
        print(f"oddity: {odd}")
    report(pieces, runs, args)


def run_variant(name: str, rep: int, pieces: Pieces, out: Path, args: argparse.Namespace,
                local: LocalCopy, nodes: Nodes, runs: dict[str, list[dict]]) -> None:
    if name in NODE_VARIANTS:
        nbytes, seconds, cpu = nodes.read(name, local)
        after = 0.0
    else:
        nbytes, seconds, cpu, after = variant(name, pieces, out, args.threads,
                                      Path(args.work) / "store", local)
    runs[name].append({"bytes": nbytes, "seconds": round(seconds, 4), "cpu_s": round(cpu, 3),
                       "writeback_after_s": round(after, 4)})
    print(f"  rep {rep} {name:19s} {nbytes / seconds / 1e6:7.1f} MB/s  "
          f"CPU {cpu / (nbytes / 1e9):.2f} s/GB", flush=True)


def rate(run: dict) -> float:
    return run["bytes"] / run["seconds"]


def report(pieces: Pieces, runs: dict[str, list[dict]], args: argparse.Namespace) -> None:
    """The table (medians of per-rep ratios to ``get``, the rep's own) and the JSON."""
    rows = {}
    for name in VARIANTS:
        ratios = [rate(r) / rate(runs["get"][i]) for i, r in enumerate(runs[name])]
        rows[name] = {
            "mb_s": [round(rate(r) / 1e6, 1) for r in runs[name]],
            "cpu_s_per_gb": [round(r["cpu_s"] / (r["bytes"] / 1e9), 2) for r in runs[name]],
            "ratio_to_get": round(statistics.median(ratios), 3),
            "writeback_after_s": [r["writeback_after_s"] for r in runs[name]],
        }
    print(f"\n{'work':20s} {'MB/s (per rep)':>28s} {'x get':>7s} {'CPU s/GB':>16s}")
    for name, row in rows.items():
        print(f"{name:20s} {', '.join(f'{v:.0f}' for v in row['mb_s']):>28s} "
              f"{row['ratio_to_get']:7.2f} "
              f"{min(row['cpu_s_per_gb']):.2f}-{max(row['cpu_s_per_gb']):.2f}".rjust(16))
    Path(args.out).write_text(json.dumps({
        "commit": git_head(), "bytes": pieces.total, "threads": args.threads,
        "reps": args.reps, "cpus": os.cpu_count(), "variants": rows, "runs": runs,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
