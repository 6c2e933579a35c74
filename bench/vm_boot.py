"""microVM boot and disk reads: a guest on a layerfs writable disk against
the same image as a local raw file.

One ext4 image (busybox, an ``/init``, a ``--file-size`` file of random
bytes) is imported with ``build-disk`` into a ``file://`` store under the
work directory. A QEMU guest (TCG, ``harness.guest``: Debian's cloud
kernel, a busybox initramfs that mounts ``/dev/vda`` and runs the disk's
``/init``) boots with its root on

* **layerfs**: the writable disk of ``vm up --base-disk`` (the sealed image
  read lazily through the daemon's FUSE file, ``cache=none``), or
* **raw**: a copy of the image as a plain file on the same file system
  (``cache=none`` too),

and its ``/init`` prints a line (boot-to-command: QEMU's start to that line,
seen on the serial console) and then reads the large file with ``dd`` (from
the line before to the line after). Each rep starts a daemon on a fresh ROOT
and runs, the two sides alternating (the first side alternating between
reps), layerfs cold (the first vm: empty chunk cache and replica), raw,
layerfs warm (a second vm over the same base: its chunks in the node's
cache), raw again; the page cache is dropped before every boot (a raw
drive's ``cache=none`` reads bypass it anyway, so its two runs are the same
measurement twice). Medians of ``--reps``.

Needs root and ``qemu-system-x86_64``. ``python -m bench.vm_boot [--reps 7]
[--file-size 128M]``; prints a table and writes bench/results/vm_boot.json.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from bench import RESULTS, WORK, git_head
from bench.daemons import DaemonRuns, clear_dir, drop_caches, print_footer
from harness import guest
from layerfs.builder.disk import build_disk
from layerfs.node.client import Client
from layerfs.node.protocol import VmRecord
from layerfs.node.vms.vmmargs import qemu_drive_args
from layerfs.refstore import RefStore
from layerfs.sizes import parse_size
from layerfs.store.file import FileStore

MiB = 1 << 20
OUT = RESULTS / "vm_boot.json"
DISK_INIT = """#!/bin/sh
set -e
export PATH=/bin
echo BENCH-READY
mount -t devtmpfs devtmpfs /dev
dd if=/data/big.bin of=/dev/null bs=1M status=none
echo BENCH-READ-DONE
umount /dev
"""
BOOT = """mount -t ext4 -o ro /dev/vda /newroot || exit 1
chroot /newroot /bin/sh /init || exit 1
umount /newroot
"""
RAW_DRIVE = "file={},format=raw,if=none,id=rw,cache=none,aio=threads"


def disk_image(work: Path, file_size: int) -> Path:
    tree = work / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    for d in ("bin", "dev", "proc", "data"):
        (tree / d).mkdir(parents=True)
    shutil.copy(guest.busybox(), tree / "bin" / "busybox")
    for tool in ("sh", "dd", "mount", "umount"):
        (tree / "bin" / tool).symlink_to("busybox")
    (tree / "init").write_text(DISK_INIT)
    rng = random.Random(7)
    with open(tree / "data" / "big.bin", "wb") as f:
        for _ in range(file_size // MiB):
            f.write(rng.randbytes(MiB))
    image = work / "guest.img"
    size_mib = file_size // MiB + 64
    subprocess.run(["mkfs.ext4", "-q", "-d", str(tree), str(image), f"{size_mib}M"],
                   check=True)
    shutil.rmtree(tree)
    return image


def boot(kernel: guest.GuestKernel, drive_args: list[str], work: Path, name: str,
         timeout: float) -> dict:
    """One guest: seconds to its command and to read the file."""
    with guest.running_guest(kernel, BOOT, drive_args, work, name) as g:
        ready_at, _ = g.wait_for(r"^BENCH-READY", timeout)
        done_at, _ = g.wait_for(r"^BENCH-READ-DONE", timeout, ready_at + 1)
        status = g.finish(timeout)
    if status != 0:
        raise RuntimeError(f"guest {name} exited {status}; see {work / name}.log")
    ready, done = g.times[ready_at], g.times[done_at]  # when the console gave each line
    return {"boot_s": round(ready - g.started, 3), "read_s": round(done - ready, 3)}


def layerfs_boot(client: Client, kernel: guest.GuestKernel, base: str, work: Path, vid: str,
                 timeout: float) -> dict:
    """One guest on a vm's writable disk over ``base``; also the vm up's
    seconds and the bytes the daemon fetched from the store meanwhile."""
    started = time.perf_counter()
    vm: VmRecord = client.vm_up(vid, base_disk=base)
    up_s = round(time.perf_counter() - started, 3)
    fetched = client.stats().cache.get("bytes_fetched", 0)
    row = boot(kernel, qemu_drive_args(vm.drives), work, f"lfs-{vid}", timeout)
    row["fetched_bytes"] = client.stats().cache.get("bytes_fetched", 0) - fetched
    row["vm_up_s"] = up_s
    client.vm_down(vm.id)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--file-size", default="128M", help="the file the guest reads")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a boot may take")
    ap.add_argument("--work", type=Path, default=WORK / "vm_boot")
    args = ap.parse_args()
    file_size = parse_size(args.file_size)
    t0 = time.monotonic()
    oddities: list[str] = []
    work = args.work.resolve()
    clear_dir(work, oddities).mkdir(parents=True)
    kernel = guest.guest_kernel()
    image = disk_image(work, file_size)
    store_dir = work / "store"
    store_dir.mkdir()
    store = FileStore(str(store_dir))
    built = build_disk(RefStore(store), str(image), "bench/guest", "1")
    raw = work / "raw.img"
    raw_drive = ["-drive", RAW_DRIVE.format(raw), "-device", "virtio-blk-device,drive=rw"]
    runs = DaemonRuns(work, oddities, cache_size="4G")
    results: dict[str, dict[str, list[dict]]] = {
        side: {"cold": [], "warm": []} for side in ("layerfs", "raw")}
    try:
        for rep in range(args.reps):
            first, second = ("layerfs", "raw") if rep % 2 == 0 else ("raw", "layerfs")
            root = clear_dir(work / "root", oddities)
            node = runs.start(root, f"rep{rep}", ["--store", f"file://{store_dir}"])
            client = Client(root)
            shutil.copy(image, raw)
            for kind in ("cold", "warm"):
                for side in (first, second):
                    drop_caches()
                    if side == "raw":
                        row = boot(kernel, raw_drive, work, f"raw{rep}{kind[0]}", args.timeout)
                    else:
                        row = layerfs_boot(client, kernel, built.ref, work, f"{kind}{rep}",
                                           args.timeout)
                    results[side][kind].append(row)
            raw.unlink()
            runs.finish(node, remove_root=True)
    finally:
        runs.stop_all()
    report(args, file_size, built, results, runs, oddities, time.monotonic() - t0)


def medians(rows: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in rows), 3) for k in ("boot_s", "read_s")}


def report(args, file_size: int, built, results: dict, runs: DaemonRuns,
           oddities: list[str], total: float) -> None:
    summary = {side: {kind: medians(rows) for kind, rows in kinds.items()}
               for side, kinds in results.items()}
    print(f"guest boot to command and a dd of {file_size // MiB} MiB, medians of {args.reps}")
    print(f"{'side':9} {'run':5} {'boot s':>8} {'read s':>8} {'MB/s':>8}")
    for side, kinds in summary.items():
        for kind, m in kinds.items():
            print(f"{side:9} {kind:5} {m['boot_s']:8.2f} {m['read_s']:8.2f} "
                  f"{file_size / 1e6 / m['read_s']:8.1f}")
    doc = {"commit": git_head(), "reps": args.reps, "file_size": file_size,
           "image_bytes": built.manifest.virtual_size,
           "stored_bytes": built.manifest.stats.stored_bytes,
           "medians": summary, "runs": results, "oddities": oddities}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=2) + "\n")
    print_footer(runs.scan_logs(), oddities, f"{total:.0f} s")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
