"""microVM memory: N guests reading the same data of one env, pmem + DAX
against virtio-blk.

One layer of ``--data-size`` of random files (incompressible) is built into
a ``file://`` store under the work directory. For N = 1, 2, 4 and each side,
a daemon starts on a fresh ROOT (empty chunk cache), ``vm up`` makes N drive
sets of the layer (``--pmem``: pmem drives, the files all N map; ``blk``:
block drives, ``cache=none``) and N QEMU guests (TCG, ``q35`` for both
sides, ``harness.guest``) boot at once; each mounts the layer's EROFS
(``dax=always`` on pmem) and waits. Once all are up, the host is measured
(before), every guest reads every file of the layer (``cat`` to
``/dev/null``), and once all are done the host is measured again (after):

* **guest page cache**: each guest's ``Cached:`` (``/proc/meminfo``) grown
  by the read, summed over the guests;
* **host**: the QEMU processes' PSS (``/proc/PID/smaps_rollup``: anonymous,
  i.e. guest RAM, and file-backed, the mapped pmem pages split between the
  processes that map them) plus the host page cache of the layer's files
  that no QEMU maps (``fincore`` of the FUSE blob and pmem files), grown by
  the read: what the read added to the host;
* **fetched**: bytes the daemon fetched from the store from the boots on
  (its cache stats).

The sides alternate (which goes first swaps with each N and rep); the page
cache is dropped before each run. Medians of ``--reps``. TCG on a shared
2-core machine: the default data size is 64 MiB (the issue's 200 MB would
take minutes per guest to read under TCG with four guests on two cores); a
bigger ``--data-size`` works the same.

Needs root and ``qemu-system-x86_64``. ``python -m bench.vm_memory [--reps 2]
[--data-size 64M] [--out FILE]``; prints a table and writes
bench/results/vm_memory.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from bench import RESULTS, WORK, git_head
from bench.daemons import DaemonRuns, clear_dir, drop_caches, print_footer
from harness import guest
from layerfs.builder.layer import BuildOptions, build_layer
from layerfs.node.client import Client
from layerfs.node.vms.vmmargs import QEMU_PCI_DEVICE, qemu_drive_args, qemu_memory_args
from layerfs.refstore import RefStore
from layerfs.sizes import parse_size
from layerfs.store.file import FileStore

MiB = 1 << 20
OUT = RESULTS / "vm_memory.json"
GUEST_MB = 512
SIDES = ("pmem", "blk")
COUNTS = (1, 2, 4)
SCRIPT = """cached() {{ sed -n 's/^Cached: *\\([0-9]*\\) kB/\\1/p' /proc/meminfo; }}
mkdir -p /l
mount -t erofs -o ro,{dax}device={device} {meta} /l || echo "GUEST-ERROR mount"
echo "BENCH-READY $(cached)"
read -r line
find /l -type f | while read -r f; do cat "$f" > /dev/null; done
echo "BENCH-READ-DONE $(cached)"
read -r line
"""


def data_tree(work: Path, size: int) -> Path:
    """Files of random bytes, ``size`` in all (8 MiB each)."""
    tree = work / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    rng = random.Random(11)
    for i in range(max(1, size // (8 * MiB))):
        (tree / f"f{i:03}.bin").write_bytes(rng.randbytes(min(8 * MiB, size)))
    return tree


def pss(pid: int) -> dict[str, int]:
    """A process's PSS (total, anonymous, file-backed), in bytes."""
    text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    got = {k: int(v) * 1024 for k, v in re.findall(r"^(Pss\w*):\s+(\d+) kB", text, re.M)}
    return {"pss": got.get("Pss", 0), "anon": got.get("Pss_Anon", 0),
            "file": got.get("Pss_File", 0)}


def resident(paths: list[Path]) -> int:
    """Bytes of these files in the host's page cache (``fincore``)."""
    paths = [p for p in paths if p.exists()]
    if not paths:
        return 0
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES",
                          *map(str, paths)], capture_output=True, text=True, check=True).stdout
    return sum(int(x) for x in out.split())


def host(guests: list[guest.Guest], files: list[Path]) -> dict[str, int]:
    rows = [pss(g.proc.pid) for g in guests]
    cached = resident(files)
    anon = sum(r["anon"] for r in rows)
    mapped = sum(r["file"] for r in rows)
    return {"pss": sum(r["pss"] for r in rows), "pss_anon": anon, "pss_file": mapped,
            "page_cache": cached}


