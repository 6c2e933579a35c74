"""microVM resume: a guest suspended into the store on one node root,
resumed on fresh node roots, with and without the working-set prefetch.

A QEMU guest (TCG, ``harness.guest``, ``--ram`` of RAM, default 512 MiB)
boots on a ``vm up --ram`` drive set of a small layer, fills ``--touch`` of
tmpfs with random bytes (memory the snapshot must hold) and waits for
commands on its console. ``vm suspend`` saves it into a ``file://`` store
under the work directory (measured: seconds, bytes stored against RAM).
Then, per rep, on a fresh node root each (empty cache, a daemon of its
own), a resume **without** the working set (the pushed trace removed from
the store), one **with** it (the trace the first resume pushed) and, with
``--all``, one with **all** of the snapshot's RAM chunks as its working set
(every chunk in the node), with ``--staged`` one on a node that resumed the
snapshot once before (its chunks in the node's cache, the page cache
dropped: the store's part of a lazy resume taken out, the daemon's kept),
with ``--prestaged`` one after ``vm prefetch`` brought the working set onto
the node (untimed, the page cache dropped),
with ``--hot`` one whose QEMU maps a local
copy of the whole RAM, its pages in the page cache (the copy made before
QEMU starts: what no prefetch can beat), and with ``--ideal`` the floor of
any prefetch made at the resume: QEMU maps the same local copy less the
working set's chunks (holes where they go), and from the request on this
process reads those chunks from the store, decodes and checks them and
writes them into the copy (4 threads, no cache files, no FUSE: less work
than any prefetch through the node does), while QEMU starts and its device
state loads; the state is loaded, and the guest goes on, once they are all
written (loading it reads the guest's virtqueues from its RAM; this process
drives QMP, not the daemon). The order rotates between reps; each measures

* **ready**: ``vm resume``'s request to the daemon's log line that the
  state is loaded and the guest runs (QEMU started right after the answer);
* **first command**: the request to the guest's answer to its first
  command (it reads a file of its tmpfs and a file of the layer);
* **fetched**: bytes the node fetched from the store by then, against the
  RAM size (and by ready: how much of it came before the guest ran);
* **from QEMU**: QEMU's start to the first command's answer (what a hot
  resume is compared on).

The report has the working set's size, and the medians of the per-rep
ratios without/with (and without/all) of the first command's time, and
without/hot of the time from QEMU's start.

Last, a resumed guest changes ``--change`` of memory and is suspended
again: what that second snapshot stored, against what changed.

Needs root and ``qemu-system-x86_64``. ``python -m bench.vm_resume [--reps 3]
[--readahead 4M] [--cache-form plain] [--out FILE]``; prints a table and writes
bench/results/vm_resume.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import random
import re
import shutil
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import RESULTS, WORK, git_head
from bench.daemons import DaemonRuns, clear_dir, cpu_seconds, drop_caches, print_footer
from harness import guest
from layerfs.builder.layer import BuildOptions, build_layer
from layerfs.chunks import fetch_run, pack_runs
from layerfs.errors import IntegrityError
from layerfs.formats.chunktable import ChunkEntry
from layerfs.formats.lsmt import HT_SPACE
from layerfs.node.client import Client
from layerfs.node.protocol import VmRam, VmRecord
from layerfs.node.reads.accesstraces import parse_trace, trace_bytes, trace_key
from layerfs.node.vms.snapshots import load_state
from layerfs.node.vms.vmmargs import qemu_drive_args, qemu_ram_args
from layerfs.refstore import RefStore
from layerfs.sizes import parse_size
from layerfs.store.file import FileStore

MiB = 1 << 20
FALLOC_PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
OUT = RESULTS / "vm_resume.json"
SCRIPT = """mkdir -p /l
mount -t erofs -o ro,device=/dev/vdb /dev/vda /l || echo "GUEST-ERROR mount"
dd if=/dev/urandom of=/tmp/fill bs=1M count={touch} status=none
echo note > /tmp/note
echo READY
while read -r line; do
    case "$line" in
    cmd) echo "DONE $(cat /tmp/note) $(wc -c < /l/hello.txt)" ;;
    change) dd if=/dev/urandom of=/tmp/change bs=1M count={change} status=none; echo CHANGED ;;
    stop) break ;;
    esac
