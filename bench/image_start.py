"""Cold start of one image: containerd's full pull against layerfs, side by side.

The image: ``debootstrap --variant=minbase bookworm`` (made once under the work
dir), packed as one gzip OCI layer and pushed with ``skopeo`` into a local
``docker-registry`` on 127.0.0.1 (harness/registryserver.py). The workload:
``apt-get --version; dpkg -l; perl -e 1; ls -lR /usr/share/doc; bash --version``.

* **containerd**: its own containerd (root, state dir and socket under the work
  dir, CRI off, overlayfs snapshotter), started on an empty root; timed:
  ``ctr image pull --plain-http`` (fetch, then unpack into snapshots) +
  ``ctr run --rm`` of the workload (runc through containerd-shim-runc-v2).
* **layerfs**: the image imported once with ``layerfs import docker://...``
  into the store (SeaweedFS S3 on 127.0.0.1, its objects in 1 MiB chunks as
  docs/store.md advises, or ``--store file``); a
  ``layerfs daemon`` started on an empty ROOT; timed: ``layerfs up
  --prefetch none --bundle DIR`` (lazy only; the OCI bundle of the sandbox)
  + ``runc run -b DIR`` with the workload as the bundle's process (what a
  runtime's caller, containerd's shim or a scheduler, does with a bundle).
* **layerfs with a trace**: the same with ``up``'s default ``--prefetch
  auto``, after one lazy run on a node of its own pushed its trace of the
  image's layers to the store (``trace-push``): ``up`` replays it in the
  background while the workload runs (the profiled image of a lazy loader).
* **containerd with the layerfs snapshotter** (lazy, and with the pushed
  trace): the same containerd, with the CRI plugin on and a ``layerfs daemon
  --containerd-snapshotter`` (``--containerd-prefetch none``, or ``auto``
  replaying the pushed trace) as its ``proxy_plugins`` snapshotter, both on
  empty roots; timed: CRI's PullImage (what the kubelet asks: unpacks while
  it pulls, so the imported image's layers are mounted lazily and never
  downloaded) + ``ctr -n k8s.io run --rm --snapshotter layerfs``: the same
  ``ctr run`` path as the containerd side. Disk writes: containerd's and the
  layerfs daemon's.
* **scheduler** (lazy, and with the pushed trace): what a scheduler does,
  from this process with a warm ``layerfs.node.Client`` (made and connected
  before the page cache is dropped; no CLI process): timed ``Client.up`` +
  ``Client.run`` of the workload (output captured), beside the floor below
  (``runc run`` on the unpacked tree), the three alternating which goes first
  rep by rep; the ratios to the floor are per rep (same rep's floor), then
  their median. ``--scheduler-only`` runs only these.
* **local dir** (reference): the workload in the unpacked tree
  (``unshare -m chroot``).
* **floors** (references, each rep): a client's start (``layerfs ps``) with
  the page cache dropped, as ``up``'s is; ``runc run`` of the workload with the
  unpacked tree as the bundle's (read-only) root, caches dropped: the runtime
  path on a local directory, below which no start through runc goes; and the
  store serving the chunks the pushed trace lists (their stored bytes, in
  runs of neighbours of up to 4 MiB, 16 ranged GETs at a time from this
  process, one client made beforehand): what any start that reads those
  bytes waits for at least.

Each cold rep starts from an empty node (containerd root or daemon ROOT
removed, daemon restarted, page cache dropped), the two sides alternating which
goes first. The node's disk writes: ``write_bytes`` of /proc/PID/io of the
node's daemon (containerd, or ``layerfs daemon``) over the timed part, and
``du`` of its root afterwards. The start of a bare layerfs client (``layerfs
ps``) is timed too, warm and cold: ``up`` pays it. Needs root.

    python -m bench.image_start [--reps 3] [--store s3|file] [--quick] [--client LAYERFS]
                                [--scheduler-only] [--daemon-log-level debug]

Prints a table and writes bench/results/image_start.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench import RESULTS, git_head
from bench.daemons import DaemonRuns, clear_dir, drop_caches, print_footer
from bench.latency import relay
from harness.containerdserver import cri_config, cri_pull, proxy_snapshotter_config
from harness.daemonproc import LAYERFS, DaemonProcess, detach_mounts
from layerfs.chunks import pack_runs
from layerfs.formats.chunktable import ChunkEntry
from layerfs.store.base import blob_key

WORKLOAD = ("apt-get --version; dpkg -l; perl -e 1; ls -lR /usr/share/doc; bash --version")
SUITE = "bookworm"
REPO, TAG = "bench/minbase", SUITE
SEAWEED_CHUNK_MB = 1  # the chunk size docs/store.md advises for a layerfs store (0: weed's 4)
ENV_REF = f"{REPO}@1"
FLOOR_FETCHES = 16  # GETs in flight for the store's floor (the daemon's default store fetches)
FLOOR_RUN = 4 << 20  # bytes of neighbouring chunks one of its GETs takes at most
SIDES = ("containerd", "layerfs", "layerfs_trace", "ctr_layerfs", "ctr_layerfs_trace")
PREFETCH = {"layerfs": "none", "layerfs_trace": "auto",  # auto: the pushed trace, if any
            "scheduler": "none", "scheduler_trace": "auto", "scheduler_nolib": "none",
            "scheduler_noprog": "none",
            "ctr_layerfs": "none", "ctr_layerfs_trace": "auto"}
SNAPSHOTTER = "layerfs"  # the proxy snapshotter's name in containerd's config
# The scheduler's path (Client.up + Client.run in this process) and its floor,
# alternating which goes first rep by rep.
SCHEDULER_SIDES = ("scheduler", "scheduler_trace", "runc_local")
# the lazy scheduler side with one read-ahead turned off (--library-ahead-ab, --program-ahead-ab)
AB_SIDES = {"scheduler_nolib": "without the library fetch-ahead",
            "scheduler_noprog": "without the program read-ahead"}
TARGETS = {"cold start layerfs / containerd": 1 / 8, "disk writes layerfs / containerd": 0.1,
           "cold start ctr run on layerfs / containerd": 1 / 8,
           "disk writes ctr run on layerfs / containerd": 0.1,
           "cold start layerfs with a trace / containerd": 1 / 8,
           "disk writes layerfs with a trace / containerd": 0.1,
           "cold start layerfs / local dir": 3, "cold start layerfs with a trace / local dir": 3,
           "cold start scheduler lazy / runc on the local tree": 2.5,
           "cold start scheduler with a trace / runc on the local tree": 2}


def sh(argv: list[str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, **kw)


def timed_run(argv: list[str], env: dict[str, str] | None = None) -> float:
    """Run ``argv`` (output discarded, a failure raised with its stderr); seconds."""
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env=env, timeout=600)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed ({done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    return took


def runc_workload(bundle: Path, sid: str, state: Path) -> None:
    """The workload as the bundle's process (what a runtime's caller sets),
    run by ``runc run -b`` (its state under ``state``)."""
    config_path = bundle / "config.json"
    config = json.loads(config_path.read_text())
    config["process"]["args"] = ["sh", "-c", WORKLOAD]
    config["process"]["terminal"] = False
    config_path.write_text(json.dumps(config))
    sh(["runc", "--root", str(state), "run", "-b", str(bundle), sid], stdout=subprocess.DEVNULL)


def timed_call(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def write_bytes(pid: int) -> int:
    """Bytes the process (all its threads) caused to be written to block devices."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def du_bytes(path: Path) -> int:
    done = subprocess.run(["du", "-sxb", str(path)], capture_output=True, text=True)
    return int(done.stdout.split()[0]) if done.returncode == 0 and done.stdout else 0


