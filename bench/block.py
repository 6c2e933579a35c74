"""Block path throughput: writable disks through a loop device against a local file.

In one run, through loop devices and with the page cache dropped before each
measurement:

* sequential read MB/s and 4 KiB random-read IOPS of (a) a writable disk over a
  sealed chain whose chunks are already in the node cache, (b) the same over a
  cold chain (a fresh node root for each of the two measurements: every chunk
  comes from the store on first touch), against (baseline) a plain local
  sparse file with the same bytes; (a) and the baseline ``--reps`` times each,
  alternating which goes first, medians reported;
* commit time and stored bytes against the amount of data written.

    python -m bench.block [--size-mb 512] [--reps 5] [--work bench/work/block]

Prints a table and writes bench/results/block.json.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import statistics
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from bench import RESULTS, WORK
from bench.daemons import drop_caches
from harness.daemonproc import LAYERFS, DaemonProcess
from layerfs.builder.disk import build_disk
from layerfs.node.daemon.service import mounts_under
from layerfs.refstore import RefStore
from layerfs.store import open_store

MiB = 1 << 20
GEN = 1


def make_image(path: Path, size: int, seed: int = 7) -> None:
    """Half random data in 4 MiB extents, half holes (a typical used disk)."""
    marker = path.with_suffix(".json")
    key = {"size": size, "seed": seed, "gen": GEN}
    if path.exists() and marker.exists() and json.loads(marker.read_text()) == key:
        return
    rng = random.Random(seed)
    with open(path, "wb") as f:
        f.truncate(size)
        for off in range(0, size, 4 * MiB):
            if rng.random() < 0.5:
                f.seek(off)
                f.write(os.urandom(min(4 * MiB, size - off)))
    marker.write_text(json.dumps(key))


@contextmanager
def loop(path: Path):
    dev = subprocess.run(["losetup", "-f", "--show", "-r", str(path)], check=True,
                         capture_output=True, text=True).stdout.strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


def seq_read(dev: str) -> float:
    """MB/s reading the whole device with 1 MiB direct reads."""
    drop_caches()
    fd = os.open(dev, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, MiB)
    total = 0
    start = time.perf_counter()
    try:
        while True:
            n = os.readv(fd, [buf])
            if n <= 0:
                break
            total += n
    finally:
        os.close(fd)
    return total / 1e6 / (time.perf_counter() - start)


def random_iops(dev: str, size: int, count: int, seed: int = 3) -> float:
    """4 KiB direct random reads per second, one at a time."""
    drop_caches()
    rng = random.Random(seed)
    offsets = [rng.randrange(size // 4096) * 4096 for _ in range(count)]
    fd = os.open(dev, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 4096)
    start = time.perf_counter()
    try:
        for off in offsets:
            os.preadv(fd, [buf], off)
    finally:
        os.close(fd)
    return count / (time.perf_counter() - start)


def cli(node: DaemonProcess, *args: str) -> str:
    """``layerfs ARGS --root ROOT`` against ``node``; its standard output."""
    proc = subprocess.run([*LAYERFS, *args, "--root", str(node.root)], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"layerfs {' '.join(args)}: {proc.stderr}\n{node.log()[-4000:]}")
    return proc.stdout


def start(root: Path, store_url: str, daemons: list[DaemonProcess]) -> DaemonProcess:
    """A daemon on ``root`` with disk ``d`` created on the sealed chain."""
    node = DaemonProcess(root, ["--store", store_url], read_timeout=5.0).start()
    daemons.append(node)
    cli(node, "disk", "create", "d", "--base", "bench/disk@1")
    return node


def measure(dev: str, size: int, count: int) -> dict:
    return {"seq_mb_s": round(seq_read(dev), 1), "iops_4k": round(random_iops(dev, size, count))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=512, help="disk size")
    ap.add_argument("--iops-reads", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=5,
                    help="repetitions of the local and cached-chain measurements (medians)")
    ap.add_argument("--work", default=str(WORK / "block"))
    ap.add_argument("--out", default=str(RESULTS / "block.json"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    size = args.size_mb * MiB
    image = work / "image.raw"
    make_image(image, size)
    for d in ("store", "warm", "cold", "cold1", "cold2", "commit"):
        shutil.rmtree(work / d, ignore_errors=True)
    store_url = f"file://{work / 'store'}"
    store = open_store(store_url)
    base = build_disk(RefStore(store), str(image), "bench/disk", "1")
    daemons: list[DaemonProcess] = []
    result: dict = {"disk_bytes": size, "data_bytes": base.manifest.stats.file_bytes,
                    "stored_bytes": base.manifest.stats.stored_bytes}
    try:
        cold = [start(work / f"cold{i}", store_url, daemons) for i in (1, 2)]
        with loop(cold[0].root / "fuse" / "disks" / "d") as dev:
            seq = seq_read(dev)
        with loop(cold[1].root / "fuse" / "disks" / "d") as dev:
            iops = random_iops(dev, size, args.iops_reads)
        result["cold_chain"] = {"seq_mb_s": round(seq, 1), "iops_4k": round(iops)}
        warm = start(work / "warm", store_url, daemons)
        disk = warm.root / "fuse" / "disks" / "d"
        with open(disk, "rb") as f:  # fetch every chunk into the node cache
            while f.read(8 * MiB):
                pass
        with loop(image) as local_dev, loop(disk) as disk_dev:
            runs: dict[str, list[dict]] = {"local_file": [], "cached_chain": []}
            for rep in range(args.reps):  # alternate which goes first
                order = [("local_file", local_dev), ("cached_chain", disk_dev)]
                for name, dev in order[:: 1 if rep % 2 == 0 else -1]:
                    runs[name].append(measure(dev, size, args.iops_reads))
        for name, got in runs.items():
            result[name] = {key: round(statistics.median(r[key] for r in got), 1)
                            for key in got[0]}
            result[name]["runs"] = got
        result["commits"] = commits(warm, size)
    finally:
        for d in daemons:
            d.cleanup()
        left = mounts_under(work)
        for point in left:
            subprocess.run(["umount", "-l", point], check=False)
    local = result["local_file"]
    for name in ("cached_chain", "cold_chain"):
        r = result[name]
        r["seq_ratio"] = round(r["seq_mb_s"] / local["seq_mb_s"], 3)
        r["iops_ratio"] = round(r["iops_4k"] / local["iops_4k"], 3)
    result["target"] = "cached chain >= 0.3x the local file"
    report(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def commits(node: DaemonProcess, size: int) -> list[dict]:
    """Write N MiB of random data into the disk, commit, time it, see what it stored."""
    out = []
    disk = node.root / "fuse" / "disks" / "d"
    rng = random.Random(11)
    for i, mib in enumerate((1, 10, 100)):
        with open(disk, "r+b") as f:
            for _ in range(mib):
                f.seek(rng.randrange(size // MiB) * MiB)
                f.write(os.urandom(MiB))
            f.flush()
            os.fsync(f.fileno())
        start = time.perf_counter()
        res = json.loads(cli(node, "disk", "commit", "d", "--name", "bench/disk",
                             "--version", f"c{i}", "--json"))
        out.append({"written_mib": mib, "seconds": round(time.perf_counter() - start, 3),
                    "changed_bytes": res["changed_bytes"], "stored_bytes": res["stored_bytes"],
                    "uploaded_bytes": res["uploaded_bytes"],
                    "stored_per_changed": round(res["stored_bytes"] / res["changed_bytes"], 3)})
    return out


def report(r: dict) -> None:
    print(f"disk {r['disk_bytes'] / MiB:.0f} MiB, data {r['data_bytes'] / MiB:.0f} MiB, "
          f"stored {r['stored_bytes'] / MiB:.1f} MiB")
    print(f"{'device':30} {'seq MB/s':>9} {'ratio':>6} {'4K IOPS':>8} {'ratio':>6}")
    local = r["local_file"]
    print(f"{'local sparse file (baseline)':30} {local['seq_mb_s']:9.1f} {'1.00':>6} "
          f"{local['iops_4k']:8.0f} {'1.00':>6}")
    for name, label in (("cached_chain", "(a) writable, cached chain"),
                        ("cold_chain", "(b) writable, cold chain")):
        x = r[name]
        print(f"{label:30} {x['seq_mb_s']:9.1f} {x['seq_ratio']:6.2f} {x['iops_4k']:8.0f} "
              f"{x['iops_ratio']:6.2f}")
    print("target: (a) >= 0.3x the local file")
    print(f"{'commit of':12} {'seconds':>8} {'changed MiB':>12} {'stored MiB':>11}")
    for c in r["commits"]:
        print(f"{c['written_mib']:>8} MiB {c['seconds']:8.2f} {c['changed_bytes'] / MiB:12.2f} "
              f"{c['stored_bytes'] / MiB:11.2f}")


if __name__ == "__main__":
    main()
