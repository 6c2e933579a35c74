"""A creation storm on one node: sandboxes from workspaces the node has not seen,
over a base and a toolchain it holds, against the same storm on local trees.

The env of each sandbox: a **base** (``debootstrap --variant=minbase
--include=python3 bookworm``, made once), a **toolchain** (``/opt/tc``:
pure-Python and compiled packages copied from this interpreter's
site-packages: numpy, click, attrs, trio, ...; made once) and a **workspace**
of its own (``/ws``: ``--small-files`` files of 0.6-9 KB in nested
directories and three files of 1-4 MB, random bytes, seeded per workspace),
each a layer in a ``file://`` store under the work directory.

Each rep, for each ``--threads`` value C, both sides in an order that
alternates between reps, each a storm of ``--envs`` creations on C threads:

* **layerfs**: one daemon (``--daemon-args``) on a fresh ROOT for the rep, with
  base and toolchain warm (a sandbox holding them up, the workload run once
  in it); each creation is ``Client.up(env, prefetch="none")`` of a workspace
  new to the node, ``Client.run`` of the workload (runc), ``Client.down``;
* **floor**: the same threads mounting an overlay of the same three trees
  unpacked locally (upper and work dirs of its own) and ``runc run`` of the
  same workload in a bundle over it, then unmounting.

The workload imports packages from the toolchain (``python3 -c 'import
numpy, click, attr, trio, ...'``), ``grep -r`` over the workspace and ``cat``
of its large files. Reported per storm: creations/s, up+run latency (p50,
p99), and for layerfs the store requests (GETs) and daemon CPU seconds per
creation; per C the medians over reps of the per-rep ratios layerfs/floor
(creations/s and p99). After each rep's storms, **node-cached reads**: the
warm sandbox's workspace (held by the node) read whole through the sandbox
against its source tree on the local disk, the page cache dropped before
each, alternating, 3 times. Needs root.

    python -m bench.storm [--threads 4,8] [--envs 12] [--reps 3] [--work DIR]

Prints a table and writes bench/results/storm.json (with the commit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench import RESULTS, WORK, git_head
from bench.daemons import DaemonRuns, clear_dir, cpu_seconds, drop_caches, print_footer
from bench.real_env import load_marker, save_marker, tree_bytes
from layerfs.builder.env import create_env
from layerfs.builder.layer import BuildOptions, build_layer
from layerfs.mounts import Overlay, mount_overlay, umount
from layerfs.node.client import Client
from layerfs.refstore import LAYERS, RefStore
from layerfs.store import open_store

GEN = 1  # bump when the way the trees are made changes
TOOLCHAIN_PACKAGES = ("numpy", "numpy.libs", "click", "attr", "attrs", "trio", "outcome",
                      "sniffio", "sortedcontainers", "idna", "jmespath", "dateutil", "six.py",
                      "packaging", "zstandard", "prometheus_client", "cffi",
                      "_cffi_backend.cpython-311-x86_64-linux-gnu.so", "yaml", "_yaml")
IMPORTS = "numpy, click, attr, trio, idna, jmespath, dateutil, packaging, zstandard"


def workload(imports: str) -> str:
    """The command each sandbox runs: imports from the toolchain, then the workspace read."""
    return (f"PYTHONPATH=/opt/tc python3 -c 'import {imports}' && "
            "grep -r -c zzzz /ws > /dev/null; cat /ws/data/* > /dev/null")



def sh(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


# -- the trees and layers -------------------------------------------------------------------

def ensure_toolchain(work: Path) -> dict:
    """/opt/tc: packages copied from this interpreter's site-packages (once)."""
    tc, marker = work / "toolchain", work / "toolchain.json"
    info = load_marker(marker)
    if info and tc.is_dir() and info.get("gen") == GEN:
        return info
    shutil.rmtree(tc, ignore_errors=True)
    site = Path(sysconfig.get_paths()["purelib"])
    dest = tc / "opt" / "tc"
    dest.mkdir(parents=True)
    for name in TOOLCHAIN_PACKAGES:
        src = site / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy2(src, dest / name)
    files, size = tree_bytes(tc)
    return save_marker(marker, {"gen": GEN, "files": files, "bytes": size})