# -- the image ------------------------------------------------------------------------

def ensure_minbase(work: Path) -> dict:
    """The debootstrap minbase tree ``work/minbase`` (made once)."""
    base, marker = work / "minbase", work / "minbase.json"
    if marker.exists() and base.is_dir():
        return json.loads(marker.read_text())
    tmp = work / "minbase.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"debootstrap --variant=minbase {SUITE} (once)...", flush=True)
    with open(work / "debootstrap.log", "wb") as log:
        sh(["debootstrap", "--variant=minbase", SUITE, str(tmp), "http://deb.debian.org/debian"],
           stdout=log, stderr=subprocess.STDOUT)
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (tmp / sub).glob("*"):
            if p.is_file() and p.name != "lock":
                p.unlink()
    tmp.rename(base)
    info = {"suite": SUITE, "bytes": du_bytes(base)}
    marker.write_text(json.dumps(info))
    return info


def put_blob(layout: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def ensure_layout(work: Path, base: Path) -> dict:
    """An OCI layout of the tree: one gzip layer, PATH and bash in its config."""
    layout, marker = work / "oci", work / "oci.json"
    if marker.exists() and layout.is_dir():
        return json.loads(marker.read_text())
    shutil.rmtree(layout, ignore_errors=True)
    (layout / "blobs" / "sha256").mkdir(parents=True)
    tar = subprocess.run(["tar", "--numeric-owner", "--xattrs", "-C", str(base), "-cf", "-",
                          "."], check=True, capture_output=True).stdout
    layer = put_blob(layout, gzip.compress(tar, 6, mtime=0))
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
                                 "/sbin:/bin"], "Cmd": ["/bin/bash"]},
              "rootfs": {"type": "layers",
                         "diff_ids": [f"sha256:{hashlib.sha256(tar).hexdigest()}"]}}
    cfg = put_blob(layout, json.dumps(config).encode())
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **cfg},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                            **layer}]}
    man = put_blob(layout, json.dumps(manifest).encode())
    index = {"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", **man,
         "annotations": {"org.opencontainers.image.ref.name": TAG}}]}
    (layout / "index.json").write_text(json.dumps(index))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    info = {"tar_bytes": len(tar), "gzip_bytes": layer["size"], "manifest": man["digest"]}
    marker.write_text(json.dumps(info))
    return info


