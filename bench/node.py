"""Node daemon benchmarks: cold ``up`` latency, warm and cold sequential reads,
and a metadata walk, each as a ratio against a baseline measured in the same run.

Generates (once, seeded) layers of random (incompressible) data — a few large
files of 64-256 MiB plus some small files — of each ``--sizes`` size, and a
tree of many 1-4 KiB files, builds them into a ``file://`` store under the
work directory (chunk size 1 MiB) and reuses sources, store and local copies
between runs. Then, driving real ``layerfs daemon`` processes through the
control API:

1. cold ``up`` (prefetch none) on a fresh ROOT, against ``up`` with
   ``prefetch: full`` (the eager baseline, like a full image pull);
2. warm sequential reads of the large files through a sandbox rootfs (chunk
   cache filled, page cache dropped), against a kernel EROFS mount of a local
   copy of the same layer (meta image + materialized blob), each after one
   untimed read (the one that fills the chunk cache, and one of the copy);
3. cold sequential reads through a sandbox on a fresh ROOT, against reading
   every pack the layer references, whole, with ``store.get``;
4. ``os.walk`` + ``lstat`` of every entry (and ``find -printf ''``) of the
   small-file tree through a sandbox, against the local EROFS mount;
5. the cost of the node's checks of its own disk (``--only trust``): the
   sha256 check of a layer's local meta image before each mount (its time
   per image, and a first and a second ``up`` against a daemon started with
   that check patched out, the bench's baseline only), and the chunk-identity check of
   every cache file read (in this process: whole reads of cached 1 MiB chunks
   with the check against the same reads with it patched out, and the check's
   own time per read as a share of the warm read's throughput).

The kernel page cache is dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``)
before every timed read or walk and before every timed ``up``. Needs root.

    python -m bench.node [--sizes 100M,1G,4G] [--quick] [--work bench/work/node]

Prints a table and writes bench/results/node.json.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import harness.daemonproc
from bench import RESULTS, WORK, git_head
from bench.daemons import DaemonRuns, clear_dir, cpu_seconds, drop_caches, print_footer
from harness.daemonproc import DaemonProcess, detach_mounts
from layerfs.builder.layer import BuildOptions, build_layer
from layerfs.chunks import materialize_blob
from layerfs.mounts import mount_erofs, umount
from layerfs.node.reads import chunkfile
from layerfs.node.reads.chunkcache import ChunkCache
from layerfs.node.replica.replica import fd_sha256
from layerfs.refstore import LAYERS, RefStore
from layerfs.sizes import parse_size
from layerfs.store.base import Store, blob_key
from layerfs.store.file import FileStore

GEN = 1  # bump when a generator changes
MiB = 1 << 20
SEED = 42


# -- sizes ------------------------------------------------------------------

def label_of(text: str) -> str:
    return text.strip().upper().removesuffix("IB").removesuffix("B")


# -- generated sources --------------------------------------------------------

def random_file(path: Path, size: int, key: str) -> None:
    """``size`` seeded random bytes: AES-128-CTR of zeros (openssl), which is
    several times faster than Python's generators; ``random.randbytes`` if
    openssl is missing."""
    aes = hashlib.sha256(key.encode()).hexdigest()[:32]
    if shutil.which("openssl"):
        with open(path, "wb") as out:
            enc = subprocess.Popen(["openssl", "enc", "-aes-128-ctr", "-K", aes, "-iv", "0",
                                    "-nosalt", "-in", "/dev/zero"],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            assert enc.stdout is not None
            left = size
            while left:
                block = enc.stdout.read(min(left, 8 * MiB))
                if not block:
                    raise RuntimeError("openssl enc stopped early")
                out.write(block)
                left -= len(block)
            enc.kill()
            enc.wait()
        return
    rng = random.Random(aes)
    with open(path, "wb") as out:
        left = size
        while left:
            n = min(left, 8 * MiB)
            out.write(rng.randbytes(n))
            left -= n


def load_marker(marker: Path, key: list) -> dict | None:
    if marker.exists():
        info = json.loads(marker.read_text())
        if info.get("key") == key:
            return info
    return None


def generate_data(root: Path, total: int, seed: int = SEED) -> dict:
    """About 2 % of ``total`` in small files (1-64 KiB), the rest in large
    files of 64-256 MiB (the last one takes what is left)."""
    marker = root.with_name(root.name + ".json")
    key = [total, seed, GEN, "data"]
    info = load_marker(marker, key)
    if info is not None and root.is_dir():
        return info
    print(f"generating {root} ({total / 1e6:.0f} MB)...", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    rng = random.Random(f"{seed}-{total}")
    small_budget = total // 50
    small = written = 0
    files = 0
    while small < small_budget:
        d = root / "small" / f"d{files // 100:03d}"
        d.mkdir(parents=True, exist_ok=True)
        size = min(rng.randrange(1 << 10, 64 << 10), small_budget - small)
        (d / f"f{files:05d}").write_bytes(rng.randbytes(size))
        small += size
        files += 1
    (root / "large").mkdir(parents=True, exist_ok=True)
    large: list[str] = []
    left = total - small
    while left > 0:
        size = min(rng.randrange(64, 257) * MiB, left)
        if left - size < 16 * MiB:
            size = left
        rel = f"large/file{len(large):03d}.bin"
        random_file(root / rel, size, f"{seed}-{total}-{rel}")
        large.append(rel)
        left -= size
        written += size
    info = {"key": key, "bytes": small + written, "small_files": files, "small_bytes": small,
            "large_files": large, "large_bytes": written}
    marker.write_text(json.dumps(info))
    return info


def generate_tree(root: Path, files: int, dirs: int, seed: int = SEED) -> dict:
    """``files`` files of 1-4 KiB spread over ``dirs`` directories."""
    marker = root.with_name(root.name + ".json")
    key = [files, dirs, seed, GEN, "tree"]
    info = load_marker(marker, key)
    if info is not None and root.is_dir():
        return info
    print(f"generating {root} ({files} files)...", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    rng = random.Random(f"{seed}-tree")
    per_dir = -(-files // dirs)
    total = 0
    for i in range(files):
        d = root / f"dir{i // per_dir:03d}"
        if i % per_dir == 0:
            d.mkdir(parents=True)
        size = rng.randrange(1 << 10, 4 << 10)
        (d / f"file{i:06d}").write_bytes(rng.randbytes(size))
        total += size
    info = {"key": key, "files": files, "dirs": dirs, "bytes": total}
    marker.write_text(json.dumps(info))
    return info


def ensure_layer(store: Store, src: Path, name: str, version: str) -> tuple[str, float]:
    """The layer's manifest digest; builds and publishes it unless the ref exists."""
    refstore = RefStore(store)
    digest = refstore.read_ref(LAYERS, name, version)
    if digest is not None:
        return digest, 0.0
    print(f"building {name}@{version}...", flush=True)
    start = time.perf_counter()
    res = build_layer(RefStore(store), str(src), BuildOptions(name, version))
    return res.digest, time.perf_counter() - start