def given_tree(tree: Path) -> dict:
    files, size = tree_bytes(tree)
    return {"id": f"given-{files}-{size}", "files": files, "bytes": size}


def make_workspace(root: Path, seed: int, small_files: int) -> int:
    """A repository-like tree under ``root/ws``; its bytes."""
    rng = random.Random(seed)
    total = 0
    for i in range(small_files):
        path = root / "ws" / f"pkg{i % 9}" / f"mod{i % 31}" / f"f{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(rng.randint(600, 9000))
        path.write_bytes(data)
        total += len(data)
    for i in range(3):
        path = root / "ws" / "data" / f"big{i}"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(rng.randint(1 << 20, 4 << 20))
        path.write_bytes(data)
        total += len(data)
    return total


class Corpus:
    """The store, the shared layers and the workspaces (made as needed)."""

    def __init__(self, work: Path, small_files: int, base: str | None = None,
                 toolchain: str | None = None) -> None:
        self.work = work
        self.small_files = small_files
        self.store = open_store(f"file://{work / 'store'}")
        self.refstore = RefStore(self.store)
        self.given = base is not None  # trees made elsewhere (a machine without network)
        self.base = Path(base).resolve() if base else work / "base"
        self.toolchain = Path(toolchain).resolve() if toolchain else work / "toolchain"

    def shared(self) -> dict:
        if self.given:
            base_info = given_tree(self.base)
            tc_info = given_tree(self.toolchain)
        else:
            from bench.real_env import ensure_base  # debootstrap: needs the network once

            base_info = ensure_base(self.work)
            tc_info = ensure_toolchain(self.work)
        refs = {}
        for role, tree, info in (("base", self.base, base_info),
                                 ("toolchain", self.toolchain, tc_info)):
            name, version = f"storm/{role}", f"g{GEN}-{info['id']}"
            if self.refstore.read_ref(LAYERS, name, version) is None:
                print(f"pushing {name}@{version}...", flush=True)
                build_layer(self.refstore, str(tree), BuildOptions(name, version, role=role))
            refs[role] = f"{name}@{version}"
        self.refs = refs
        return {"base_bytes": base_info["bytes"], "toolchain_bytes": tc_info["bytes"]}

    def workspace(self, n: int) -> tuple[str, Path]:
        """Env ``n`` (its ref) and its workspace tree, made and pushed once."""
        src = self.work / "ws" / f"{n:04d}"
        name, version = f"storm/ws{n:04d}", f"g{GEN}-{self.small_files}"
        env = f"storm/env{n:04d}@{version}"
        if self.refstore.read_ref(LAYERS, name, version) is None or not src.is_dir():
            shutil.rmtree(src, ignore_errors=True)
            make_workspace(src, seed=n, small_files=self.small_files)
            build_layer(self.refstore, str(src), BuildOptions(name, version))
            create_env(self.refstore, env.split("@")[0], version,
                       [f"{name}@{version}", self.refs["toolchain"], self.refs["base"]])
        return env, src


# -- the two sides --------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def storm(creations: list[Any], threads: int, one: Any) -> dict:
    """Run ``one(item)`` for every item on ``threads`` threads: the rate and latencies."""
    latencies: list[float] = []
    lock = threading.Lock()

    def timed(item: Any) -> None:
        start = time.perf_counter()
        one(item)
        with lock:
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(timed, creations))
    wall = time.perf_counter() - start
    return {"creations": len(creations), "wall_s": round(wall, 3),
            "rate": round(len(creations) / wall, 3),
            "p50_s": round(pct(latencies, 0.5), 3), "p99_s": round(pct(latencies, 0.99), 3)}