# -- containerd -----------------------------------------------------------------------

class Containerd:
    """A containerd of the benchmark's own: root, state and socket under ``home``."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.root, self.state = home / "root", home / "state"
        self.sock = home / "ctrd.sock"
        self.proc: subprocess.Popen | None = None

    def config(self, snapshotter: Path | None = None, registry: str = "") -> str:
        """Without ``snapshotter``: CRI off, the overlayfs snapshotter. With it:
        layerfs's snapshotter at that socket, and CRI on, pulling with it from
        the plain-HTTP ``registry``."""
        text = "\n".join([
            "version = 2", f'root = "{self.root}"', f'state = "{self.state}"',
            "" if snapshotter else 'disabled_plugins = ["io.containerd.grpc.v1.cri"]',
            "[grpc]", f'  address = "{self.sock}"',
            "[ttrpc]", f'  address = "{self.sock}.ttrpc"',
            "[metrics]", '  address = ""', ""])
        if snapshotter is not None:
            text += (proxy_snapshotter_config(SNAPSHOTTER, snapshotter)
                     + cri_config(self.home, SNAPSHOTTER, registry))
        return text

    def start(self, snapshotter: Path | None = None, registry: str = "") -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(self.config(snapshotter, registry))
        with open(self.home / "containerd.log", "ab") as log:
            self.proc = subprocess.Popen(["containerd", "--config", str(self.home / "config.toml")],
                                         stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while subprocess.run(self.ctr("version"), capture_output=True).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"containerd did not start: see {self.home}/containerd.log")
            time.sleep(0.1)

    def ctr(self, *args: str) -> list[str]:
        return ["ctr", "-a", str(self.sock), *args]

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
            self.proc = None

    def wipe(self, oddities: list[str]) -> None:
        """Remove root and state (detaching what is left mounted there first)."""
        for path in (self.root, self.state):
            clear_dir(path, oddities)


# -- the benchmark --------------------------------------------------------------------

class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, image: str,
                 store_env: dict[str, str], base: Path) -> None:
        self.args = args
        self.work = work
        self.image = image  # HOST:PORT/REPO:TAG
        self.store_env = store_env  # LAYERFS_STORE (and the S3 endpoint)
        self.base = base
        self.oddities: list[str] = []
        self.daemons = DaemonRuns(work, self.oddities, "20G", request_timeout=600,
                                  daemon_args=[*DaemonRuns.options(args),
                                               "--log-level", args.daemon_log_level])
        self.ctrd = Containerd(work / "ctrd")
        # the timed `layerfs up`: this checkout's, or an installed one (--client)
        self.client = [args.client] if args.client else list(LAYERFS)

    def store_args(self) -> list[str]:
        args = ["--store", self.store_env["LAYERFS_STORE"]]
        if "AWS_ENDPOINT_URL" in self.store_env:
            args += ["--s3-endpoint", self.store_env["AWS_ENDPOINT_URL"]]
        return args

    def containerd(self, rep: int) -> dict:
        self.ctrd.wipe(self.oddities)
        self.ctrd.start()
        try:
            assert self.ctrd.proc is not None
            pid = self.ctrd.proc.pid
            drop_caches()
            w0 = write_bytes(pid)
            pull = timed_run(self.ctrd.ctr("image", "pull", "--plain-http", self.image))
            run = timed_run(self.ctrd.ctr("run", "--rm", self.image, f"bench{rep}",
                                          "sh", "-c", WORKLOAD))
            os.sync()
            written = write_bytes(pid) - w0
            used = du_bytes(self.ctrd.root)
        finally:
            self.ctrd.stop()
        return {"pull_s": round(pull, 3), "run_s": round(run, 3),
                "cold_start_s": round(pull + run, 3), "disk_written_bytes": written,
                "root_du_bytes": used}

    def ctr_layerfs(self, rep: int) -> dict:
        return self.ctr_layerfs_start(rep, "ctr_layerfs")

    def ctr_layerfs_trace(self, rep: int) -> dict:
        return self.ctr_layerfs_start(rep, "ctr_layerfs_trace")

    def ctr_layerfs_start(self, rep: int, side: str) -> dict:
        """containerd with CRI and layerfs's snapshotter, both on empty roots:
        CRI's PullImage + ``ctr run --rm --snapshotter layerfs``."""
        root = clear_dir(self.work / "roots" / "node", self.oddities)
        sock = self.work / "snapshotter.sock"
        node: DaemonProcess = self.daemons.start(root, "node", [
            *self.store_args(), "--containerd-snapshotter", str(sock),
            "--containerd-prefetch", PREFETCH[side]])
        self.ctrd.wipe(self.oddities)
        try:
            self.ctrd.start(sock, self.image.split("/", 1)[0])
            assert self.ctrd.proc is not None and node.proc is not None
            pids = (self.ctrd.proc.pid, node.proc.pid)
            du0 = du_bytes(root)
            drop_caches()
            w0 = sum(write_bytes(pid) for pid in pids)
            pull = timed_call(lambda: cri_pull(self.ctrd.sock, self.image, timeout=600))
            run = timed_run(self.ctrd.ctr("-n", "k8s.io", "run", "--rm", "--snapshotter",
                                          SNAPSHOTTER, self.image, f"bench{rep}",
                                          "sh", "-c", WORKLOAD))
            os.sync()
            written = sum(write_bytes(pid) for pid in pids) - w0
            used = du_bytes(self.ctrd.root) + du_bytes(root) - du0
            cache = node.request("stats")["cache"]
        finally:
            self.ctrd.stop()
            self.daemons.finish(node, remove_root=True)
        return {"pull_s": round(pull, 3), "run_s": round(run, 3),
                "cold_start_s": round(pull + run, 3), "disk_written_bytes": written,
                "root_du_bytes": used, "bytes_fetched": cache.get("bytes_fetched", 0)}

    def layerfs(self, rep: int) -> dict:
        return self.layerfs_start(rep, "layerfs")

    def layerfs_trace(self, rep: int) -> dict:
        return self.layerfs_start(rep, "layerfs_trace")

    def record_trace(self) -> None:
        """One lazy run of the workload on a fresh node, then its trace of every
        layer pushed to the store (what `layerfs_trace`'s `up` replays)."""
        root = clear_dir(self.work / "roots" / "node", self.oddities)
        node: DaemonProcess = self.daemons.start(root, "node", self.store_args())
        try:
            bundle = self.work / "bundle"  # its config.json: the floor's too (runc_local)
            shutil.rmtree(bundle, ignore_errors=True)
            timed_run([*LAYERFS, "up", ENV_REF, "--id", "record", "--root", str(root),
                       "--prefetch", "none", "--bundle", str(bundle)])
            timed_run([*LAYERFS, "run", "record", "--root", str(root), "--",
                       "sh", "-c", WORKLOAD])
            refs = self.layer_refs()
            for ref in refs:
                node.request("trace-push", ref=ref)
            node.request("down", id="record")
        finally:
            self.daemons.finish(node, remove_root=True)
        if not refs:
            sys.exit(f"{ENV_REF} names no layers: nothing to trace")
        print(f"  pushed the trace of {len(refs)} layer(s)", flush=True)

    def layer_refs(self) -> list[str]:
        shown = subprocess.run([*LAYERFS, "inspect", ENV_REF, "--json"], check=True,
                               capture_output=True, text=True, env=os.environ | self.store_env)
        return [layer["ref"] for layer in json.loads(shown.stdout)["layers"]]

    def layerfs_start(self, rep: int, side: str) -> dict:
        root = clear_dir(self.work / "roots" / "node", self.oddities)
        node: DaemonProcess = self.daemons.start(root, "node", self.store_args())
        sid = f"bench{rep}"
        try:
            assert node.proc is not None
            pid = node.proc.pid
            du0 = du_bytes(root)
            drop_caches()
            w0 = write_bytes(pid)
            bundle = self.work / "bundle"
            shutil.rmtree(bundle, ignore_errors=True)
            up = timed_run([*self.client, "up", ENV_REF, "--id", sid, "--root", str(root),
                            "--prefetch", PREFETCH[side], "--bundle", str(bundle)])
            run = timed_call(lambda: self.runc_workload(bundle, sid))
            os.sync()
            written = write_bytes(pid) - w0
            used = du_bytes(root) - du0
            cache = node.request("stats")["cache"]
            client = timed_run([*self.client, "ps", "--root", str(root)])  # a client alone
            drop_caches()
            client_cold = timed_run([*self.client, "ps", "--root", str(root)])  # as `up`'s
            node.request("down", id=sid)
        finally:
            self.daemons.finish(node, remove_root=True)
        return {"up_s": round(up, 3), "run_s": round(run, 3),
                "cold_start_s": round(up + run, 3), "disk_written_bytes": written,
                "root_du_bytes": used, "bytes_fetched": cache.get("bytes_fetched", 0),
                "client_start_s": round(client, 3), "client_cold_start_s": round(client_cold, 3)}

    def runc_workload(self, bundle: Path, sid: str) -> None:
        runc_workload(bundle, sid, self.work / "runc")

    def scheduler_start(self, rep: int, side: str) -> dict:
        """A scheduler's cold start: ``Client.up`` + ``Client.run`` of the
        workload from this process, the client made (and its modules imported)
        beforehand, on a fresh daemon ROOT with the page cache dropped."""
        from layerfs.node.client import Client

        root = clear_dir(self.work / "roots" / "node", self.oddities)
        off = ["--no-library-ahead"] if side == "scheduler_nolib" else []
        node: DaemonProcess = self.daemons.start(root, "node", self.store_args() + off)
        sid = f"sched{rep}"
        try:
            client = Client(root, timeout=600, read_ahead=side != "scheduler_noprog")
            client.ping()  # a warm client: connected once, its modules loaded
            drop_caches()
            t0 = time.perf_counter()
            client.up(sid, ENV_REF, prefetch=PREFETCH[side])
            t1 = time.perf_counter()
            done = client.run(sid, ["sh", "-c", WORKLOAD], capture=True)
            t2 = time.perf_counter()
            if done.exit_code != 0:
                raise RuntimeError(f"the workload in {sid} exited {done.exit_code}: "
                                   f"{(done.stderr or b'').decode(errors='replace')[-2000:]}")
            cache = node.request("stats")["cache"]
            client.down(sid)
        finally:
            self.daemons.finish(node, remove_root=True)
        return {"up_s": round(t1 - t0, 3), "run_s": round(t2 - t1, 3),
                "cold_start_s": round(t2 - t0, 3),
                "bytes_fetched": cache.get("bytes_fetched", 0)}

    def local(self) -> float:
        drop_caches()
        return timed_run(["unshare", "-m", "chroot", str(self.base), "sh", "-c", WORKLOAD])

    def runc_local(self, rep: int) -> float:
        """The workload through runc on the unpacked tree itself (read-only), caches dropped."""
        bundle = self.work / "bundle-local"
        shutil.rmtree(bundle, ignore_errors=True)
        bundle.mkdir(parents=True)
        config = json.loads((self.work / "bundle" / "config.json").read_text())
        config["root"] = {"path": str(self.base), "readonly": True}
        (bundle / "config.json").write_text(json.dumps(config))
        drop_caches()
        return timed_call(lambda: self.runc_workload(bundle, f"local{rep}"))

    def traced_entries(self) -> list[ChunkEntry]:
        """The chunk table entries the pushed traces of the env's layers list."""
        from layerfs.node.reads.accesstraces import parse_trace, trace_key
        from layerfs.refstore import RefStore
        from layerfs.store import open_store

        store = open_store(self.store_env["LAYERFS_STORE"],
                           self.store_env.get("AWS_ENDPOINT_URL"))
        try:
            refstore = RefStore(store)
            entries: list[ChunkEntry] = []
            for ref in self.layer_refs():
                digest, manifest = refstore.layer_by_ref(ref)
                table = refstore.chunk_table(manifest)
                order = parse_trace(store.get(trace_key(digest))) or []
                entries += [table.entries[i] for i in order if i < len(table.entries)]
            return entries
        finally:
            store.close()

    def fetch_floor(self, entries: list[ChunkEntry]) -> float:
        """Seconds for the store to serve ``entries`` (stored bytes): runs of
        neighbours in a pack, up to 4 MiB a GET, 16 GETs at a time."""
        from layerfs.store import open_store

        unique = sorted(set(entries), key=lambda e: e.location)
        ranges = [(run[0].pack, run[0].pack_offset, run[-1].pack_offset + run[-1].stored_length)
                  for run in pack_runs(unique, span=FLOOR_RUN, gap=0)]
        store = open_store(self.store_env["LAYERFS_STORE"],
                           self.store_env.get("AWS_ENDPOINT_URL"))
        try:
            store.get(blob_key(ranges[0][0]), 0, 1)  # the client and its connection made
            drop_caches()
            with ThreadPoolExecutor(FLOOR_FETCHES) as pool:
                return timed_call(lambda: list(pool.map(
                    lambda r: store.get(blob_key(r[0]), r[1], r[2]), ranges)))
        finally:
            store.close()

    def run(self) -> dict:
        sides: dict[str, list[dict]] = {s: [] for s in SIDES}
        local: list[float] = []
        floors: dict[str, list[float]] = {"runc_local_s": [], "trace_fetch_s": []}
        ours = SCHEDULER_SIDES + (("scheduler_nolib",) if self.args.library_ahead_ab else ()) \
            + (("scheduler_noprog",) if self.args.program_ahead_ab else ())
        scheduler: dict[str, list[dict]] = {side: [] for side in ours}
        self.record_trace()
        traced = self.traced_entries()
        for rep in range(self.args.reps):
            order = ours if rep % 2 == 0 else ours[::-1]
            for side in order:
                sample = ({"cold_start_s": round(self.runc_local(rep), 3)}
                          if side == "runc_local" else self.scheduler_start(rep, side))
                scheduler[side].append(sample)
                print(f"  rep {rep + 1} {side:15} cold start {sample['cold_start_s']:.3f} s",
                      flush=True)
            if self.args.scheduler_only:
                continue
            order = SIDES if rep % 2 == 0 else SIDES[::-1]
            for side in order:
                sample = getattr(self, side)(rep)
                sides[side].append(sample)
                print(f"  rep {rep + 1} {side:10} cold start {sample['cold_start_s']:.3f} s, "
                      f"disk written {sample['disk_written_bytes'] / 1e6:.1f} MB", flush=True)
            local.append(round(self.local(), 3))
            floors["runc_local_s"].append(round(self.runc_local(rep), 3))
            floors["trace_fetch_s"].append(round(self.fetch_floor(traced), 3))
        return {"samples": sides, "scheduler_samples": scheduler, "local_dir_s": local,
                "floors": floors, "traced_stored_bytes": sum(e.stored_length for e in traced)}