done
"""


def wait_log(node, text: str, timeout: float) -> float:
    """When ``text`` showed up in the daemon's log (polled)."""
    deadline = time.monotonic() + timeout
    while text not in node.log():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {text!r} in {node.root}'s log")
        time.sleep(0.01)
    return time.monotonic()


def start(kernel, initramfs: Path, vm: VmRecord, work: Path, name: str) -> guest.Guest:
    assert vm.ram is not None
    argv = guest.qemu_argv(kernel, initramfs, qemu_drive_args(vm.drives)
                           + qemu_ram_args(vm.ram), memory_mb=vm.ram.size // MiB)
    return guest.Guest(argv, work / f"{name}.log")


def local_copy(ram: VmRam, path: Path) -> VmRam:
    """The resumed RAM read whole into a local file (its zero 4 MiB pieces
    left as holes), its pages in the page cache: a RAM no prefetch can beat."""
    with open(ram.path, "rb") as src, open(path, "wb") as dst:
        for at in range(0, ram.size, 4 * MiB):
            piece = src.read(4 * MiB)
            if piece.count(0) != len(piece):
                dst.seek(at)
                dst.write(piece)
        dst.truncate(ram.size)
    return VmRam(path=str(path), size=ram.size, share=ram.share, qmp=ram.qmp,
                 incoming=ram.incoming)


def ideal_copy(ram: VmRam, path: Path, entries: list[ChunkEntry]) -> VmRam:
    """:func:`local_copy` less the working set: each of ``entries`` (checked
    against the copy first: the RAM offset of a chunk is its blob offset less
    the header space) punched out, so that its pages read as zeros until
    :func:`fetch_into` writes them; QMP on a socket of this process's own."""
    local = local_copy(ram, path)
    with open(path, "r+b") as f:
        for e in entries:
            at = e.blob_offset - HT_SPACE
            if hashlib.sha256(os.pread(f.fileno(), e.length, at)).digest() != e.sha256:
                raise RuntimeError(f"working-set chunk at RAM offset {at} does not match the "
                                   "local copy: the bench's offset mapping is wrong")
            punch_hole(f.fileno(), at, e.length)
    local.qmp = ram.qmp + ".bench"
    return local


def punch_hole(fd: int, offset: int, length: int) -> None:
    """``fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)``: the range
    becomes a hole, its pages gone from the page cache."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if libc.fallocate(fd, FALLOC_PUNCH, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def fetch_into(store: FileStore, entries: list[ChunkEntry], path: Path) -> None:
    """The working set's chunks read from the store in runs of a pack (4 at
    once), decoded, checked and written at their RAM offsets in ``path``."""
    ordered = sorted(entries, key=lambda e: (e.pack, e.pack_offset))
    with open(path, "r+b") as f, ThreadPoolExecutor(4) as pool:
        def one(run: list[ChunkEntry]) -> None:
            for e, data in zip(run, fetch_run(store, run), strict=True):
                if isinstance(data, IntegrityError):
                    raise data
                os.pwrite(f.fileno(), data, e.blob_offset - HT_SPACE)

        for done in [pool.submit(one, run) for run in pack_runs(ordered)]:
            done.result()


def stage(node, client: Client, kernel, initramfs: Path, work: Path, ref: str, name: str,
          store: FileStore, timeout: float) -> None:
    """An untimed resume of ``ref`` and its first command on the node, then
    down: its chunks stay in the node's cache; the trace it pushes is taken
    out of the store again, the page cache dropped."""
    vm = client.vm_resume(ref, name)
    g = start(kernel, initramfs, vm, work, name)
    try:
        wait_log(node, f"vm {name} resumed from its snapshot", timeout)
        g.send("cmd")
        g.wait_for(r"^DONE ", timeout)
        wait_log(node, f"vm {name}: working set", 30)
        g.send("stop")
        g.finish(timeout)
    finally:
        g.stop()
    client.vm_down(name)
    digest = RefStore(store).resolve("layers", ref)
    if store.exists(trace_key(digest)):
        store.delete(trace_key(digest))
    drop_caches()


def resume(runs: DaemonRuns, store_dir: Path, work: Path, kernel, initramfs: Path, ref: str,
           name: str, oddities: list[str], timeout: float, keep: bool = False,
           hot: bool = False, staged: bool = False, prestaged: bool = False,
           ideal: list[ChunkEntry] | None = None) -> dict:
    """One resume on a fresh node root: its times and bytes fetched. ``hot``:
    its QEMU maps a local copy of the whole RAM instead (made before QEMU
    starts, not timed: ``from_qemu_s`` is what to compare). ``staged``: the
    node resumed the snapshot once before (untimed, :func:`stage`): what it
    touched is in the node's cache, not in the page cache. ``prestaged``:
    ``vm prefetch`` brought the snapshot's working set onto the node before
    (untimed: a scheduler stages it where it will resume it). ``ideal``: the
    working set's entries, fetched by this process at the resume into a
    local copy that lacks them (:func:`ideal_copy`, untimed), the guest going
    on once they are in (this process loads its state)."""
    root = clear_dir(work / f"root-{name}", oddities)
    node = runs.start(root, name, ["--store", f"file://{store_dir}"])
    client = Client(root)
    if staged:
        stage(node, client, kernel, initramfs, work, ref, name + "-stage",
              FileStore(str(store_dir)), timeout)
    staging: dict[str, float] = {}
    if prestaged:  # what staging costs: the working set's fetch alone
        cpu0, t = cpu_seconds(node.proc.pid), time.monotonic()
        client.vm_prefetch(ref)
        staging = {"prestage_s": round(time.monotonic() - t, 3),
                   "prestage_daemon_cpu_s": round(cpu_seconds(node.proc.pid) - cpu0, 3)}
        drop_caches()
    fetched0 = client.stats().cache.get("bytes_fetched", 0)
    cpu0 = cpu_seconds(node.proc.pid)
    t0 = time.monotonic()
    vm = client.vm_resume(ref, name)
    answered = time.monotonic()
    if hot:
        assert vm.ram is not None
        vm.ram = local_copy(vm.ram, work / f"{name}.ram")
    ideal_run: IdealRun | None = None
    if ideal is not None:  # (the copy untimed: the clock starts again after it)
        assert vm.ram is not None
        vm.ram = ideal_copy(vm.ram, work / f"{name}.ram", ideal)
        fetched0 = client.stats().cache.get("bytes_fetched", 0)
        cpu0 = cpu_seconds(node.proc.pid)
        shift = time.monotonic() - answered
        t0, answered = t0 + shift, answered + shift
        ideal_run = IdealRun(FileStore(str(store_dir)), ideal, vm.ram)
    qemu_at = time.monotonic()
    g = start(kernel, initramfs, vm, work, name)
    try:
        if ideal_run is not None:
            ready = ideal_run.ready(timeout)
        else:
            ready = wait_log(node, f"vm {name} resumed from its snapshot", timeout)
        fetched_ready = client.stats().cache.get("bytes_fetched", 0) - fetched0
        g.send("cmd")
        at, _ = g.wait_for(r"^DONE ", timeout)
        first = g.times[at]
        fetched = client.stats().cache.get("bytes_fetched", 0) - fetched0
        cpu = cpu_seconds(node.proc.pid) - cpu0  # (to the first command, with the stats calls)
        row = {"daemon_cpu_s": round(cpu, 3), "answer_s": round(answered - t0, 3),
               "ready_s": round(ready - t0, 3),
               "first_command_s": round(first - t0, 3), "fetched_bytes": fetched,
               "fetched_at_ready_bytes": fetched_ready,
               "from_qemu_s": round(first - qemu_at, 3),
               "prefetched_working_set": f"vm {name}: prefetching the working set" in node.log(),
               **staging}
        warmed = re.search(rf"vm {name}: working set read ahead \((\d+) bytes in \d+ runs, "
                           r"([\d.]+) s\)", node.log())
        if warmed:  # the page-cache read of the working set (its own thread)
            row["warm_s"] = float(warmed.group(2))
        if ideal_run is not None:
            row["ideal_fetch_s"] = round(ideal_run.fetched_at - qemu_at, 3)
        if keep:
            return {"row": row, "node": node, "guest": g, "client": client}
        wait_log(node, f"vm {name}: working set", 30) if not row[
            "prefetched_working_set"] and ideal is None else None
        g.send("stop")
        g.finish(timeout)
    finally:
        if not keep:
            g.stop()
    client.vm_down(name)
    runs.finish(node, remove_root=True)
    return {"row": row}


class IdealRun:
    """The ideal side's resume: the working set fetched into the local copy
    (:func:`fetch_into`) beside QEMU's start; once it is in, the state loaded
    by this process (:func:`load_state`, as the daemon does) and the guest
    let go on."""

    def __init__(self, store: FileStore, entries: list[ChunkEntry], ram: VmRam) -> None:
        self.fetched = threading.Event()
        self.fetched_at = 0.0
        self.error: BaseException | None = None
        self.loaded_at: float | None = None
        threading.Thread(target=self._fetch, args=(store, entries, Path(ram.path)),
                         daemon=True).start()
        threading.Thread(target=self._load, args=(ram,), daemon=True).start()

    def _fetch(self, store: FileStore, entries: list[ChunkEntry], path: Path) -> None:
        try:
            fetch_into(store, entries, path)
        except BaseException as exc:  # noqa: BLE001 - raised in ready()
            self.error = exc
        self.fetched_at = time.monotonic()
        self.fetched.set()

    def _load(self, ram: VmRam) -> None:
        try:
            while not os.path.exists(ram.qmp):
                time.sleep(0.005)
            assert ram.incoming is not None
            self.fetched.wait(120)  # (loading the state reads the virtqueues from RAM)
            load_state(ram.qmp, ram.incoming)
        except BaseException as exc:  # noqa: BLE001 - raised in ready()
            self.error = exc
        self.loaded_at = time.monotonic()

    def ready(self, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while self.loaded_at is None:
            if time.monotonic() > deadline:
                raise RuntimeError("the ideal resume's state did not load")
            time.sleep(0.005)
        if self.error is not None:
            raise RuntimeError(f"the ideal resume failed: {self.error}") from self.error
        return self.loaded_at


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ram", default="512M")
    ap.add_argument("--touch", default="64M", help="tmpfs the guest fills before the suspend")
    ap.add_argument("--change", default="10M", help="memory changed before a second suspend")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--work", type=Path, default=WORK / "vm_resume")
    ap.add_argument("--readahead", default=None,
                    help="the daemons' --readahead (the fault read-around of the RAM disk)")
    ap.add_argument("--cache-form", default=None, choices=["stored", "plain"],
                    help="the daemons' --cache-form (default: the daemon's own)")
    ap.add_argument("--all", action="store_true",
                    help="also resume with every RAM chunk of the snapshot as the working set")
    ap.add_argument("--staged", action="store_true",
                    help="also a resume on a node that resumed the snapshot once before "
                         "(its chunks in the node's cache, the page cache dropped)")
    ap.add_argument("--prestaged", action="store_true",
                    help="also a resume after `vm prefetch` brought the working set onto the "
                         "node (untimed)")
    ap.add_argument("--hot", action="store_true",
                    help="also resume with QEMU on a local copy of the whole RAM, its pages in "
                         "the page cache (the floor of any prefetch; compare from_qemu_s)")
    ap.add_argument("--ideal", action="store_true",
                    help="also the floor of a prefetch at the resume: the working set fetched "
                         "by the bench into a local copy of the RAM that lacks it, beside QEMU's "
                         "start, the guest going on once it is in")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    ram, touch, change = (parse_size(x) for x in (args.ram, args.touch, args.change))
    t0 = time.monotonic()
    oddities: list[str] = []
    work = args.work.resolve()
    clear_dir(work, oddities).mkdir(parents=True)
    kernel = guest.guest_kernel()
    store_dir = work / "store"
    store_dir.mkdir()
    store = FileStore(str(store_dir))
    tree = work / "tree"
    tree.mkdir()
    (tree / "hello.txt").write_bytes(random.Random(1).randbytes(100_000))
    built = build_layer(RefStore(store), str(tree), BuildOptions("bench/resume", "1"))
    initramfs = guest.make_initramfs(work / "guest.cpio", kernel, SCRIPT.format(
        touch=touch // MiB, change=change // MiB))
    runs = DaemonRuns(work, oddities, cache_size="4G", daemon_args=(
        ["--readahead", args.readahead] if args.readahead else []) + (
        ["--cache-form", args.cache_form] if args.cache_form else []))
    results: dict = {"without": [], "with": [], **({"all": []} if args.all else {}),
                     **({"staged": []} if args.staged else {}),
                     **({"prestaged": []} if args.prestaged else {}),
                     **({"hot": []} if args.hot else {}),
                     **({"ideal": []} if args.ideal else {})}
    sides = list(results)
    try:
        root = clear_dir(work / "root-first", oddities)
        node = runs.start(root, "first", ["--store", f"file://{store_dir}"])
        client = Client(root)
        vm = client.vm_up("first", layers=[built.ref], disk_size=16 * MiB, ram=ram)
        g = start(kernel, initramfs, vm, work, "first")
        try:
            g.wait_for(r"^READY", args.timeout)
            started = time.monotonic()
            client.vm_suspend("first", "bench/snap", "1")
            suspend_s = time.monotonic() - started
            g.proc.wait(60)
        finally:
            g.stop()
        runs.finish(node, remove_root=True)
        snap = RefStore(store).disk(RefStore(store).resolve("layers", "bench/snap@1"))
        digest = RefStore(store).resolve("layers", "bench/snap@1")
        traces: dict[str, bytes] = {"all": trace_bytes(ram_chunks(store, digest, ram))}
        for rep in range(args.reps):
            order = sides[rep % len(sides):] + sides[:rep % len(sides)]
            if rep == 0:  # (its first, without, pushes the working set)
                order = ["without"] + [x for x in sides if x != "without"]
            for side in order:
                if side in ("without", "hot", "staged", "ideal"):
                    store.delete(trace_key(digest)) if store.exists(trace_key(digest)) else None
                else:
                    store.put(trace_key(digest), traces["with" if side == "prestaged" else side])
                row = resume(runs, store_dir, work, kernel, initramfs, "bench/snap@1",
                             f"r{rep}{side[0]}", oddities, args.timeout,
                             hot=side == "hot", staged=side == "staged",
                             prestaged=side == "prestaged",
                             ideal=working_set(store, digest, traces["with"], ram)
                             if side == "ideal" else None)["row"]
                results[side].append(row)
                print(f"rep {rep} {side:7}: ready {row['ready_s']:.2f} s, first command "
                      f"{row['first_command_s']:.2f} s (from QEMU {row['from_qemu_s']:.2f} s), "
                      "fetched "
                      f"{row['fetched_bytes'] / MiB:.1f} MiB", flush=True)
                if "with" not in traces and store.exists(trace_key(digest)):
                    traces["with"] = store.get(trace_key(digest))
        second = second_suspend(runs, store_dir, work, kernel, initramfs, oddities, args)
    finally:
        runs.stop_all()
    sets = {side: chunk_bytes(store, digest, traces[side]) for side in traces if side in results}
    report(args, ram, touch, change, suspend_s, snap, results, second, runs, oddities,
           time.monotonic() - t0, sets)


def ram_chunks(store: FileStore, digest: str, ram: int) -> list[int]:
    """The snapshot layer's chunks that hold RAM (in the blob: after the
    header space, at the RAM's own offsets), by index."""
    refstore = RefStore(store)
    entries = refstore.chunk_table(refstore.disk(digest)).entries
    return [i for i, e in enumerate(entries) if HT_SPACE <= e.blob_offset < HT_SPACE + ram]


