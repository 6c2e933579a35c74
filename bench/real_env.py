"""A real env, cold: a project's test suite in a Debian base + Python toolchain +
workspace, lazy against eager, over the same throttled link as bench/lazy_vs_prefetch.py.

Layers (made once, cached under the work dir; the network is needed only then):

* base: ``debootstrap --variant=minbase --include=python3,python3-venv bookworm``
  (apt caches and lists removed, as in container images);
* toolchain: ``/opt/venv``, a virtualenv made INSIDE the base (chroot, with the
  base's own python3, on an overlay so the base stays untouched) with ``--wheels``
  installed from wheels that the host's pip downloaded (no network in the chroot);
* workspace: the unpacked sdist of ``--project`` (``pip download --no-binary :all:
  --no-deps``) under ``/workspace``, with its tests.

They are pushed to the SeaweedFS store of the bench (``s3://layerfs-bench/real``,
127.0.0.1) unless ``--store`` names another, as one env. Then, ``--reps`` times
each (alternating which goes first), on a fresh daemon ROOT with the page cache
dropped: ``up`` (prefetch ``none`` = lazy, or ``full`` = eager) and ``layerfs run
ID --root R -- sh -c 'cd /workspace/PROJECT && python3 -m pytest -q'`` (the venv
first on PATH); the cold start is up + test. After each lazy rep, the same test
once more on the same node (``warm``: chunk cache filled, page cache dropped).
Reported: times, the bytes fetched from the store and their fraction of the
image's bytes, and the test's result line.

    python -m bench.real_env [--project iniconfig] [--wheels pytest,attrs] [--reps 3]
                             [--rate-mbit 1000] [--latency-ms 1] [--throttle auto]
                             [--miss-span 128K] (the daemons' --miss-span)

Needs root. Prints a table and writes bench/results/real_env.json.

``--workload debian`` measures fetch granularity instead (issue 15's workload):
a plain ``debootstrap --variant=minbase bookworm`` tree as one layer, built once
per ``--chunk-sizes``, and for each chunk size and each ``--miss-spans`` value,
``--reps`` alternating cold runs (fresh ROOT, page cache dropped, ``up
--prefetch none``) of ``apt-get --version; dpkg -l; perl -e 1; ls -lR
/usr/share/doc; bash --version`` through ``layerfs run``. Reported per setting:
the bytes fetched (and their fraction of the layer's blob), the store GETs of
the whole run, and the cold start; written to bench/results/granularity.json.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench import RESULTS, WORK, corpus, git_head
from bench.daemons import DaemonRuns, clear_dir, drop_caches, print_footer
from bench.lazy_vs_prefetch import Throttle, store_port
from harness.daemonproc import LAYERFS, DaemonProcess, detach_mounts
from layerfs.builder.env import create_env
from layerfs.builder.layer import BuildOptions, build_layer
from layerfs.node.daemon.service import mounts_under
from layerfs.refstore import LAYERS, RefStore
from layerfs.store import open_store

GEN = 1  # bump when the way the layers are made changes
DEFAULT_URL = f"s3://{corpus.BUCKET}/real"
SUITE = "bookworm"


def sh(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def load_marker(path: Path) -> dict | None:
    if path.exists():
        info = json.loads(path.read_text())
        if info.get("gen") == GEN:
            return info
    return None


def save_marker(path: Path, info: dict) -> dict:
    info = {"gen": GEN, "id": uuid.uuid4().hex[:12], "created": time.time(), **info}
    path.write_text(json.dumps(info, indent=1))
    return info


def debian_mirror() -> str:
    """The host's Debian mirror (apt sources), else deb.debian.org."""
    for src in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        with contextlib.suppress(OSError):
            for line in src.read_text().splitlines():
                m = (re.match(r"\s*URIs:\s*(\S+)", line)
                     or re.match(r"\s*deb\s+(?:\[.*?\]\s+)?(\S+)", line))
                if m and "security" not in m.group(1) and m.group(1).startswith("http"):
                    return m.group(1)
    return "http://deb.debian.org/debian"