def median_of(samples: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in samples)


def per_rep(result: dict, side: str, key: str) -> list[float]:
    """``side``'s ``key`` over containerd's, rep by rep."""
    ctrd = result["samples"]["containerd"]
    return [round(b[key] / max(1e-9, a[key]), 4)
            for a, b in zip(ctrd, result["samples"][side], strict=True)]


def scheduler_ratios(result: dict) -> dict[str, Any]:
    """The scheduler's cold starts over runc's on the local tree, rep by rep, and their medians."""
    runs = result["scheduler_samples"]
    ratios: dict[str, Any] = {}
    for side, label in (("scheduler", "scheduler lazy"),
                        ("scheduler_trace", "scheduler with a trace"),
                        *((s, f"scheduler lazy {w}") for s, w in AB_SIDES.items())):
        if side not in runs:
            continue
        per = [round(s["cold_start_s"] / max(1e-9, f["cold_start_s"]), 3)
               for s, f in zip(runs[side], runs["runc_local"], strict=True)]
        ratios[f"cold start {label} / runc on the local tree"] = statistics.median(per)
        ratios[f"per_rep_cold_start {label} / runc on the local tree"] = per
    for side, what in AB_SIDES.items():
        if side in runs:
            per = [round(s["cold_start_s"] / max(1e-9, f["cold_start_s"]), 3)
                   for s, f in zip(runs["scheduler"], runs[side], strict=True)]
            ratios[f"cold start scheduler lazy / {what}"] = statistics.median(per)
            ratios[f"per_rep_cold start scheduler lazy / {what}"] = per
    return ratios


