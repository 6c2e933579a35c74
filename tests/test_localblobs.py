"""Small layers fetched whole into local blob files the kernel reads directly
(``--fetch-whole-below``, layerfs/node/reads/localblobs.py): few store requests for
a new workspace of many small files, the same bytes as the source, reads that
need no daemon (one killed with SIGKILL, the page cache dropped), a damaged
local file fetched again before it is mounted, a daemon killed while it
fetches a layer whole (nothing partial left), a layer that cannot be
fetched whole read lazily instead, and the files' bound.

Tier: node (a real daemon, kernel EROFS and overlay mounts; root).
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from support import build, damage_chunk, need_root
from support.nodes import LAYERFS, NodeDaemon, serving
from support.nodes import up_lazy as up
from support.storeaway import GatedRelay

from layerfs.builder.env import create_env
from layerfs.refstore import RefStore

SMALL_FILES = 400


def make_workspace(root: Path, seed: int) -> dict[str, str]:
    """A repository-like tree: 400 small files in nested directories and two
    larger ones; its files' sha256 by path."""
    rng = random.Random(seed)
    sums = {}
    for i in range(SMALL_FILES):
        rel = f"pkg{i % 7}/mod{i % 23}/f{i}.py"
        data = rng.randbytes(rng.randint(600, 9000))
        sums[rel] = write(root / rel, data)
    for i, size in enumerate((1 << 20, 3 << 20 | 4321)):
        sums[f"data/big{i}"] = write(root / f"data/big{i}", rng.randbytes(size))
    return sums