def working_set(store: FileStore, digest: str, trace: bytes, ram: int) -> list[ChunkEntry]:
    """The table entries of a working set's chunks that hold only RAM (its
    others, the device state's and the one across the RAM's end, the
    resume's answer reads through the node)."""
    entries = RefStore(store).chunk_table(RefStore(store).disk(digest)).entries
    return [e for e in (entries[i] for i in parse_trace(trace) or [])
            if e.blob_offset >= HT_SPACE and e.blob_offset + e.length <= HT_SPACE + ram]


def chunk_bytes(store: FileStore, digest: str, trace: bytes) -> dict:
    """A working set's chunks and bytes."""
    refstore = RefStore(store)
    entries = refstore.chunk_table(refstore.disk(digest)).entries
    order = parse_trace(trace) or []
    return {"chunks": len(order), "bytes": sum(entries[i].length for i in order)}


def second_suspend(runs, store_dir: Path, work: Path, kernel, initramfs: Path,
                   oddities: list[str], args) -> dict:
    """Resume, change memory, suspend again: what the second snapshot stored."""
    got = resume(runs, store_dir, work, kernel, initramfs, "bench/snap@1", "again", oddities,
                 args.timeout, keep=True)
    node, g, client = got["node"], got["guest"], got["client"]
    try:
        g.send("change")
        g.wait_for(r"^CHANGED", args.timeout)
        client.vm_suspend("again", "bench/snap", "2")
        g.proc.wait(60)
    finally:
        g.stop()
    client.vm_down("again")
    runs.finish(node, remove_root=True)
    refstore = RefStore(FileStore(str(store_dir)))
    m = refstore.disk(refstore.resolve("layers", "bench/snap@2"))
    return {"stored_bytes": m.stats.stored_bytes, "file_bytes": m.stats.file_bytes}