class LayerfsSide:
    def __init__(self, runs: DaemonRuns, root: Path, corpus: Corpus, warm_env: str,
                 command: str) -> None:
        self.command = command
        self.node = runs.start(root, "storm", ["--store", f"file://{corpus.work / 'store'}"])
        self.client = Client(root)
        self.client.up("warm", env=warm_env, prefetch="none")
        self.check(self.client.run("warm", ["sh", "-c", command], capture=True))

    @staticmethod
    def check(result: Any) -> None:
        if result.exit_code != 0:
            raise RuntimeError(f"workload failed ({result.exit_code}): {result.stderr!r}")

    def one(self, item: tuple[str, str]) -> None:
        sid, env = item
        self.client.up(sid, env=env, prefetch="none")
        try:
            self.check(self.client.run(sid, ["sh", "-c", self.command], capture=True))
        finally:
            self.client.down(sid)

    def run(self, envs: list[str], threads: int, tag: str) -> dict:
        assert self.node.proc is not None
        gets = self.client.stats().store.get("get", 0)
        cpu = cpu_seconds(self.node.proc.pid)
        out = storm([(f"{tag}-{k}", env) for k, env in enumerate(envs)], threads, self.one)
        out["gets_per_creation"] = round((self.client.stats().store.get("get", 0) - gets)
                                         / len(envs), 1)
        out["daemon_cpu_ms_per_creation"] = round(
            (cpu_seconds(self.node.proc.pid) - cpu) * 1000 / len(envs), 1)
        return out