def write(path: Path, data: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def make_base(root: Path) -> None:
    for sub in ("bin", "proc", "dev", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/busybox", root / "bin" / "busybox")


def read_all(rootfs: Path, sums: dict[str, str]) -> dict[str, str]:
    """Each workspace file's sha256 as read through the sandbox (or the errno)."""
    got = {}
    for rel in sums:
        try:
            got[rel] = hashlib.sha256((rootfs / "ws" / rel).read_bytes()).hexdigest()
        except OSError as exc:
            got[rel] = errno.errorcode[exc.errno or 0]
    return got


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


@pytest.fixture
def published(tmp_path, store):
    """Env e@1: a new workspace layer (``ws``) over a busybox base; the sums."""
    need_root()
    make_base(tmp_path / "base")
    ws = tmp_path / "wsrc"
    sums = make_workspace(ws / "ws", seed=35)
    build(store, str(tmp_path / "base"), name="base")
    build(store, str(ws), name="ws")
    create_env(RefStore(store), "e", "1", ["ws@1", "base@1"])
    return sums


@pytest.fixture
def whole_node(tmp_path, store_location, published):
    yield from serving(NodeDaemon(tmp_path / "node", store_location.cli_args(),
                                  cache_size="256M", read_timeout=4.0, whole_below="32M"))


def ws_digest(store) -> str:
    return RefStore(store).resolve("layers", "ws@1")


def test_a_new_workspace_costs_few_requests_and_reads_need_no_daemon(whole_node, published,
                                                                    store):
    before = whole_node.request("stats")["store"].get("get", 0)
    rootfs = up(whole_node, "s1")
    assert read_all(rootfs, published) == published
    stats = whole_node.request("stats")
    gets = stats["store"]["get"] - before
    # the env and layer manifests, the meta images and tables, then the data
    # of both layers (small: each fetched whole) in a few range reads
    assert gets <= 16, stats["store"]
    ws = stats["layers"][ws_digest(store)]
    assert ws["local"] and ws["bytes_read"] == 0  # no read reached the daemon
    local = whole_node.root / "blobs" / ws_digest(store).removeprefix("sha256:")
    assert local.stat().st_uid == 0 and local.stat().st_mode & 0o077 == 0

    whole_node.kill()  # no daemon at all: the kernel reads the local files
    drop_caches()
    assert read_all(rootfs, published) == published
    whole_node.start()  # the sandbox comes back as it was
    assert read_all(rootfs, published) == published
    assert whole_node.request("stats")["layers"][ws_digest(store)]["local"]
    whole_node.cli("down", "s1")


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.reads\.localblobs: local blob file \S+ does "
                        r"not hold "
                        r"chunk")
def test_a_damaged_local_file_is_fetched_again_before_it_is_mounted(whole_node, published,
                                                                    store):
    rootfs = up(whole_node, "s1")
    assert read_all(rootfs, published) == published
    whole_node.cli("down", "s1")  # the layer unmounted, its file kept
    local = whole_node.root / "blobs" / ws_digest(store).removeprefix("sha256:")
    with open(local, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    rootfs = up(whole_node, "s2")
    assert read_all(rootfs, published) == published
    assert "does not hold chunk" in whole_node.log()
    whole_node.cli("down", "s2")


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.reads\.localblobs: layer \S+ not fetched whole",
                        r"ERROR layerfs\.node\.reads\.fetcher: .*(sha256 mismatch|cannot "
                        r"decompress)",
                        r"ERROR layerfs\.node\.reads\.fetcher: chunk \S+: ",
                        r"ERROR layerfs\.node\.fuse\.nodefs: read: cannot read chunk \S+: "
                        r"integrity")
def test_a_layer_that_cannot_be_fetched_whole_is_read_lazily(whole_node, published, store):
    damage_chunk(store, ws_digest(store), key=lambda e: e.length)
    rootfs = up(whole_node, "s1")
    got = read_all(rootfs, published)
    bad = {rel for rel, s in got.items() if s != published[rel]}
    assert len(bad) == 1 and got[bad.pop()] == "EIO"  # only the file with the damaged chunk
    assert not (whole_node.root / "blobs" / ws_digest(store).removeprefix("sha256:")).exists()
    assert not whole_node.request("stats")["layers"][ws_digest(store)]["local"]
    whole_node.cli("down", "s1")


def test_files_of_unused_layers_are_deleted_beyond_the_bound(tmp_path, store_location,
                                                             published, store):
    node = NodeDaemon(tmp_path / "node", store_location.cli_args(), cache_size="256M",
                      read_timeout=4.0, whole_below="32M")
    node.extra_args = ["--local-blobs", "1M"]  # smaller than one layer's file
    node.start()
    try:
        up(node, "s1")
        up(node, "s2")  # the same layers: one file each, used twice
        blobs = node.root / "blobs"
        files = {p.name for p in blobs.iterdir() if p.is_file()}
        assert ws_digest(store).removeprefix("sha256:") in files
        node.cli("down", "s1")
        assert {p.name for p in blobs.iterdir() if p.is_file()} == files  # still in use
        node.cli("down", "s2")
        assert [p for p in blobs.iterdir() if p.is_file()] == []  # unused, over the bound
    finally:
        assert node.cleanup() == []


def test_a_daemon_killed_while_it_fetches_a_layer_whole_leaves_no_partial_file(
        tmp_path, store_location, published, store):
    """SIGKILL while the store hangs in the middle of a layer's whole fetch:
    nothing but a temporary is left, the next daemon removes it and fetches the
    layer again, and the sandbox reads the right bytes."""
    if store_location.endpoint is None:
        pytest.skip("the hang is made by a relay in front of the S3 server")
    relay = GatedRelay(store_location.endpoint)
    node = NodeDaemon(tmp_path / "node", ["--store", store_location.url, "--s3-endpoint",
                                          relay.endpoint], cache_size="256M",
                      read_timeout=30.0, whole_below="32M").start()
    try:
        node.request("ps")  # connected
        tmp = node.root / "blobs" / "tmp"
        # the manifests, meta images and tables come through; the data hangs
        refstore = RefStore(store)
        table = refstore.chunk_table(refstore.layer(ws_digest(store)))
        assert table.blob_size > 0
        relay.gate.clear()
        upping = subprocess.Popen([*LAYERFS, "up", "e@1", "--id", "s1", "--prefetch", "none",
                                   "--root", str(node.root)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
        time.sleep(1.0)
        relay.gate.set()  # the objects before the data
        deadline = time.monotonic() + 20
        while not any(tmp.iterdir()) and time.monotonic() < deadline:
            relay.gate.set()
            time.sleep(0.002)
            relay.gate.clear()
            time.sleep(0.05)
        assert any(tmp.iterdir()), "the whole fetch never started"
        node.kill()  # the store still hanging
        upping.wait(30)
        assert upping.returncode != 0
        relay.gate.set()
        assert not (node.root / "blobs" / ws_digest(store).removeprefix("sha256:")).exists()
        node.start()
        assert list(tmp.iterdir()) == []  # the crash's temporary, removed at start
        rootfs = up(node, "s2")
        assert read_all(rootfs, published) == published
        node.cli("down", "s2")
    finally:
        relay.gate.set()
        assert node.cleanup() == []
        relay.close()


def test_an_eager_up_of_local_layers_fetches_nothing_twice(tmp_path, store_location,
                                                          whole_node, published, store):
    """``--prefetch full`` and a pushed trace's replay leave out what is fetched
    whole: the chunk cache stays empty, every byte is in the local files."""
    lazy = NodeDaemon(tmp_path / "lazy", store_location.cli_args(), read_timeout=4.0).start()
    try:  # a node that reads the workspace lazily records its trace and pushes it
        assert read_all(up(lazy, "l1"), published) == published
        lazy.cli("down", "l1")
        lazy.cli("trace", "push", "ws@1")
    finally:
        assert lazy.cleanup() == []
    for mode in ("full", "auto"):
        rootfs = Path(whole_node.cli("up", "e@1", "--id", mode, "--prefetch", mode)
                      .stdout.strip())
        assert read_all(rootfs, published) == published
        whole_node.cli("down", mode)
    cache = whole_node.request("stats")["cache"]
    assert cache["entries"] == 0 and cache["bytes_written"] == 0, cache