def summarize(result: dict) -> dict:
    out: dict[str, Any] = {
        side: {k: median_of(samples, k) for k in samples[0]}
        for side, samples in result["scheduler_samples"].items()}
    ratios: dict[str, Any] = scheduler_ratios(result)
    out["ratios"] = ratios
    if not result["samples"]["containerd"]:  # --scheduler-only
        return out
    out.update({side: {k: median_of(result["samples"][side], k)
                       for k in result["samples"][side][0]} for side in SIDES})
    out["local_dir_s"] = local = statistics.median(result["local_dir_s"])
    out["floors"] = {k: statistics.median(v) for k, v in result["floors"].items()}
    for side, label in (("layerfs", "layerfs"), ("layerfs_trace", "layerfs with a trace"),
                        ("ctr_layerfs", "ctr run on layerfs"),
                        ("ctr_layerfs_trace", "ctr run on layerfs with a trace")):
        start = per_rep(result, side, "cold_start_s")
        disk = per_rep(result, side, "disk_written_bytes")
        ratios[f"cold start {label} / containerd"] = statistics.median(start)
        ratios[f"disk writes {label} / containerd"] = statistics.median(disk)
        ratios[f"cold start {label} / local dir"] = round(out[side]["cold_start_s"] / local, 3)
        ratios[f"per_rep_cold_start {label}"] = start
        ratios[f"per_rep_disk_writes {label}"] = disk
    return out