class FloorSide:
    """Overlays of the local trees and ``runc run``: what a node does without layerfs."""

    def __init__(self, scratch: Path, corpus: Corpus, command: str) -> None:
        self.scratch = scratch
        self.lowers = [str(corpus.toolchain), str(corpus.base)]
        scratch.mkdir(parents=True, exist_ok=True)
        template = scratch / "template"
        template.mkdir(exist_ok=True)
        sh(["runc", "spec"], cwd=template)
        self.config = json.loads((template / "config.json").read_text())
        self.config["process"]["terminal"] = False
        self.config["process"]["args"] = ["sh", "-c", command]
        self.config["root"]["readonly"] = False

    def one(self, item: tuple[str, Path]) -> None:
        cid, ws = item
        d = self.scratch / cid
        for sub in ("upper", "work", "rootfs"):
            (d / sub).mkdir(parents=True)
        mount_overlay(Overlay([str(ws), *self.lowers], str(d / "upper"), str(d / "work")),
                      str(d / "rootfs"))
        try:
            config = dict(self.config, root=dict(self.config["root"], path=str(d / "rootfs")))
            (d / "config.json").write_text(json.dumps(config))
            done = subprocess.run(["runc", "run", "-b", str(d), cid], capture_output=True,
                                  stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                raise RuntimeError(f"floor workload failed: {done.stderr!r}")
        finally:
            umount(str(d / "rootfs"))
            shutil.rmtree(d)

    def run(self, trees: list[Path], threads: int, tag: str) -> dict:
        return storm([(f"floor-{tag}-{k}", ws) for k, ws in enumerate(trees)], threads, self.one)


def read_tree(top: Path) -> tuple[int, float]:
    """Every file under ``top`` read whole: bytes and seconds."""
    start, total = time.perf_counter(), 0
    for dirpath, _, files in os.walk(top):
        for name in files:
            with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                while chunk := f.read(1 << 20):
                    total += len(chunk)
    return total, time.perf_counter() - start


def cached_reads(side: LayerfsSide, corpus: Corpus, warm_env: str, reps: int = 3) -> dict:
    """The warm env's workspace, which the node holds, read whole through the
    warm sandbox against its source tree on the local disk, the page cache
    dropped before each, alternating: node-cached data as sandboxes read it."""
    _, src = corpus.workspace(0)
    rootfs = Path(side.client.sandbox("warm").rootfs)  # type: ignore[union-attr]
    times: dict[str, list[float]] = {"sandbox": [], "local": []}
    for rep in range(reps):
        for which in (("sandbox", "local") if rep % 2 == 0 else ("local", "sandbox")):
            drop_caches()
            _, secs = read_tree((rootfs if which == "sandbox" else src) / "ws")
            times[which].append(secs)
    ratios = [loc / sbx for sbx, loc in zip(times["sandbox"], times["local"], strict=True)]
    return {"sandbox_s": times["sandbox"], "local_s": times["local"],
            "speed_ratio": round(statistics.median(ratios), 3)}


# -- the run --------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="4,8", help="scheduler threads C, comma-separated")
    ap.add_argument("--envs", type=int, default=12, help="creations per storm")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--small-files", type=int, default=400)
    ap.add_argument("--base", help="a base tree made elsewhere (default: debootstrap, once)")
    ap.add_argument("--toolchain", help="a toolchain tree made elsewhere (its /opt/tc)")
    ap.add_argument("--imports", default=IMPORTS, help="the packages the workload imports")
    ap.add_argument("--daemon-args", default="", help="more options for the daemon")
    ap.add_argument("--work", default=str(WORK / "storm"))
    ap.add_argument("--out", default=str(RESULTS / "storm.json"))
    args = ap.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    threads = [int(t) for t in args.threads.split(",")]
    oddities: list[str] = []
    started = time.perf_counter()
    corpus = Corpus(work, args.small_files, args.base, args.toolchain)
    command = workload(args.imports)
    shared = corpus.shared()
    warm_env, _ = corpus.workspace(0)
    per_storm = args.envs
    n = 1
    runs = DaemonRuns(work, oddities, "20G", daemon_args=args.daemon_args.split())
    results: list[dict] = []
    cached: list[dict] = []
    try:
        for rep in range(args.reps):
            side = LayerfsSide(runs, clear_dir(work / "node", oddities), corpus, warm_env,
                               command)
            floor = FloorSide(clear_dir(work / "floor", oddities), corpus, command)
            for c in threads:
                envs, trees = [], []
                for _ in range(per_storm):
                    env, tree = corpus.workspace(n)
                    envs.append(env)
                    trees.append(tree)
                    n += 1
                order = ["layerfs", "floor"] if rep % 2 == 0 else ["floor", "layerfs"]
                row: dict[str, Any] = {"rep": rep, "threads": c, "order": order}
                for which in order:
                    tag = f"r{rep}c{c}"
                    row[which] = (side.run(envs, c, tag) if which == "layerfs"
                                  else floor.run(trees, c, tag))
                row["rate_ratio"] = round(row["layerfs"]["rate"] / row["floor"]["rate"], 3)
                row["p99_ratio"] = round(row["layerfs"]["p99_s"] / row["floor"]["p99_s"], 3)
                results.append(row)
                print(json.dumps(row), flush=True)
            cached.append(cached_reads(side, corpus, warm_env))
            print(json.dumps({"rep": rep, "cached_reads": cached[-1]}), flush=True)
            side.client.down("warm")
            runs.finish(side.node)
    finally:
        runs.stop_all()
    summary = {}
    print(f"\n{'C':>3} {'layerfs/s':>10} {'floor/s':>8} {'rate ×':>7} {'p99 ×':>6} "
          f"{'GETs/creation':>14} {'daemon CPU ms':>14}")
    for c in threads:
        rows = [r for r in results if r["threads"] == c]
        med = {k: statistics.median(r[k] for r in rows) for k in ("rate_ratio", "p99_ratio")}
        lf = {k: statistics.median(r["layerfs"][k] for r in rows)
              for k in ("rate", "p99_s", "gets_per_creation", "daemon_cpu_ms_per_creation")}
        fl = {k: statistics.median(r["floor"][k] for r in rows) for k in ("rate", "p99_s")}
        summary[c] = {"rate_ratio": med["rate_ratio"], "p99_ratio": med["p99_ratio"],
                      "layerfs": lf, "floor": fl}
        print(f"{c:>3} {lf['rate']:>10.2f} {fl['rate']:>8.2f} {med['rate_ratio']:>7.2f} "
              f"{med['p99_ratio']:>6.2f} {lf['gets_per_creation']:>14.1f} "
              f"{lf['daemon_cpu_ms_per_creation']:>14.1f}")
    if cached:
        ratio = statistics.median(c["speed_ratio"] for c in cached)
        summary["cached_reads_speed_ratio"] = ratio
        print(f"node-cached workspace read whole, page cache dropped: {ratio:.2f}x the speed "
              "of the same tree on the local disk")
    out = {"commit": git_head(), "machine": platform.node(), "cpus": os.cpu_count(),
           "args": vars(args), "workload": command, "shared": shared,
           "reps": results, "cached_reads": cached, "summary": summary, "logs": runs.scan_logs()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print_footer(out["logs"], oddities, f"{time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