def ensure_local_copy(store: FileStore, digest: str, out: Path) -> tuple[Path, Path]:
    """The layer's meta image and materialized data blob as local files."""
    marker = out / "digest"
    meta, blob = out / "meta.erofs", out / "blob"
    if marker.exists() and marker.read_text() == digest and meta.exists() and blob.exists():
        return meta, blob
    print(f"materializing a local copy of {digest[:19]}...", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    refstore = RefStore(store)
    manifest = refstore.layer(digest)
    meta.write_bytes(refstore.meta_image(manifest))
    materialize_blob(store, refstore.chunk_table(manifest), str(blob))
    marker.write_text(digest)
    return meta, blob


# The baseline daemon of the meta image checks: the same CLI with both checks
# patched out (the image's structure is not checked when it is fetched, and it
# is opened, not hashed, before a mount). Only this benchmark starts it.
UNCHECKED_DAEMON = [sys.executable, "-c", """
import os, sys
import layerfs.refstore as registry
import layerfs.node.replica.replica as replica
registry.check_meta_image = lambda *args: None
replica.open_matching = lambda layer: os.open(layer.meta_path, os.O_RDONLY | os.O_CLOEXEC)
from layerfs.cli.main import main
sys.argv[0] = "layerfs"
main()
"""]



# -- the machine ------------------------------------------------------------------

def read_files(paths: list[Path], bufsize: int = MiB) -> tuple[int, float]:
    """Read the files one after another, whole; (bytes, seconds)."""
    buf = bytearray(bufsize)
    total = 0
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total, time.perf_counter() - start


def get_packs(store: Store, packs: list[str], parallel: int) -> tuple[int, float]:
    """GET every pack whole with ``parallel`` threads; (bytes, seconds)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        total = sum(pool.map(lambda d: len(store.get(blob_key(d))), packs))
    return total, time.perf_counter() - start


def walk_lstat(top: Path) -> tuple[int, float]:
    """``os.walk`` plus an ``lstat`` of every entry; (entries, seconds)."""
    start = time.perf_counter()
    count = 0
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            os.lstat(os.path.join(dirpath, name))
            count += 1
    return count, time.perf_counter() - start


def run_find(top: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["find", str(top), "-printf", ""], check=True)
    return time.perf_counter() - start


def alternate(rep: int, a: Callable[[], None], b: Callable[[], None]) -> None:
    """Run both, swapping which goes first on odd repetitions."""
    for fn in ((a, b) if rep % 2 == 0 else (b, a)):
        fn()


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / 1e6 / seconds


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- the benchmarks -------------------------------------------------------------

class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.store_dir = work / "store"
        self.store_url = "file://" + str(self.store_dir)
        self.store = FileStore(str(self.store_dir))
        self.oddities: list[str] = []
        self.daemons = DaemonRuns(work, self.oddities, args.cache_size, request_timeout=900,
                                  daemon_args=DaemonRuns.options(args))

    def node(self, tag: str, store_args: list[str] | None = None) -> DaemonProcess:
        """A daemon on a fresh, empty ROOT (no cache, no replica)."""
        root = clear_dir(self.work / "roots" / "node", self.oddities)
        return self.daemons.start(root, tag, store_args or ["--store", self.store_url])

    def finish(self, node: DaemonProcess) -> None:
        self.daemons.finish(node, remove_root=True)

    def node_unchecked(self, tag: str) -> DaemonProcess:
        """A daemon on a fresh ROOT without the meta image check (the baseline)."""
        saved = harness.daemonproc.LAYERFS
        harness.daemonproc.LAYERFS = UNCHECKED_DAEMON
        try:
            return self.node(tag)
        finally:
            harness.daemonproc.LAYERFS = saved

    # 6. the checks of the node's own disk
    def meta_check(self, layers: dict[str, dict]) -> dict:
        """The sha256 check of each layer's meta image, page cache warm (as
        on a first mount, right after the image was written) and cold (a
        remount after a restart), in this process; median of 5 / 3."""
        out = {}
        for label, layer in layers.items():
            refstore = RefStore(self.store)
            image = self.work / "trust" / f"meta-{label.lower()}.erofs"
            image.parent.mkdir(parents=True, exist_ok=True)
            image.write_bytes(refstore.meta_image(refstore.layer(layer["digest"])))
            fd = os.open(image, os.O_RDONLY)
            try:
                cold, warm = [], []
                for _ in range(3):
                    drop_caches()
                    cold.append(timed(functools.partial(fd_sha256, fd)))
                for _ in range(5):
                    warm.append(timed(functools.partial(fd_sha256, fd)))
            finally:
                os.close(fd)
            out[label] = {"meta_bytes": image.stat().st_size,
                          "warm_ms": round(statistics.median(warm) * 1e3, 3),
                          "cold_ms": round(statistics.median(cold) * 1e3, 3)}
            print(f"  meta image check {label:>5} ({out[label]['meta_bytes'] / 1e6:.2f} MB): "
                  f"{out[label]['warm_ms']:.2f} ms warm, {out[label]['cold_ms']:.2f} ms cold",
                  flush=True)
        return out

    def up_checked(self, layers: dict[str, dict]) -> dict:
        """``up`` (prefetch none) with the meta image check against a daemon
        without it, alternating, ``samples`` each, on a fresh ROOT: the first
        ``up`` (fetches the layer; mounts the file written from the verified
        image) and, after ``down``, a second one, which mounts the local
        image again (hashed first); page cache dropped before each."""
        out = {}
        for label, layer in layers.items():
            runs: dict[str, list[float]] = {f"{side}_{n}": [] for side in ("checked", "unchecked")
                                            for n in ("first", "again")}
            for i in range(self.args.samples):
                sides = ("checked", "unchecked") if i % 2 == 0 else ("unchecked", "checked")
                for side in sides:
                    tag = f"trust-up-{label}-{side}"
                    node = self.node(tag) if side == "checked" else self.node_unchecked(tag)
                    try:
                        for n in ("first", "again"):
                            drop_caches()
                            start = time.perf_counter()
                            node.request("up", id="s", layers=[layer["ref"]])
                            runs[f"{side}_{n}"].append(time.perf_counter() - start)
                            node.request("down", id="s")
                    finally:
                        self.finish(node)
            out[label] = {key: [round(x, 4) for x in xs] for key, xs in runs.items()}
            for n in ("first", "again"):
                a = statistics.median(runs[f"checked_{n}"])
                b = statistics.median(runs[f"unchecked_{n}"])
                out[label].update({f"checked_{n}_p50_s": round(a, 4),
                                   f"unchecked_{n}_p50_s": round(b, 4),
                                   f"{n}_ratio": round(a / b, 4)})
                print(f"  {n:5} up {label:>5}: {a:.3f} s checked, {b:.3f} s unchecked",
                      flush=True)
        return out

    def cache_check(self, chunks: int = 256) -> dict:
        """Whole reads of ``chunks`` cached 1 MiB chunks (page cache warm, so
        that the check's share is as large as it can be) with the identity
        check against the same reads with it patched out, alternating, 5
        reps; and the check's own time per read (``timeit``)."""
        import timeit

        cache = ChunkCache(clear_dir(self.work / "trust" / "cache", self.oddities), 1 << 34)
        shas = []
        for i in range(chunks):
            data = hashlib.sha256(str(i).encode()).digest() * (MiB // 32)
            sha = hashlib.sha256(data).hexdigest()
            cache.write(sha, data)
            shas.append(sha)
        real = chunkfile.check_identity
        rates: dict[str, list[float]] = {"checked": [], "unchecked": []}

        def read_all(side: str) -> None:
            chunkfile.check_identity = real if side == "checked" else (lambda named, sha: None)
            try:
                start = time.perf_counter()
                total = sum(len(cache.read(sha) or b"") for sha in shas)
                rates[side].append(mbps(total, time.perf_counter() - start))
            finally:
                chunkfile.check_identity = real
            if total != chunks * MiB:
                self.oddities.append(f"cache check: read {total} of {chunks * MiB} bytes")

        read_all("checked")  # one untimed pass: both sides start with the files cached
        rates["checked"].clear()
        for rep in range(5):
            alternate(rep, lambda: read_all("checked"), lambda: read_all("unchecked"))
        named = bytes.fromhex(shas[0])
        loops = 200_000
        check_ns = timeit.timeit(lambda: real(named, bytes.fromhex(shas[0])),
                                 number=loops) / loops * 1e9
        a, b = statistics.median(rates["checked"]), statistics.median(rates["unchecked"])
        print(f"  cache reads: {a:.0f} MB/s checked, {b:.0f} MB/s unchecked; "
              f"the check: {check_ns:.0f} ns per read", flush=True)
        return {"chunks": chunks, "chunk_bytes": MiB,
                "checked_mb_s": [round(x, 1) for x in rates["checked"]],
                "unchecked_mb_s": [round(x, 1) for x in rates["unchecked"]],
                "checked_p50_mb_s": round(a, 1), "unchecked_p50_mb_s": round(b, 1),
                "ratio": round(a / b, 4), "check_ns_per_read": round(check_ns, 1)}

    # 5. many sandboxes at once
    def many(self, layer: dict, count: int) -> dict:
        """``count`` sandboxes up at once (16 requests in flight) on one shared layer."""
        from concurrent.futures import ThreadPoolExecutor

        node = self.node("many")
        try:
            rss_start = node.proc_status()["rss_bytes"] // 1024
            start = time.perf_counter()
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda i: node.request("up", id=f"m{i:04d}",
                                                     layers=[layer["ref"]]), range(count)))
            up_s = time.perf_counter() - start
            rss_up = node.proc_status()["rss_bytes"] // 1024
            start = time.perf_counter()
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda i: node.request("down", id=f"m{i:04d}"), range(count)))
            down_s = time.perf_counter() - start
            hwm = node.proc_status()["peak_rss_bytes"] // 1024
        finally:
            self.finish(node)
        print(f"  {count} sandboxes: up {count / up_s:.0f}/s, down {count / down_s:.0f}/s, "
              f"RSS {rss_start / 1024:.0f} -> {rss_up / 1024:.0f} MiB (peak {hwm / 1024:.0f})",
              flush=True)
        return {"sandboxes": count, "up_seconds": round(up_s, 3),
                "up_per_second": round(count / up_s, 1), "down_seconds": round(down_s, 3),
                "down_per_second": round(count / down_s, 1), "rss_start_kb": rss_start,
                "rss_all_up_kb": rss_up, "rss_peak_kb": hwm}

    # 1. cold up
    def up_latency(self, layers: dict[str, dict]) -> dict:
        out: dict[str, dict] = {label: {"none": [], "full": []} for label in layers}
        details: dict[str, list] = {label: [] for label in layers}
        for i in range(self.args.samples):
            for label, layer in layers.items():
                modes = ("none", "full") if i % 2 == 0 else ("full", "none")
                for mode in modes:
                    node = self.node(f"up-{label}-{mode}")
                    try:
                        drop_caches()
                        start = time.perf_counter()
                        node.request("up", id="s", layers=[layer["ref"]], prefetch=mode)
                        took = time.perf_counter() - start
                        fetched = node.request("stats")["cache"]["bytes_fetched"]
                        start = time.perf_counter()
                        node.request("down", id="s")
                        down = time.perf_counter() - start
                    finally:
                        self.finish(node)
                    out[label][mode].append(took)
                    details[label].append({"prefetch": mode, "up_s": round(took, 4),
                                           "down_s": round(down, 4), "bytes_fetched": fetched})
                    print(f"  up {label:>5} prefetch={mode:4}: {took:7.3f} s "
                          f"(fetched {fetched / 1e6:.0f} MB)", flush=True)
        result = {}
        for label, modes in out.items():
            lazy, full = statistics.median(modes["none"]), statistics.median(modes["full"])
            result[label] = {"blob_bytes": layers[label]["blob_bytes"],
                             "lazy_samples_s": [round(x, 4) for x in modes["none"]],
                             "full_samples_s": [round(x, 4) for x in modes["full"]],
                             "lazy_p50_s": round(lazy, 4), "full_p50_s": round(full, 4),
                             "lazy_over_full": round(lazy / full, 4),
                             "runs": details[label]}
        return result

    # 2. warm reads
    def warm_read(self, layer: dict, local: tuple[Path, Path]) -> dict:
        mnt = self.work / "mnt" / "local"
        detach_mounts(mnt)
        mnt.mkdir(parents=True, exist_ok=True)
        node = self.node("warm")
        lfs: list[tuple[int, float]] = []
        base: list[tuple[int, float]] = []
        cpu: list[float] = []
        try:
            rootfs = Path(node.request("up", id="w", layers=[layer["ref"]])["sandbox"]["rootfs"])
            mount_erofs(str(local[0]), str(local[1]), str(mnt))
            try:
                drop_caches()
                first = read_files([rootfs / p for p in layer["large_files"]])
                stats_before = node.request("stats")
                print(f"  warm-up read (cold cache): {mbps(*first):.0f} MB/s", flush=True)
                drop_caches()  # and one untimed read of the local copy: both start warm
                local_first = read_files([mnt / p for p in layer["large_files"]])
                print(f"  warm-up read (local copy): {mbps(*local_first):.0f} MB/s", flush=True)

                def sandbox() -> None:
                    drop_caches()
                    assert node.proc is not None
                    cpu0 = cpu_seconds(node.proc.pid)
                    lfs.append(read_files([rootfs / p for p in layer["large_files"]]))
                    cpu.append(cpu_seconds(node.proc.pid) - cpu0)
                    print(f"  warm sandbox read: {mbps(*lfs[-1]):7.1f} MB/s "
                          f"(daemon CPU {cpu[-1]:.1f} s)", flush=True)

                def kernel() -> None:
                    drop_caches()
                    base.append(read_files([mnt / p for p in layer["large_files"]]))
                    print(f"  local EROFS read:  {mbps(*base[-1]):7.1f} MB/s", flush=True)

                for rep in range(self.args.reps):
                    alternate(rep, sandbox, kernel)
                stats_after = node.request("stats")
            finally:
                umount(str(mnt))
            node.request("down", id="w")
        finally:
            self.finish(node)
        lfs_rate = statistics.median(mbps(*r) for r in lfs)
        base_rate = statistics.median(mbps(*r) for r in base)
        return {"bytes": lfs[0][0], "files": len(layer["large_files"]),
                "first_read_mb_s": round(mbps(*first), 1),
                "local_first_read_mb_s": round(mbps(*local_first), 1),
                "layerfs_mb_s": [round(mbps(*r), 1) for r in lfs],
                "local_erofs_mb_s": [round(mbps(*r), 1) for r in base],
                "layerfs_p50_mb_s": round(lfs_rate, 1), "local_erofs_p50_mb_s": round(base_rate, 1),
                "ratio": round(lfs_rate / base_rate, 4), "daemon_cpu_s": [round(c, 2) for c in cpu],
                "cache_before": stats_before["cache"], "cache_after": stats_after["cache"]}

    # 3. cold reads
    def cold_read(self, layer: dict, store: Store | None = None,
                  store_args: list[str] | None = None) -> dict:
        """Against the file store under the work dir, or ``store`` (its daemon
        arguments ``store_args``)."""
        open_it = (lambda: FileStore(str(self.store_dir))) if store is None else (lambda: store)
        tag = "cold" if store is None else "cold-s3"
        lfs: list[tuple[int, float]] = []
        base: list[tuple[int, float]] = []
        caches: list[dict] = []
        cpu: list[float] = []
        single: list[tuple[int, float]] = []
        refstore = RefStore(open_it())
        packs = refstore.chunk_table(refstore.layer(layer["digest"])).packs()

        def sandbox() -> None:
            node = self.node(tag, store_args)
            try:
                rootfs = Path(node.request("up", id="c", layers=[layer["ref"]])
                              ["sandbox"]["rootfs"])
                drop_caches()
                assert node.proc is not None
                cpu0 = cpu_seconds(node.proc.pid)
                lfs.append(read_files([rootfs / p for p in layer["large_files"]]))
                cpu.append(cpu_seconds(node.proc.pid) - cpu0)
                caches.append(node.request("stats")["cache"])
                node.request("down", id="c")
            finally:
                self.finish(node)
            print(f"  cold sandbox read: {mbps(*lfs[-1]):7.1f} MB/s "
                  f"(daemon CPU {cpu[-1]:.1f} s)", flush=True)

        def store_get() -> None:
            drop_caches()
            base.append(get_packs(open_it(), packs, self.args.get_parallel))
            drop_caches()
            single.append(get_packs(open_it(), packs, 1))
            print(f"  store GET (packs): {mbps(*base[-1]):7.1f} MB/s "
                  f"(1 thread: {mbps(*single[-1]):.1f} MB/s)", flush=True)

        for rep in range(self.args.reps):
            alternate(rep, sandbox, store_get)
        lfs_rate = statistics.median(mbps(*r) for r in lfs)
        base_rate = statistics.median(mbps(*r) for r in base)
        return {"bytes": lfs[0][0], "pack_bytes": base[0][0], "packs": len(packs),
                "get_parallel": self.args.get_parallel,
                "layerfs_mb_s": [round(mbps(*r), 1) for r in lfs],
                "store_get_mb_s": [round(mbps(*r), 1) for r in base],
                "store_get_1_thread_mb_s": [round(mbps(*r), 1) for r in single],
                "daemon_cpu_s": [round(c, 2) for c in cpu],
                "layerfs_p50_mb_s": round(lfs_rate, 1), "store_get_p50_mb_s": round(base_rate, 1),
                "ratio": round(lfs_rate / base_rate, 4), "cache": caches}

    # 4. metadata
    def metadata(self, layer: dict, local: tuple[Path, Path]) -> dict:
        mnt = self.work / "mnt" / "meta"
        detach_mounts(mnt)
        mnt.mkdir(parents=True, exist_ok=True)
        node = self.node("meta")
        lfs: list[tuple[int, float]] = []
        base: list[tuple[int, float]] = []
        lfs_find: list[float] = []
        base_find: list[float] = []
        try:
            rootfs = Path(node.request("up", id="m", layers=[layer["ref"]])["sandbox"]["rootfs"])
            mount_erofs(str(local[0]), str(local[1]), str(mnt))
            try:
                def sandbox() -> None:
                    drop_caches()
                    lfs.append(walk_lstat(rootfs))
                    drop_caches()
                    lfs_find.append(run_find(rootfs))
                    print(f"  sandbox walk+lstat: {lfs[-1][1]:6.3f} s ({lfs[-1][0]} entries), "
                          f"find: {lfs_find[-1]:6.3f} s", flush=True)

                def kernel() -> None:
                    drop_caches()
                    base.append(walk_lstat(mnt))
                    drop_caches()
                    base_find.append(run_find(mnt))
                    print(f"  local   walk+lstat: {base[-1][1]:6.3f} s ({base[-1][0]} entries), "
                          f"find: {base_find[-1]:6.3f} s", flush=True)

                for rep in range(self.args.reps):
                    alternate(rep, sandbox, kernel)
                cache = node.request("stats")["cache"]
            finally:
                umount(str(mnt))
            node.request("down", id="m")
        finally:
            self.finish(node)
        if {n for n, _ in lfs} != {n for n, _ in base}:
            self.oddities.append(f"metadata walk: entry counts differ: sandbox "
                                 f"{[n for n, _ in lfs]}, local {[n for n, _ in base]}")
        walk, walk0 = statistics.median(t for _, t in lfs), statistics.median(t for _, t in base)
        find, find0 = statistics.median(lfs_find), statistics.median(base_find)
        return {"entries": lfs[0][0],
                "layerfs_walk_s": [round(t, 4) for _, t in lfs],
                "local_walk_s": [round(t, 4) for _, t in base],
                "layerfs_find_s": [round(t, 4) for t in lfs_find],
                "local_find_s": [round(t, 4) for t in base_find],
                "layerfs_walk_p50_s": round(walk, 4), "local_walk_p50_s": round(walk0, 4),
                "ratio": round(walk / walk0, 4),
                "layerfs_find_p50_s": round(find, 4), "local_find_p50_s": round(find0, 4),
                "find_ratio": round(find / find0, 4), "cache": cache}