def print_scheduler(summary: dict) -> None:
    print(f"\n{'scheduler path (Client.up + Client.run)':40} {'cold start s':>12} "
          f"{'up s':>8} {'run s':>8}")
    for side, label in (("scheduler", "lazy"), ("scheduler_trace", "with a pushed trace"),
                        ("scheduler_nolib", "lazy, --no-library-ahead"),
                        ("scheduler_noprog", "lazy, Client(read_ahead=False)")):
        if side not in summary:
            continue
        row = summary[side]
        print(f"{'  ' + label:40} {row['cold_start_s']:12.3f} {row['up_s']:8.3f} "
              f"{row['run_s']:8.3f}")
    print(f"{'  floor: runc run on the local tree':40} "
          f"{summary['runc_local']['cold_start_s']:12.3f}")


def print_table(summary: dict, image: dict) -> None:
    print_scheduler(summary)
    for what in AB_SIDES.values():
        ab = f"cold start scheduler lazy / {what}"
        if ab in summary["ratios"]:
            print(f"{ab}: {summary['ratios'][ab]:.3f} "
                  f"(per rep {summary['ratios']['per_rep_' + ab]})")
    for name in ("cold start scheduler lazy / runc on the local tree",
                 "cold start scheduler with a trace / runc on the local tree"):
        ratio, bound = summary["ratios"][name], TARGETS[name]
        print(f"{name}: {ratio:.3f} (target <= {bound:.3f}: "
              f"{'met' if ratio <= bound else 'missed'})")
    if "containerd" not in summary:
        return
    c, lf, tr = summary["containerd"], summary["layerfs"], summary["layerfs_trace"]
    print(f"\nimage: {image['tar_bytes'] / 1e6:.0f} MB, {image['gzip_bytes'] / 1e6:.0f} MB as "
          f"one gzip layer")
    print(f"{'system':40} {'cold start s':>12} {'fetched MB':>10} {'disk written MB':>15}")
    print(f"{'containerd, full pull + ctr run':40} {c['cold_start_s']:12.3f} "
          f"{image['gzip_bytes'] / 1e6:10.1f} {c['disk_written_bytes'] / 1e6:15.1f}")
    print(f"{'layerfs up --bundle (lazy) + runc run':40} {lf['cold_start_s']:12.3f} "
          f"{lf['bytes_fetched'] / 1e6:10.1f} {lf['disk_written_bytes'] / 1e6:15.1f}")
    print(f"{'  of which a client start (cold)':40} {lf['client_start_s']:12.3f} "
          f"({lf['client_cold_start_s']:.3f})")
    print(f"{'the same, with a pushed trace (auto)':40} {tr['cold_start_s']:12.3f} "
          f"{tr['bytes_fetched'] / 1e6:10.1f} {tr['disk_written_bytes'] / 1e6:15.1f}")
    for side, label in (("ctr_layerfs", "CRI pull + ctr run, layerfs (lazy)"),
                        ("ctr_layerfs_trace", "the same, with a pushed trace")):
        row = summary[side]
        print(f"{label:40} {row['cold_start_s']:12.3f} {row['bytes_fetched'] / 1e6:10.1f} "
              f"{row['disk_written_bytes'] / 1e6:15.1f}")
    print(f"{'local dir (unshare + chroot)':40} {summary['local_dir_s']:12.3f}")
    floors = summary["floors"]
    print(f"{'floor: runc run on the local dir':40} {floors['runc_local_s']:12.3f}")
    print(f"{'floor: the store serving the trace':40} {floors['trace_fetch_s']:12.3f}")
    for name, bound in TARGETS.items():
        if "scheduler" in name:
            continue
        ratio = summary["ratios"][name]
        print(f"{name}: {ratio:.3f} (target <= {bound:.3f}: "
              f"{'met' if ratio <= bound else 'missed'})")