def tree_bytes(path: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            files += 1
            size += st.st_size
    return files, size


# -- the three layers' sources ------------------------------------------------------------

def finish_debootstrap(tmp: Path, base: Path) -> None:
    """Drop the downloaded packages and lists from a debootstrap tree, then move it into place."""
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (tmp / sub).glob("*"):
            if p.is_file() and p.name != "lock":
                p.unlink()
    tmp.rename(base)


def ensure_base(work: Path) -> dict:
    base, marker = work / "base", work / "base.json"
    info = load_marker(marker)
    if info and base.is_dir():
        return info
    if not shutil.which("debootstrap"):
        print("installing debootstrap...", flush=True)
        sh(["apt-get", "update", "-qq"])
        sh(["apt-get", "install", "-y", "-qq", "debootstrap"],
           env=os.environ | {"DEBIAN_FRONTEND": "noninteractive"})
    mirror = debian_mirror()
    tmp = work / "base.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    print(f"debootstrap --variant=minbase {SUITE} from {mirror} (once)...", flush=True)
    start = time.perf_counter()
    with open(work / "debootstrap.log", "wb") as log:
        sh(["debootstrap", "--variant=minbase", "--include=python3,python3-venv", SUITE,
            str(tmp), mirror], stdout=log, stderr=subprocess.STDOUT)
    finish_debootstrap(tmp, base)
    files, size = tree_bytes(base)
    return save_marker(marker, {"mirror": mirror, "suite": SUITE, "files": files, "bytes": size,
                                "seconds": round(time.perf_counter() - start, 1)})


def ensure_wheels(work: Path, wheels: list[str]) -> Path:
    out, marker = work / "wheels", work / "wheels.json"
    info = load_marker(marker)
    if info and info.get("wheels") == wheels and out.is_dir():
        return out
    shutil.rmtree(out, ignore_errors=True)
    print(f"pip download {' '.join(wheels)} (once)...", flush=True)
    sh([sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:", "--dest",
        str(out), "--python-version", "3.11", "--implementation", "cp", "--platform",
        "manylinux2014_x86_64", *wheels], stdout=subprocess.DEVNULL)
    save_marker(marker, {"wheels": wheels, "files": sorted(p.name for p in out.iterdir())})
    return out


def ensure_toolchain(work: Path, base_info: dict, wheels: list[str]) -> dict:
    """/opt/venv made inside the base with its own python3, on an overlay whose upper
    directory then holds only the venv (copied out as the toolchain layer)."""
    tc, marker = work / "toolchain", work / "toolchain.json"
    info = load_marker(marker)
    if info and tc.is_dir() and info.get("base") == base_info["id"] and \
            info.get("wheels") == wheels:
        return info
    wheel_dir = ensure_wheels(work, wheels)
    scratch = work / "tc.scratch"
    detach_mounts(scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.rmtree(tc, ignore_errors=True)
    for sub in ("upper", "work", "merged"):
        (scratch / sub).mkdir(parents=True)
    print("making /opt/venv inside the base (chroot)...", flush=True)
    merged = scratch / "merged"
    script = " && ".join([
        f"mount -t overlay overlay -o lowerdir={work / 'base'},upperdir={scratch / 'upper'},"
        f"workdir={scratch / 'work'} {merged}",
        f"mount --rbind /dev {merged}/dev", f"mount -t proc proc {merged}/proc",
        f"mkdir -p {merged}/tmp/wheels", f"mount --bind {wheel_dir} {merged}/tmp/wheels",
        f"chroot {merged} /usr/bin/python3 -m venv /opt/venv",
        f"chroot {merged} /opt/venv/bin/pip install -q --no-index --no-cache-dir "
        f"--disable-pip-version-check --find-links /tmp/wheels {' '.join(wheels)}",
    ])
    sh(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
       env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8"})
    (tc / "opt").mkdir(parents=True)
    sh(["cp", "-a", str(scratch / "upper" / "opt" / "venv"), str(tc / "opt" / "venv")])
    shutil.rmtree(scratch, ignore_errors=True)
    files, size = tree_bytes(tc)
    return save_marker(marker, {"base": base_info["id"], "wheels": wheels, "files": files,
                                "bytes": size})


def ensure_workspace(work: Path, project: str) -> dict:
    ws, marker = work / "workspace", work / "workspace.json"
    info = load_marker(marker)
    if info and ws.is_dir() and info.get("project") == project:
        return info
    shutil.rmtree(ws, ignore_errors=True)
    dl = work / "sdist"
    shutil.rmtree(dl, ignore_errors=True)
    print(f"pip download --no-binary :all: {project} (once)...", flush=True)
    sh([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
        "--dest", str(dl), project], stdout=subprocess.DEVNULL)
    sdist = next(p for p in dl.iterdir() if p.name.endswith((".tar.gz", ".zip")))
    (ws / "workspace").mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(ws / "workspace", filter="data")
    top = next((ws / "workspace").iterdir())
    files, size = tree_bytes(ws)
    return save_marker(marker, {"project": project, "sdist": sdist.name, "dir": top.name,
                                "src_layout": (top / "src").is_dir(), "files": files,
                                "bytes": size})


def push(store: Any, work: Path, parts: dict[str, dict]) -> tuple[str, dict]:
    """Build and publish the three layers (unless their refs exist) and the env."""
    refstore = RefStore(store)
    refs, layers = [], {}
    for role in ("workspace", "toolchain", "base"):
        name, version = f"bench/real/{role}", f"g{GEN}-{parts[role]['id']}"
        digest = refstore.read_ref(LAYERS, name, version)
        built = 0.0
        if digest is None:
            print(f"pushing {name}@{version}...", flush=True)
            start = time.perf_counter()
            digest = build_layer(refstore, str(work / role),
                                 BuildOptions(name, version, role=role)).digest
            built = time.perf_counter() - start
        manifest = refstore.layer(digest)
        table = refstore.chunk_table(manifest)
        layers[role] = {"ref": f"{name}@{version}", "digest": digest,
                        "files": parts[role]["files"], "file_bytes": parts[role]["bytes"],
                        "blob_bytes": table.blob_size, "chunks": len(table),
                        "stored_bytes": table.stored_bytes(),
                        "meta_bytes": manifest.meta.size, "build_s": round(built, 1)}
        refs.append(f"{name}@{version}")
    version = f"g{GEN}-{hashlib.sha256(json.dumps(refs).encode()).hexdigest()[:12]}"
    create_env(refstore, "bench/real/env", version, refs)
    return f"bench/real/env@{version}", layers


# -- the measurement ------------------------------------------------------------------------

def run_test(root: Path, sid: str, cmd: str) -> tuple[float, int, str]:
    """``layerfs run`` of ``cmd`` in the sandbox; (seconds, exit status, last line)."""
    start = time.perf_counter()
    proc = subprocess.run([*LAYERFS, "run", sid, "--root", str(root), "--", "sh", "-c", cmd],
                          capture_output=True, text=True, timeout=1800)
    took = time.perf_counter() - start
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return took, proc.returncode, lines[-1] if lines else ""


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, store_args: list[str],
                 throttle: Throttle, env: str, cmd: str) -> None:
        self.args = args
        self.work = work
        self.store_args = store_args
        self.throttle = throttle
        self.env = env
        self.cmd = cmd
        self.oddities: list[str] = []
        self.daemons = DaemonRuns(work, self.oddities, "20G", args.read_timeout,
                                  daemon_args=DaemonRuns.options(args))

    def node(self, tag: str) -> DaemonProcess:
        root = clear_dir(self.work / "node" / tag, self.oddities)
        return self.daemons.start(root, tag, self.store_args)

    def finish(self, node: DaemonProcess) -> None:
        self.daemons.finish(node, remove_root=True)

    def cold(self, mode: str, rep: int) -> dict:
        prefetch = {"lazy": "none", "eager": "full"}[mode]
        node = self.node(mode)
        out: dict[str, Any] = {"mode": mode, "rep": rep}
        try:
            link0 = self.throttle.bytes_through()
            drop_caches()
            start = time.perf_counter()
            node.request("up", id="s", env=self.env, prefetch=prefetch)
            out["up_s"] = round(time.perf_counter() - start, 3)
            secs, code, last = run_test(node.root, "s", self.cmd)
            out.update({"test_s": round(secs, 3), "exit": code, "result": last,
                        "cold_start_s": round(time.perf_counter() - start, 3)})
            stats = node.request("stats")
            out["bytes_fetched"] = stats["cache"]["bytes_fetched"]
            out["chunks_fetched"] = stats["cache"]["entries"]
            link1 = self.throttle.bytes_through()
            if link0 is not None and link1 is not None:
                out["link_bytes_to_node"] = link1["to_node"] - link0["to_node"]
            out["daemon"] = node.proc_status()
            node.request("down", id="s")
            if mode == "lazy":
                node.request("up", id="w", env=self.env)
                drop_caches()
                secs, code, last = run_test(node.root, "w", self.cmd)
                out.update({"warm_test_s": round(secs, 3), "warm_exit": code})
                out["warm_bytes_fetched"] = (node.request("stats")["cache"]["bytes_fetched"]
                                             - out["bytes_fetched"])
                node.request("down", id="w")
        finally:
            self.finish(node)
        if out.get("exit"):
            self.oddities.append(f"{mode} rep {rep}: the test exited {out['exit']}: "
                                 f"{out.get('result')}")
        print(f"  {mode:5} rep {rep}: up {out['up_s']:6.2f} s, test {out['test_s']:6.2f} s, "
              f"cold start {out['cold_start_s']:6.2f} s, fetched "
              f"{out['bytes_fetched'] / 1e6:6.1f} MB" +
              (f"; warm test {out['warm_test_s']:.2f} s" if "warm_test_s" in out else "") +
              f" [{out['result']}]", flush=True)
        return out


# -- fetch granularity on the Debian workload ------------------------------------------------

DEBIAN_CMD = ("apt-get --version; dpkg -l; perl -e 1; ls -lR /usr/share/doc; bash --version")


def ensure_minbase(work: Path) -> dict:
    """A plain bookworm minbase tree (no extra packages), made once."""
    base, marker = work / "minbase", work / "minbase.json"
    info = load_marker(marker)
    if info and base.is_dir():
        return info
    tmp = work / "minbase.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    mirror = debian_mirror()
    print(f"debootstrap --variant=minbase {SUITE} from {mirror} (once)...", flush=True)
    with open(work / "debootstrap-minbase.log", "wb") as log:
        sh(["debootstrap", "--variant=minbase", SUITE, str(tmp), mirror], stdout=log,
           stderr=subprocess.STDOUT)
    finish_debootstrap(tmp, base)
    files, size = tree_bytes(base)
    return save_marker(marker, {"mirror": mirror, "suite": SUITE, "files": files, "bytes": size})


def push_minbase(store: Any, work: Path, info: dict, chunk_size: int) -> dict:
    """The minbase as one layer of ``chunk_size`` chunks, and an env of it."""
    refstore = RefStore(store)
    name, version = "bench/debian/base", f"g{GEN}-{info['id']}-c{chunk_size >> 10}k"
    digest = refstore.read_ref(LAYERS, name, version)
    if digest is None:
        print(f"pushing {name}@{version}...", flush=True)
        digest = build_layer(refstore, str(work / "minbase"),
                             BuildOptions(name, version, role="base",
                                          chunk_size=chunk_size)).digest
    manifest = refstore.layer(digest)
    table = refstore.chunk_table(manifest)
    create_env(RefStore(store), "bench/debian/env", version, [f"{name}@{version}"])
    return {"env": f"bench/debian/env@{version}", "chunk_size": chunk_size,
            "blob_bytes": table.blob_size, "stored_bytes": table.stored_bytes(),
            "chunks": len(table), "meta_bytes": manifest.meta.size,
            "file_bytes": info["bytes"]}


def granularity_run(args: argparse.Namespace, work: Path, store_args: list[str], oddities: list,
                    layer: dict, miss_span: str, rep: int) -> dict:
    runs = DaemonRuns(work, oddities, "20G", args.read_timeout,
                      daemon_args=[*DaemonRuns.options(args), "--miss-span", miss_span])
    node = runs.start(clear_dir(work / "node" / "g", oddities), "g", store_args)
    try:
        drop_caches()
        start = time.perf_counter()
        node.request("up", id="s", env=layer["env"], prefetch="none")
        up_s = time.perf_counter() - start
        secs, code, last = run_test(node.root, "s", DEBIAN_CMD)
        cold = time.perf_counter() - start
        stats = node.request("stats")
        node.request("down", id="s")
    finally:
        runs.finish(node, remove_root=True)
    if code:
        oddities.append(f"chunk {layer['chunk_size']} span {miss_span}: exit {code}: {last}")
    out = {"chunk_size": layer["chunk_size"], "miss_span": miss_span, "rep": rep,
           "up_s": round(up_s, 3), "run_s": round(secs, 3), "cold_start_s": round(cold, 3),
           "bytes_fetched": stats["cache"]["bytes_fetched"],
           "chunks_fetched": stats["cache"]["entries"],
           "store_gets": stats.get("store", {}).get("get"), "exit": code}
    out["fraction"] = round(out["bytes_fetched"] / layer["blob_bytes"], 4)
    print(f"  chunk {layer['chunk_size'] >> 10:5} KiB span {miss_span:>5} rep {rep}: cold "
          f"{cold:5.2f} s, fetched {out['bytes_fetched'] / 1e6:6.1f} MB "
          f"({out['fraction']:.1%}), {out['store_gets']} GETs", flush=True)
    return out


def granularity_main(args: argparse.Namespace, work: Path) -> None:
    info = ensure_minbase(work)
    sizes = [corpus_size(s) for s in args.chunk_sizes.split(",")]
    spans = [s.strip() for s in args.miss_spans.split(",")]
    oddities: list[str] = []
    runs: list[dict] = []
    with contextlib.ExitStack() as stack:
        url, endpoint = args.store or DEFAULT_URL, args.s3_endpoint
        if args.store is None:
            endpoint = stack.enter_context(corpus.seaweedfs()).endpoint
        store = open_store(url, s3_endpoint=endpoint)
        try:
            layers = [push_minbase(store, work, info, size) for size in sizes]
        finally:
            store.close()
        store_args = ["--store", url] + (["--s3-endpoint", endpoint]
                                         if url.startswith("s3://") and endpoint else [])
        settings = [(layer, span) for layer in layers for span in spans]
        for rep in range(args.reps):
            order = settings if rep % 2 == 0 else settings[::-1]
            for layer, span in order:
                runs.append(granularity_run(args, work, store_args, oddities, layer, span, rep))
    table = []
    print(f"\n{'chunk':>7} {'span':>6} {'fetched MB':>11} {'of blob':>8} {'GETs':>6} "
          f"{'cold s':>7}")
    for layer, span in settings:
        rs = [r for r in runs if r["chunk_size"] == layer["chunk_size"] and r["miss_span"] == span]
        row = {"chunk_size": layer["chunk_size"], "miss_span": span,
               "blob_bytes": layer["blob_bytes"],
               **{f"{k}_p50": statistics.median(r[k] for r in rs)
                  for k in ("bytes_fetched", "fraction", "store_gets", "cold_start_s")}}
        table.append(row)
        print(f"{layer['chunk_size'] >> 10:>5}K {span:>6} {row['bytes_fetched_p50'] / 1e6:11.1f} "
              f"{row['fraction_p50']:8.1%} {row['store_gets_p50']:6.0f} "
              f"{row['cold_start_s_p50']:7.2f}")
    result = {"params": {"reps": args.reps, "chunk_sizes": sizes, "miss_spans": spans,
                         "command": DEBIAN_CMD, "store": args.store or DEFAULT_URL,
                         "layer_readahead": args.layer_readahead},
              "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
              "layerfs_commit": git_head(), "source": info, "layers": layers,
              "runs": runs, "summary": table, "oddities": oddities,
              "method": ("Fresh daemon ROOT per run, page cache dropped, up --prefetch none, "
                         "then layerfs run of the command; bytes_fetched: the daemon's "
                         "cache.bytes_fetched (uncompressed chunk bytes); fraction: of the "
                         "layer's data blob; settings alternate order between reps; medians.")}
    out = Path(args.out if args.out_given else RESULTS / "granularity.json")
    out.write_text(json.dumps(result, indent=1))
    for odd in oddities:
        print("oddity:", odd)
    print(f"wrote {out}")


def corpus_size(text: str) -> int:
    from layerfs.sizes import parse_size

    return parse_size(text.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--project", default="iniconfig", help="the PyPI sdist for the workspace")
    ap.add_argument("--wheels", default="pytest,attrs", help="installed in the toolchain venv")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rate-mbit", type=float, default=1000.0)
    ap.add_argument("--latency-ms", type=float, default=1.0)
    ap.add_argument("--throttle", choices=("auto", "tc", "proxy", "none"), default="auto")
    ap.add_argument("--read-timeout", type=float, default=30.0)
    DaemonRuns.add_arguments(ap)
    ap.add_argument("--store", default=None, help="store URL (default: the bench's SeaweedFS)")
    ap.add_argument("--s3-endpoint", default=None)
    ap.add_argument("--work", default=str(WORK / "real"))
    ap.add_argument("--out", default=str(RESULTS / "real_env.json"))
    ap.add_argument("--workload", choices=("pytest", "debian"), default="pytest")
    ap.add_argument("--chunk-sizes", default="1M,256K,64K", help="--workload debian")
    ap.add_argument("--miss-spans", default="0,128K", help="--workload debian")
    args = ap.parse_args()
    args.out_given = "--out" in sys.argv
    if os.geteuid() != 0:
        sys.exit("bench/real_env.py needs root (debootstrap, chroot, mounts)")
    started = time.perf_counter()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.workload == "debian":
        detach_mounts(work)
        granularity_main(args, work)
        return
    detach_mounts(work)
    shutil.rmtree(work / "logs", ignore_errors=True)
    wheels = [w.strip() for w in args.wheels.split(",") if w.strip()]
    base = ensure_base(work)
    tc = ensure_toolchain(work, base, wheels)
    ws = ensure_workspace(work, args.project)
    prep_s = time.perf_counter() - started
    workdir = f"/workspace/{ws['dir']}"
    cmd = (f"cd {workdir} && export PATH=/opt/venv/bin:$PATH"
           + (" PYTHONPATH=src" if ws["src_layout"] else "") + " && python3 -m pytest -q")
    throttle = Throttle(args.throttle, args.rate_mbit, args.latency_ms)
    stack = contextlib.ExitStack()
    bench = None
    runs: list[dict] = []
    try:
        url, endpoint = args.store or DEFAULT_URL, args.s3_endpoint
        if args.store is None:
            endpoint = stack.enter_context(corpus.seaweedfs()).endpoint
        store = open_store(url, s3_endpoint=endpoint)
        try:
            env, layers = push(store, work, {"base": base, "toolchain": tc, "workspace": ws})
        finally:
            store.close()
        host, port = store_port(endpoint if url.startswith("s3://") else None)
        host, port = throttle.start(host, port)
        stack.callback(throttle.stop)
        store_args = ["--store", url]
        if url.startswith("s3://") and endpoint:
            store_args += ["--s3-endpoint", f"{urlsplit(endpoint).scheme or 'http'}://{host}:{port}"]
        print(f"env {env}; link: {throttle.kind} ({throttle.reason})", flush=True)
        print(f"test: {cmd}", flush=True)
        bench = Bench(args, work, store_args, throttle, env, cmd)
        for rep in range(args.reps):
            for mode in (("lazy", "eager") if rep % 2 == 0 else ("eager", "lazy")):
                runs.append(bench.cold(mode, rep))
    finally:
        if bench is not None:
            bench.daemons.stop_all()
        stack.close()
        left = detach_mounts(work)
        if left:
            print(f"detached leftover mounts: {left}", file=sys.stderr)
    assert bench is not None
    if mounts_under(work):
        bench.oddities.append(f"mounts left under the work dir: {mounts_under(work)}")
    elapsed = time.perf_counter() - started
    image_blob = sum(lay["blob_bytes"] for lay in layers.values())
    image_files = sum(lay["file_bytes"] for lay in layers.values())
    summary: dict[str, dict] = {}
    for mode in ("lazy", "eager"):
        rs = [r for r in runs if r["mode"] == mode]
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("up_s", "test_s", "cold_start_s", "bytes_fetched")}
        summary[mode] = {**{f"{k}_p50": round(v, 3) for k, v in med.items()},
                         "fetched_fraction_of_blobs": round(med["bytes_fetched"] / image_blob, 4),
                         "fetched_fraction_of_file_bytes": round(med["bytes_fetched"] / image_files,
                                                                 4),
                         "exits": [r["exit"] for r in rs]}
    warm = [r["warm_test_s"] for r in runs if "warm_test_s" in r]
    summary["warm"] = {"test_s_p50": round(statistics.median(warm), 3) if warm else None}
    ratio = summary["lazy"]["cold_start_s_p50"] / summary["eager"]["cold_start_s_p50"]
    result = {
        "params": {"project": args.project, "wheels": wheels, "reps": args.reps,
                   "read_timeout": args.read_timeout, "miss_span": args.miss_span,
                   "command": cmd},
        "link": throttle.describe(),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        "layerfs_commit": git_head(),
        "sources": {"base": base, "toolchain": tc, "workspace": ws},
        "env": env, "layers": layers, "image_blob_bytes": image_blob,
        "image_file_bytes": image_files, "runs": runs, "summary": summary,
        "cold_start_lazy_over_eager": round(ratio, 3),
        "daemon_logs": bench.daemons.scan_logs(), "oddities": bench.oddities,
        "prepare_s": round(prep_s, 1), "runtime_s": round(elapsed, 1),
        "method": (
            "Fresh daemon ROOT per run, page cache dropped before `up`; cold start = the `up` "
            "control call (lazy: prefetch none; eager: prefetch full, every chunk of the env "
            "before it returns) + `layerfs run ID -- sh -c CMD` (an OCI container through runc "
            "on the sandbox rootfs). bytes_fetched: daemon cache.bytes_fetched "
            "(uncompressed chunk bytes); fraction: of the env's data blobs (files stored inline "
            "in the meta images are not in the blobs; meta images are fetched whole at `up` in "
            "both modes). warm: the test again on the same node after the lazy run, page cache "
            "dropped. Medians over reps; modes alternate which goes first."),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nimage: {sum(lay['files'] for lay in layers.values())} files, "
          f"{image_files / 1e6:.1f} MB ({image_blob / 1e6:.1f} MB in data blobs, "
          f"{sum(lay['meta_bytes'] for lay in layers.values()) / 1e6:.1f} MB of compressed "
          f"meta images)")
    for role, lay in layers.items():
        print(f"  {role:9} {lay['files']:6d} files {lay['file_bytes'] / 1e6:7.1f} MB, "
              f"{lay['chunks']} chunks")
    print(f"\n{'mode':6} {'up s':>7} {'test s':>7} {'cold start s':>13} {'fetched MB':>11} "
          f"{'of image':>9}  test result")
    for mode in ("lazy", "eager"):
        s = summary[mode]
        res = next(r["result"] for r in runs if r["mode"] == mode)
        print(f"{mode:6} {s['up_s_p50']:7.2f} {s['test_s_p50']:7.2f} {s['cold_start_s_p50']:13.2f} "
              f"{s['bytes_fetched_p50'] / 1e6:11.1f} {s['fetched_fraction_of_blobs']:9.1%}  {res}")
    if warm:
        print(f"{'warm':6} {'':7} {summary['warm']['test_s_p50']:7.2f}")
    print(f"\ncold start lazy / eager: {ratio:.2f}x (p50 of {args.reps})")
    print_footer(result["daemon_logs"], bench.oddities,
                 f"{elapsed:.0f} s (preparing {prep_s:.0f} s)")


if __name__ == "__main__":
    main()