def cold_read_s3(bench: Bench, work: Path, layer: dict) -> dict:
    """The cold read against SeaweedFS S3 on 127.0.0.1 (its data under the work
    dir): the same source built into the bucket (same chunks and packs; the
    manifest differs by its build time), then Bench.cold_read."""
    from bench import corpus
    from layerfs.store.s3 import S3Store

    src = work / "src" / f"data-{layer['label'].lower()}"
    with corpus.seaweedfs(work / "seaweedfs") as server:
        store = S3Store(corpus.BUCKET, "node", endpoint=server.endpoint)
        try:
            digest, _ = ensure_layer(store, src, f"bench/node-{layer['label'].lower()}",
                                     f"g{GEN}-{SEED}")
            args = ["--store", f"s3://{corpus.BUCKET}/node", "--s3-endpoint", server.endpoint]
            return bench.cold_read({**layer, "digest": digest, "ref": digest}, store, args)
        finally:
            store.close()


def layer_info(store: FileStore, digest: str) -> dict:
    refstore = RefStore(store)
    table = refstore.chunk_table(refstore.layer(digest))
    return {"digest": digest, "ref": digest, "blob_bytes": table.blob_size,
            "chunks": len(table), "packs": len(table.packs()),
            "stored_bytes": table.stored_bytes()}