@contextlib.contextmanager
def store_for(kind: str, work: Path, seaweed_mb: int = SEAWEED_CHUNK_MB
              ) -> Iterator[dict[str, str]]:
    """The environment that names the layerfs store: SeaweedFS S3 (its objects
    stored in chunks of ``seaweed_mb`` MiB, 0: SeaweedFS's default, 4) or file://."""
    if kind == "file":
        yield {"LAYERFS_STORE": f"file://{work / 'store'}"}
        return
    from bench import corpus
    data, extra = work / "seaweedfs", []
    if seaweed_mb:  # objects keep the chunks they were written in: a store of its own
        data, extra = work / f"seaweedfs-{seaweed_mb}mb", [f"-filer.maxMB={seaweed_mb}"]
    with corpus.seaweedfs(data, extra) as server:
        yield {"LAYERFS_STORE": f"s3://{corpus.BUCKET}/image-start",
               "AWS_ENDPOINT_URL": server.endpoint}


@contextlib.contextmanager
def published_image(work: Path, store: str, seaweed_mb: int = SEAWEED_CHUNK_MB
                    ) -> Iterator[tuple[str, dict[str, str], dict, float | None]]:
    """The minbase image (made once) in a local registry and imported into the
    layerfs store: (its registry ref, the store's environment, what the image
    is, the import's seconds or None if an earlier run imported it)."""
    from harness.registryserver import push, start_registry

    work.mkdir(parents=True, exist_ok=True)
    detach_mounts(work / "roots")
    info = {**ensure_minbase(work), **ensure_layout(work, work / "minbase")}
    registry = start_registry(shutil.which("docker-registry") or "", work / "registry")
    try:
        ref = push(work / "oci", TAG, registry, REPO).removeprefix("docker://")
        with store_for(store, work, seaweed_mb) as store_env:
            yield ref, store_env, info, import_image(ref, store_env)
    finally:
        registry.stop()