def run(client: Client, root: Path, kernel: guest.GuestKernel, ref: str, side: str, n: int,
        work: Path, timeout: float) -> dict:
    """N guests of one side reading the layer; what it cost them and the host."""
    vms = [client.vm_up(f"{side}{n}-{i}", layers=[ref], disk_size=MiB,
                        pmem="shared" if side == "pmem" else "") for i in range(n)]
    hexes = [d.removeprefix("sha256:") for d in vms[0].blobs]
    files = [root / "fuse" / "pmem" / h for h in hexes] + [root / "fuse" / "blobs" / h
                                                          for h in hexes]
    script = SCRIPT.format(dax="dax=always," if side == "pmem" else "",
                           device="/dev/pmem1" if side == "pmem" else "/dev/vdb",
                           meta="/dev/pmem0" if side == "pmem" else "/dev/vda")
    guests: list[guest.Guest] = []
    stats0 = client.stats()  # (the boots' and mounts' fetches count too)
    fetched0 = stats0.cache.get("bytes_fetched", 0)
    try:
        for i, vm in enumerate(vms):
            initramfs = guest.make_initramfs(work / f"{side}{n}-{i}.cpio", kernel, script)
            argv = guest.qemu_argv(kernel, initramfs,
                                   qemu_drive_args(vm.drives, QEMU_PCI_DEVICE),
                                   machine="q35",
                                   memory_args=qemu_memory_args(vm.drives, GUEST_MB))
            guests.append(guest.Guest(argv, work / f"{side}{n}-{i}.log"))
        ready = [g.wait_for(r"^BENCH-READY (\d+)", timeout) for g in guests]
        before = host(guests, files)
        for g in guests:
            g.send("go")
        done = [g.wait_for(r"^BENCH-READ-DONE (\d+)", timeout, at + 1)
                for g, (at, _) in zip(guests, ready, strict=True)]
        after = host(guests, files)
        stats = client.stats()
        fetched = stats.cache.get("bytes_fetched", 0) - fetched0
        store_gets = stats.store.get("get", 0) - stats0.store.get("get", 0)
        for g in guests:
            g.send("stop")
        for g in guests:
            if g.finish(timeout) != 0:
                raise RuntimeError(f"a guest failed; see {g.log_path}")
        problems = [line for g in guests for line in g.lines if "GUEST-ERROR" in line]
        if problems:
            raise RuntimeError(f"guest errors: {problems}")
    finally:
        for g in guests:
            g.stop()
        for vm in vms:
            client.vm_down(vm.id)
    guest_cache = sum((int(d.group(1)) - int(r.group(1))) * 1024
                      for (_, r), (_, d) in zip(ready, done, strict=True))
    grown = {k: after[k] - before[k] for k in after}
    return {"guests": n, "guest_page_cache": guest_cache, "host_before": before,
            "host_after": after, "host_grown": grown,
            "host_added": grown["pss_anon"] + grown["pss_file"] + max(
                0, grown["page_cache"] - grown["pss_file"]),
            "fetched_bytes": fetched, "store_gets": store_gets}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--data-size", default="64M", help="the data every guest reads")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a step may take")
    ap.add_argument("--work", type=Path, default=WORK / "vm_memory")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    size = parse_size(args.data_size)
    t0 = time.monotonic()
    oddities: list[str] = []
    work = args.work.resolve()
    clear_dir(work, oddities).mkdir(parents=True)
    kernel = guest.guest_kernel()
    store_dir = work / "store"
    store_dir.mkdir()
    built = build_layer(RefStore(FileStore(str(store_dir))), str(data_tree(work, size)),
                        BuildOptions("bench/vmdata", "1", chunk_size=MiB))
    runs = DaemonRuns(work, oddities, cache_size="4G")
    rows: dict[str, dict[int, list[dict]]] = {s: {n: [] for n in COUNTS} for s in SIDES}
    try:
        k = 0
        for rep in range(args.reps):
            for n in COUNTS:
                for side in (SIDES if k % 2 == 0 else SIDES[::-1]):
                    root = clear_dir(work / "root", oddities)
                    node = runs.start(root, f"{side}{n}r{rep}", ["--store",
                                                                 f"file://{store_dir}"])
                    drop_caches()
                    row = run(Client(root), root, kernel, built.ref, side, n, work,
                              args.timeout)
                    rows[side][n].append(row)
                    print(f"rep {rep} {side:4} N={n}: guest cache "
                          f"{row['guest_page_cache'] / MiB:.1f} MiB, host added "
                          f"{row['host_added'] / MiB:.1f} MiB, fetched "
                          f"{row['fetched_bytes'] / MiB:.1f} MiB", flush=True)
                    runs.finish(node, remove_root=True)
                k += 1
    finally:
        runs.stop_all()
    report(args, size, built, rows, runs, oddities, time.monotonic() - t0)


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(args, size: int, built, rows: dict, runs: DaemonRuns, oddities: list[str],
           total: float) -> None:
    summary: dict[str, dict[str, dict]] = {}
    print(f"\n{size / MiB:.0f} MiB read by each guest, medians of {args.reps}")
    print(f"{'side':5} {'N':>2} {'guest cache MiB':>16} {'of read':>8} {'host added MiB':>15} "
          f"{'per guest after 1st':>20} {'fetched MiB':>12}")
    for side in SIDES:
        summary[side] = {}
        first = median(rows[side][1], "host_added")
        for n in COUNTS:
            cache, added = median(rows[side][n], "guest_page_cache"), median(rows[side][n],
                                                                            "host_added")
            fetched = median(rows[side][n], "fetched_bytes")
            extra = (added - first) / (n - 1) / size if n > 1 else None
            summary[side][str(n)] = {
                "guest_page_cache": cache, "guest_cache_of_read": cache / (n * size),
                "host_added": added, "added_per_extra_guest_of_read": extra,
                "fetched_bytes": fetched}
            print(f"{side:5} {n:>2} {cache / MiB:16.1f} {cache / (n * size):8.1%} "
                  f"{added / MiB:15.1f} {'' if extra is None else f'{extra:.2f}x':>20} "
                  f"{fetched / MiB:12.1f}")
    doc = {"commit": git_head(), "reps": args.reps, "data_bytes": size, "guest_mb": GUEST_MB,
           "layer": built.ref, "medians": summary,
           "runs": {s: {str(n): r for n, r in by.items()} for s, by in rows.items()},
           "oddities": oddities}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print_footer(runs.scan_logs(), oddities, f"{total:.0f} s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