def report(args, ram: int, touch: int, change: int, suspend_s: float, snap, results: dict,
           second: dict, runs: DaemonRuns, oddities: list[str], total: float,
           sets: dict) -> None:
    med = {side: {k: statistics.median(r[k] for r in rows)
                  for k in ("ready_s", "first_command_s", "fetched_bytes",
                            "fetched_at_ready_bytes", "from_qemu_s")}
           for side, rows in results.items() if rows}
    key = {"hot": "from_qemu_s"}  # (a hot resume's copy is not timed)
    ratios = {side: [round(w[key.get(side, "first_command_s")]
                           / r[key.get(side, "first_command_s")], 3)
                     for w, r in zip(results["without"], rows, strict=True)]
              for side, rows in results.items() if side != "without"}
    for side, per_rep in ratios.items():
        print(f"first command, without / {side}: per rep {per_rep}, median "
              f"{statistics.median(per_rep):.2f}x")
    for side, got in sets.items():
        print(f"working set {side}: {got['chunks']} chunks, {got['bytes'] / MiB:.1f} MiB")
    print(f"\n{ram // MiB} MiB RAM, {touch // MiB} MiB of it filled; suspend "
          f"{suspend_s:.2f} s, stored {snap.stats.stored_bytes / MiB:.1f} MiB "
          f"({snap.stats.file_bytes / MiB:.1f} MiB non-zero)")
    print(f"{'resume':8} {'ready s':>8} {'1st cmd s':>10} {'from QEMU s':>12} "
          f"{'fetched MiB':>12} {'of RAM':>7}")
    for side, m in med.items():
        print(f"{side:8} {m['ready_s']:8.2f} {m['first_command_s']:10.2f} "
              f"{m['from_qemu_s']:12.2f} "
              f"{m['fetched_bytes'] / MiB:12.1f} {m['fetched_bytes'] / ram:7.1%}")
    print(f"second suspend after changing {change // MiB} MiB: stored "
          f"{second['stored_bytes'] / MiB:.1f} MiB ({second['stored_bytes'] / change:.1f}x)")
    doc = {"commit": git_head(), "reps": args.reps, "ram_bytes": ram, "touched_bytes": touch,
           "readahead": args.readahead, "cache_form": args.cache_form,
           "suspend_s": round(suspend_s, 3), "snapshot_stored_bytes": snap.stats.stored_bytes,
           "snapshot_nonzero_bytes": snap.stats.file_bytes, "medians": med, "runs": results,
           "first_command_ratios": {side: {"per_rep": r, "median": statistics.median(r)}
                                    for side, r in ratios.items()},
           "working_sets": sets,
           "second_suspend": {**second, "changed_bytes": change}, "oddities": oddities}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print_footer(runs.scan_logs(), oddities, f"{total:.0f} s")
    print(f"wrote {args.out}")
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