def trust_rows(trust: dict, warm: dict | None) -> list[tuple[str, str, str, str, str]]:
    """Table rows of the check costs; the cache check's share of the warm read
    throughput is its time per 1 MiB chunk over that chunk's time at the
    warm read's rate (this run's, if measured)."""
    rows = []
    for label, m in trust["meta_check"].items():
        rows.append((f"meta image check {label} ({m['meta_bytes'] / 1e6:.2f} MB), ms: "
                     "warm vs cold page cache", f"{m['warm_ms']:.2f}", f"{m['cold_ms']:.2f}",
                     "-", "-"))
    for label, u in trust["up"].items():
        for n, what in (("first", "first up"), ("again", "up again (remount)")):
            rows.append((f"{what} p50 {label} (s): meta check vs without",
                         f"{u[f'checked_{n}_p50_s']:.3f}", f"{u[f'unchecked_{n}_p50_s']:.3f}",
                         f"{u[f'{n}_ratio']:.3f}", "-"))
    c = trust["cache_check"]
    rows.append(("cache whole reads 1 MiB (MB/s): identity check vs without",
                 f"{c['checked_p50_mb_s']:.0f}", f"{c['unchecked_p50_mb_s']:.0f}",
                 f"{c['ratio']:.3f}", ">= 0.95"))
    if warm is not None:
        chunk_s = MiB / (warm["layerfs_p50_mb_s"] * 1e6)
        share = c["check_ns_per_read"] * 1e-9 / chunk_s
        trust["cache_check"]["share_of_warm_read"] = round(share, 6)
        rate = warm["layerfs_p50_mb_s"]
        rows.append((f"identity check per read (ns) vs 1 MiB at warm {rate:.0f} MB/s (ns)",
                     f"{c['check_ns_per_read']:.0f}", f"{chunk_s * 1e9:.0f}",
                     f"{share:.5f}", "<= 0.05"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100M,1G,4G", help="layer sizes for the up latency")
    ap.add_argument("--read-size", default=None,
                    help="the layer for the read benchmarks (default: the size nearest 1G)")
    ap.add_argument("--meta-files", type=int, default=50_000)
    ap.add_argument("--meta-dirs", type=int, default=50)
    ap.add_argument("--samples", type=int, default=3, help="cold up samples per size and mode")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each read/walk")
    ap.add_argument("--get-parallel", type=int, default=4,
                    help="threads for the store GET baseline")
    ap.add_argument("--cache-size", default="16G", help="the daemons' --cache-size")
    DaemonRuns.add_arguments(ap)
    ap.add_argument("--many", type=int, default=200, help="sandboxes up at once")
    ap.add_argument("--only", default="up,warm,cold,cold-s3,meta,many,trust",
                    help="comma-separated subset of up,warm,cold,cold-s3,meta,many,trust")
    ap.add_argument("--quick", action="store_true",
                    help="sizes 50M,200M and a 5,000-file tree")
    ap.add_argument("--work", default=str(WORK / "node"))
    ap.add_argument("--out", default=str(RESULTS / "node.json"))
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.meta_files = "50M,200M", 5_000
    if os.geteuid() != 0:
        sys.exit("bench/node.py needs root (FUSE, EROFS and overlay mounts, drop_caches)")
    only = set(args.only.split(","))
    labels = [label_of(s) for s in args.sizes.split(",") if s.strip()]
    read_label = label_of(args.read_size) if args.read_size else min(
        labels, key=lambda s: abs(parse_size(s) - (1 << 30)))
    if read_label not in labels:
        labels.append(read_label)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    detach_mounts(work)  # an interrupted earlier run
    started = time.perf_counter()
    bench = Bench(args, work)
    result: dict[str, Any] = {}
    try:
        layers: dict[str, dict] = {}
        builds = {}
        for label in labels:
            src = work / "src" / f"data-{label.lower()}"
            info = generate_data(src, parse_size(label))
            digest, secs = ensure_layer(bench.store, src, f"bench/node-{label.lower()}",
                                        f"g{GEN}-{SEED}")
            builds[label] = round(secs, 2)
            layers[label] = {**layer_info(bench.store, digest), **info, "label": label}
        meta_src = work / "src" / f"tree-{args.meta_files}"
        meta_info = generate_tree(meta_src, args.meta_files, args.meta_dirs)
        digest, secs = ensure_layer(bench.store, meta_src, f"bench/node-tree{args.meta_files}",
                                    f"g{GEN}-{SEED}")
        builds["tree"] = round(secs, 2)
        meta_layer = {**layer_info(bench.store, digest), **meta_info}
        result["layers"] = {**layers, "tree": meta_layer}
        result["build_seconds"] = builds
        prep = time.perf_counter() - started
        print(f"prepared in {prep:.0f} s", flush=True)
        up_labels = [lb for lb in labels if lb in {label_of(s) for s in args.sizes.split(",")}]
        if "up" in only:
            print("cold up latency (fresh ROOT each)", flush=True)
            result["up"] = bench.up_latency({lb: layers[lb] for lb in up_labels})
        if "warm" in only:
            print(f"warm sequential read, {read_label} layer", flush=True)
            local = ensure_local_copy(bench.store, layers[read_label]["digest"],
                                      work / "local" / read_label.lower())
            result["warm_read"] = bench.warm_read(layers[read_label], local)
        if "cold" in only:
            print(f"cold sequential read, {read_label} layer "
                  f"(store GET with {args.get_parallel} threads)", flush=True)
            result["cold_read"] = bench.cold_read(layers[read_label])
        if "cold-s3" in only:
            print(f"cold sequential read, {read_label} layer, SeaweedFS S3 store "
                  f"(GET with {args.get_parallel} threads)", flush=True)
            result["cold_read_s3"] = cold_read_s3(bench, work, layers[read_label])
        if "meta" in only:
            print(f"metadata walk, {args.meta_files} files", flush=True)
            local = ensure_local_copy(bench.store, meta_layer["digest"],
                                      work / "local" / f"tree-{args.meta_files}")
            result["metadata"] = bench.metadata(meta_layer, local)
        if "many" in only:
            print(f"{args.many} sandboxes up at once on a shared {labels[0]} layer", flush=True)
            result["many"] = bench.many(layers[labels[0]], args.many)
        if "trust" in only:
            print("cost of the checks of the node's own disk", flush=True)
            checked = {**{lb: layers[lb] for lb in up_labels}, "tree": meta_layer}
            result["trust"] = {"meta_check": bench.meta_check(checked),
                               "up": bench.up_checked(checked),
                               "cache_check": bench.cache_check()}
    finally:
        bench.daemons.stop_all()
        left = detach_mounts(work)
        if left:
            bench.oddities.append(f"mounts left under the work dir at the end: {left}")
            print(f"detached leftover mounts: {left}", file=sys.stderr)
    elapsed = time.perf_counter() - started

    rows = []  # (measure, layerfs, baseline, ratio, target)
    if "up" in result:
        for label, r in result["up"].items():
            rows.append((f"cold up p50 {label} (s): lazy vs prefetch full",
                         f"{r['lazy_p50_s']:.3f}", f"{r['full_p50_s']:.3f}",
                         f"{r['lazy_over_full']:.3f}", "lazy <= 0.5 s"))
        ups = list(result["up"].values())
        if len(ups) > 1:
            flat = ups[-1]["lazy_p50_s"] / ups[0]["lazy_p50_s"]
            result["up_flatness"] = round(flat, 3)
            rows.append((f"lazy up p50 (s): {up_labels[-1]} vs {up_labels[0]}",
                         f"{ups[-1]['lazy_p50_s']:.3f}", f"{ups[0]['lazy_p50_s']:.3f}",
                         f"{flat:.2f}", "flat in size"))
    if "warm_read" in result:
        r = result["warm_read"]
        rows.append((f"warm seq read {read_label} (MB/s): sandbox vs local EROFS",
                     f"{r['layerfs_p50_mb_s']:.0f}", f"{r['local_erofs_p50_mb_s']:.0f}",
                     f"{r['ratio']:.2f}", ">= 0.9"))
    for key, store_name in (("cold_read", "store"), ("cold_read_s3", "S3")):
        if key in result:
            r = result[key]
            rows.append((f"cold seq read {read_label} (MB/s): sandbox vs {store_name} GET "
                         f"x{r['get_parallel']}",
                         f"{r['layerfs_p50_mb_s']:.0f}", f"{r['store_get_p50_mb_s']:.0f}",
                         f"{r['ratio']:.2f}", ">= 0.7"))
    if "metadata" in result:
        r = result["metadata"]
        rows.append((f"walk+lstat {r['entries']} entries (s): sandbox vs local EROFS",
                     f"{r['layerfs_walk_p50_s']:.3f}", f"{r['local_walk_p50_s']:.3f}",
                     f"{r['ratio']:.2f}", "<= 1.2"))
        rows.append(("find -printf '' (s): sandbox vs local EROFS",
                     f"{r['layerfs_find_p50_s']:.3f}", f"{r['local_find_p50_s']:.3f}",
                     f"{r['find_ratio']:.2f}", "-"))
    if "many" in result:
        r = result["many"]
        rows.append((f"{r['sandboxes']} sandboxes at once: up/s, daemon RSS MiB all up",
                     f"{r['up_per_second']:.0f}", f"{r['rss_all_up_kb'] / 1024:.0f}", "-", "-"))
    if "trust" in result:
        rows += trust_rows(result["trust"], result.get("warm_read"))
    result = {
        "commit": git_head(),
        "params": {"miss_span": args.miss_span, "sizes": args.sizes, "read_size": read_label,
                   "meta_files": args.meta_files,
                   "meta_dirs": args.meta_dirs, "samples": args.samples, "reps": args.reps,
                   "get_parallel": args.get_parallel, "cache_size": args.cache_size,
                   "chunk_size": MiB, "quick": args.quick},
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        **result,
        "table": [dict(zip(("measure", "layerfs", "baseline", "ratio", "target"), row,
                           strict=True)) for row in rows],
        "daemon_logs": bench.daemons.scan_logs(),
        "oddities": bench.oddities,
        "runtime_s": round(elapsed, 1),
        "method": (
            "Every daemon is a real `layerfs daemon` process on a fresh ROOT under the work "
            "dir, driven through the control API; file:// store on the same local disk. "
            "Page cache dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before every timed "
            "up, read and walk. up: time of the `up` control call, prefetch none vs full, "
            "p50 of the samples, each on a fresh ROOT (empty cache and replica). Warm read: "
            "the large files read once through the sandbox to fill the chunk cache, then read "
            "whole, one after another with 1 MiB reads, through ROOT/sandboxes/ID/rootfs vs a "
            "kernel EROFS file-backed mount of the local meta image + materialized blob. Cold "
            "read: the same reads on a fresh ROOT vs store.get of every pack the chunk table "
            "references, whole, with get_parallel threads (default 4: about what the daemon "
            "has in flight for one sequential reader, its readahead of 4 chunks; a 1-thread "
            "GET is recorded for reference), bytes/s of each side's own bytes. Cold read "
            "S3: the same, with the layer in a SeaweedFS S3 bucket on 127.0.0.1 (no link "
            "limit) and S3 GETs of the packs as the baseline. "
            "Metadata: os.walk + lstat of every entry (and `find -printf ''`) through the "
            "sandbox vs the local EROFS mount. Reads and walks alternate which side goes "
            "first; p50 over reps. drop_caches clears the guest's page cache only: on a VM "
            "the host may still cache the disk, which shows as outliers in the local reads."),
    }
    print(f"\n{'measure':62} {'layerfs':>9} {'baseline':>9} {'ratio':>7}  target")
    for measure, a, b, ratio, target in rows:
        print(f"{measure:62} {a:>9} {b:>9} {ratio:>7}  {target}")
    print_footer(result["daemon_logs"], bench.oddities, f"{elapsed:.0f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