def import_image(image: str, store_env: dict[str, str]) -> float | None:
    """``layerfs import`` of the image into the store (seconds); None if an earlier
    run imported it."""
    env = os.environ | store_env
    listed = subprocess.run([*LAYERFS, "env", "ls", REPO, "--json"], capture_output=True,
                            text=True, env=env)
    if listed.returncode == 0 and ENV_REF in listed.stdout:
        return None
    return timed_run([*LAYERFS, "import", f"docker://{image}", "--name", REPO, "--version", "1",
                      "--plain-http"], env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="cold reps of each side")
    ap.add_argument("--store", choices=("s3", "file"), default="s3")
    ap.add_argument("--quick", action="store_true", help="one rep of each side")
    ap.add_argument("--seaweed-chunk-mb", type=int, default=SEAWEED_CHUNK_MB, metavar="MB",
                    help="SeaweedFS stores objects in chunks of MB MiB (its -filer.maxMB; "
                         "default: 1, as docs/store.md advises for a layerfs store; 0: "
                         "SeaweedFS's own, 4): its S3 gateway reads a whole chunk for a "
                         "ranged GET")
    ap.add_argument("--store-latency-ms", type=float, default=0.0, metavar="MS",
                    help="S3 only: every request to the store waits MS ms more (a relay, "
                         "bench/latency.py): a store across a network, its time not the "
                         "node's CPU")
    ap.add_argument("--library-ahead-ab", action="store_true",
                    help="one more scheduler side: lazy on daemons with --no-library-ahead "
                         "(the library fetch-ahead's gain, alternating with the others)")
    ap.add_argument("--program-ahead-ab", action="store_true",
                    help="one more scheduler side: lazy with Client(read_ahead=False) (the "
                         "program read-ahead's gain, alternating with the others)")
    ap.add_argument("--scheduler-only", action="store_true",
                    help="only the scheduler's path and its floor (no containerd, no CLI)")
    ap.add_argument("--client", metavar="LAYERFS",
                    help="the `layerfs` whose `up` is timed, e.g. a wheel installed into a venv "
                         "(`pip install .`; default: this checkout's, as `make deps` installs it)")
    DaemonRuns.add_arguments(ap)
    ap.add_argument("--daemon-log-level", default="info",
                    help="the daemons' --log-level (debug: each up's steps, timed)")
    ap.add_argument("--work", default="/tmp/layerfs-bench/image-start")
    ap.add_argument("--out", default=str(RESULTS / "image_start.json"))
    args = ap.parse_args()
    if args.quick:
        args.reps = 1
    if os.geteuid() != 0:
        sys.exit("bench/image_start.py needs root (containerd, FUSE, EROFS, overlay mounts)")
    for tool in ("containerd", "ctr", "runc", "docker-registry", "skopeo", "debootstrap"):
        if not shutil.which(tool):
            sys.exit(f"{tool} not found: `make apt-deps` installs it")
    work = Path(args.work).resolve()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    bench = None
    try:
        with published_image(work, args.store, args.seaweed_chunk_mb) as (
                ref, store_env, image_info, import_s):
            took = "done by an earlier run" if import_s is None else f"{import_s:.1f} s"
            print(f"image {ref}: {image_info['gzip_bytes'] / 1e6:.0f} MB gzip; layerfs import "
                  f"{took} ({store_env['LAYERFS_STORE']})", flush=True)
            with contextlib.ExitStack() as stack:
                if args.store_latency_ms and "AWS_ENDPOINT_URL" in store_env:
                    store_env = {**store_env, "AWS_ENDPOINT_URL": stack.enter_context(
                        relay(store_env["AWS_ENDPOINT_URL"], args.store_latency_ms))}
                bench = Bench(args, work, ref, store_env, work / "minbase")
                try:
                    result = bench.run()
                finally:
                    bench.daemons.stop_all()
                    bench.ctrd.stop()
    finally:
        left = detach_mounts(work / "roots")
        if left:
            print(f"detached leftover mounts: {left}", file=sys.stderr)
    summary = summarize(result)
    out = {"commit": git_head(),
           "params": {"reps": args.reps, "store": args.store, "quick": args.quick,
                      "seaweed_chunk_mb": args.seaweed_chunk_mb or None,
                      "scheduler_only": args.scheduler_only,
                      "client": args.client or "this checkout (editable)",
                      "miss_span": args.miss_span, "workload": WORKLOAD,
                      "store_latency_ms": args.store_latency_ms,
                      "library_ahead_ab": args.library_ahead_ab,
                      "program_ahead_ab": args.program_ahead_ab},
           "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
           "image": {**image_info, "ref": ref},
           "import_s": None if import_s is None else round(import_s, 2),
           **result, "summary": summary, "targets": TARGETS,
           "daemon_logs": bench.daemons.scan_logs(), "oddities": bench.oddities,
           "runtime_s": round(time.perf_counter() - started, 1),
           "method": (
               "Cold start = containerd: `ctr image pull --plain-http` + `ctr run --rm` on a "
               "fresh containerd root (overlayfs snapshotter); ctr run on layerfs: CRI "
               "PullImage + `ctr -n k8s.io run --rm --snapshotter layerfs` on fresh containerd "
               "and layerfs roots (the proxy snapshotter; disk written: both daemons'); "
               "layerfs: `layerfs up --bundle "
               "DIR` + `runc run -b DIR`, the workload as the bundle's process, on a fresh "
               "daemon ROOT (with a trace: one it pushed on another node), the image "
               "imported into the "
               "store beforehand (once: a publishing step, like the push to the registry). "
               "Daemons started before the timed part; page cache dropped right before it; "
               "sides alternate which goes first; medians over reps, ratios are medians of "
               "per-rep ratios. Disk written: /proc/PID/io write_bytes of containerd or the "
               "layerfs daemon over the timed part (after sync); root_du_bytes: du of its "
               "root afterwards. Scheduler: Client.up + Client.run of the workload from the "
               "bench's process, the client connected before the page cache is dropped, "
               "against runc run on the unpacked tree (read-only root) in the same rep; "
               "the three alternate which goes first; ratios are per rep, then medians.")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print_table(summary, image_info)
    print_footer(out["daemon_logs"], bench.oddities, f"{out['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
