"""A node whose store is away serves what it has, on both store backends:
``up`` of an env it replicated (by name, through its last resolution, said on
one line and in ``ps``; by digest, without the store at all), exit 8 for an
env it never resolved, a vm's drive set and a writable disk over a sealed
base the same way, a restart with the store away (disks included), and the
store's own answers again once it is back. And a file
store whose directory is missing is unreachable, not empty."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import time
import uuid
from contextlib import closing
from pathlib import Path

import pytest
from conftest import TEST_BUCKET
from support.baseenv import publish_base_env, settle
from support.nodes import NodeDaemon, wait_for_log
from support.storeaway import STORE_LOST

from harness.daemonproc import LAYERFS
from layerfs.builder.disk import build_disk
from layerfs.builder.env import create_env
from layerfs.errors import ObjectNotFound, StoreUnreachable
from layerfs.node.replica.replica import Replica
from layerfs.node.vms.disks import BASE_KEPT
from layerfs.refstore import ENVS, LAYERS, RefStore
from layerfs.store import open_store
from layerfs.store.base import TEMP_MARK
from layerfs.store.file import FileStore

pytestmark = pytest.mark.end_to_end  # the CLI and outside tools, end to end

NOTE = re.compile(r"^layerfs: warning: using the resolution of e@1 from "
                  r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ; store unreachable$")
LOST = STORE_LOST



@pytest.fixture
def node(starts_a_server, tmp_path, store, away_store):
    """Env e@1 (and f@1, never brought up here) and a daemon on them."""
    publish_base_env(tmp_path, store)
    create_env(RefStore(store), "f", "1", ["base@1"])
    daemon = NodeDaemon(tmp_path / "node", away_store.cli_args(), cache_size="64M",
                        read_timeout=4.0).start()
    try:
        yield daemon
    finally:
        left = daemon.cleanup()
        assert left == [], f"mounts left behind: {left}"


def up(node: NodeDaemon, ref: str, sid: str, check: bool = True):
    return node.cli("up", ref, "--id", sid, "--prefetch", "none", check=check)


def ps(node: NodeDaemon) -> dict[str, dict]:
    return {r["id"]: r for r in node.request("ps")["sandboxes"]}


@pytest.mark.daemon_log(LOST)
def test_up_with_the_store_away(node, store, away_store):
    first = Path(up(node, "e@1", "s1").stdout.strip())
    want = (first / "data" / "file0").read_bytes()
    digest = RefStore(store).resolve(ENVS, "e@1")
    away_store.away()
    try:
        named = up(node, "e@1", "s2")
        assert NOTE.match(named.stderr.strip()), named.stderr
        assert (Path(named.stdout.strip()) / "data" / "file0").read_bytes() == want
        assert re.search(r"INFO layerfs\.node\.replica\.noderefs: using the resolution of e@1 from "
                         r"\S+Z; store unreachable", node.log())
        row = ps(node)["s2"]
        assert [(o["ref"], o["digest"]) for o in row["offline"]] == [("e@1", digest)]
        assert "offline" not in ps(node)["s1"]
        assert "resolved by the node" in node.cli("ps").stdout
        by_digest = up(node, digest, "s3")  # a digest needs no store at all
        assert by_digest.stderr == "" and "offline" not in ps(node)["s3"]
        never = up(node, "f@1", "s4", check=False)
        assert never.returncode == StoreUnreachable.exit_code, never.stderr
        line, = never.stderr.strip().splitlines()
        assert line.startswith("layerfs: error: store unreachable: ") and "f@1" in line
    finally:
        away_store.back()
    wait_for_log(node, r"INFO layerfs\.node\.replica\.storehealth: store \S+ reachable again")
    again = up(node, "e@1", "s5")
    assert again.stderr == "" and "offline" not in ps(node)["s5"]
    assert up(node, "f@1", "s6").returncode == 0
    for sid in ("s1", "s2", "s3", "s5", "s6"):
        node.cli("down", sid)



@pytest.mark.daemon_log(LOST)
def test_vm_up_with_the_store_away(node, store, away_store):
    """A vm's drive set resolves its env as a sandbox does: through the node's
    last resolution while the store is away (and a never-resolved env is exit 8)."""
    up(node, "e@1", "s1")
    refstore = RefStore(store)
    layers = len(refstore.env(refstore.resolve(ENVS, "e@1")).layers)
    away_store.away()
    try:
        made = node.cli("vm", "up", "e@1", "--id", "v1", "--disk-size", "1M", "--json")
        assert NOTE.match(made.stderr.strip()), made.stderr  # one line, as up says it
        doc = json.loads(made.stdout)
        drives = doc["drives"]
        assert [d["role"] for d in drives] == ["meta", "device"] * layers + ["disk"], drives
        assert [o["ref"] for o in doc["offline"]] == ["e@1"]
        assert re.search(r"INFO layerfs\.node\.replica\.noderefs: using the resolution of e@1 "
                         r"", node.log())
        never = node.cli("vm", "up", "f@1", "--id", "v2", "--disk-size", "1M", check=False)
        assert never.returncode == StoreUnreachable.exit_code, never.stderr
        assert "v2" not in node.cli("vm", "ps").stdout  # nothing left of it
        node.cli("vm", "down", "v1")
    finally:
        away_store.back()
    node.cli("down", "s1")


@pytest.mark.daemon_log(LOST)
def test_restart_with_the_store_away(node, away_store):
    rootfs = Path(up(node, "e@1", "s1").stdout.strip())
    want = (rootfs / "data" / "file1").read_bytes()
    cached_writes_settle(node)  # (write-behind: a kill before it would lose the cache files)
    node.kill()
    away_store.away()
    try:
        node.start()
        assert ps(node)["s1"]["state"] == "up"
        assert (rootfs / "data" / "file1").read_bytes() == want
        named = up(node, "e@1", "s2")
        assert NOTE.match(named.stderr.strip()), named.stderr
        assert (Path(named.stdout.strip()) / "data" / "file1").read_bytes() == want
        wait_for_log(node, LOST)
    finally:
        away_store.back()
    wait_for_log(node, r"store \S+ reachable again")
    assert up(node, "e@1", "s3").stderr == ""
    for sid in ("s1", "s2", "s3"):
        node.cli("down", sid)


def cached_writes_settle(node: NodeDaemon, quiet: float = 0.5) -> None:
    """Wait until the daemon's cache has written nothing new for ``quiet``
    seconds: the chunks read so far are in cache files, not only in memory."""
    deadline = time.monotonic() + 30
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        written = node.request("stats")["cache"]["bytes_written"]
        if written != last:
            last, since = written, time.monotonic()
        elif written > 0 and time.monotonic() - since >= quiet:
            return
        time.sleep(0.05)
    raise AssertionError("the cache kept writing")


def test_missing_file_store_directory_is_unreachable(tmp_path):
    root = tmp_path / "store"
    FileStore(root).put("refs/envs/e/1", b"x")
    root.rename(tmp_path / "moved")
    reader = FileStore(root, must_exist=True)
    for call in (lambda: reader.get("refs/envs/e/1"), lambda: reader.head("refs/envs/e/1"),
                 lambda: reader.list("refs/"), lambda: reader.put("refs/envs/e/2", b"y"),
                 reader.list_temporaries):
        with pytest.raises(StoreUnreachable, match="does not exist"):
            call()
    assert not root.exists()  # a reader's write does not make a new, empty store
    (tmp_path / "moved").rename(root)
    assert reader.get("refs/envs/e/1") == b"x"
    with pytest.raises(ObjectNotFound):  # the directory is there: a missing object
        reader.get("refs/envs/e/2")
    writer = FileStore(tmp_path / "new")  # a writer's new store: made by its first write
    assert writer.list() == [] and writer.head("refs/x") is None
    writer.put("refs/x", b"1")
    assert not any(TEMP_MARK in p.name for p in (tmp_path / "new" / "refs").iterdir())


def test_cli_listing_a_missing_file_store_exits_8(tmp_path):
    from support.cli import layerfs

    proc = layerfs("ls", "--store", f"file://{tmp_path}/nonexistent/dir", check=False)
    assert proc.returncode == StoreUnreachable.exit_code
    line, = proc.stderr.strip().splitlines()
    assert line.startswith("layerfs: error: store unreachable: ")
    assert f"{tmp_path}/nonexistent/dir does not exist" in line


def disk_sha(node: NodeDaemon, sid: str) -> str:
    return hashlib.sha256((node.root / "fuse" / "disks" / sid).read_bytes()).hexdigest()


def offline_warning(ref: str) -> re.Pattern:
    return re.compile(rf"^layerfs: warning: using the resolution of {re.escape(ref)} "
                      r"from \S+Z; store unreachable$")


@pytest.mark.daemon_log(LOST)
def test_disks_over_a_base_with_the_store_away(node, store, away_store, tmp_path):
    """Writable disks over a sealed base, one of them written and committed,
    come back after a kill -9 and a start with the store away and read the
    same bytes; a disk made from a base this node holds (one a disk recorded
    before the node kept resolutions, or its own commit) is made without the
    store, by its last resolution, said once; a base it never resolved is
    exit 8; a vm over such a base keeps its offline note through a restart."""
    image = tmp_path / "base.img"
    image.write_bytes(os.urandom(3 << 20))
    build_disk(RefStore(store), str(image), "vmbase", "1")
    other = build_disk(RefStore(store), str(image), "vmother", "1").digest
    node.cli("disk", "create", "d0", "--base", "vmbase@1")
    node.cli("disk", "create", "d1", "--base", "vmbase@1")
    with open(node.root / "fuse" / "disks" / "d1", "r+b") as f:
        f.write(os.urandom(1 << 16))
    node.cli("disk", "commit", "d1", "--name", "vmcommit", "--version", "1")
    want = {sid: disk_sha(node, sid) for sid in ("d0", "d1")}
    assert want["d0"] != want["d1"]
    settle(node)  # its chunks written to the cache: a kill -9 loses the writes in flight
    node.kill()
    with closing(Replica(node.root)) as replica:  # d0 as a disk from before kept resolutions
        replica.forget_resolution(LAYERS, "vmbase", "1")
    kept = node.root / "disks" / "d0" / BASE_KEPT
    kept.unlink()
    away_store.away()
    try:
        node.start()
        rows = {r["id"]: r for r in node.request("disk-ls")["disks"]}
        assert sorted(rows) == ["d0", "d1"] and not any(
            r.get("state") == "broken" for r in rows.values()), rows
        assert {sid: disk_sha(node, sid) for sid in want} == want
        assert kept.exists()  # kept once, not at every start
        for sid, base in (("d2", "vmbase@1"), ("d3", "vmcommit@1")):
            made = node.cli("disk", "create", sid, "--base", base)
            assert offline_warning(base).match(made.stderr.strip()), made.stderr
        assert disk_sha(node, "d2") == want["d0"]  # vmbase's chunks are in the cache
        with open(node.root / "fuse" / "disks" / "d3", "rb") as d3, \
                open(node.root / "fuse" / "disks" / "d0", "rb") as d0:
            d3.seek(2 << 20)  # beyond the commit's chunks (1 MiB each), which d3 reads lazily
            d0.seek(2 << 20)
            assert d3.read() == d0.read()
        for ref in ("vmother@1", other):
            never = node.cli("disk", "create", "d4", "--base", ref, check=False)
            assert never.returncode == StoreUnreachable.exit_code, never.stderr
            line, = never.stderr.strip().splitlines()
            assert f"{ref} was never resolved on this node" in line, line
        vm = node.cli("vm", "up", "--id", "v1", "--base-disk", "vmbase@1", "--json")
        assert offline_warning("vmbase@1").match(vm.stderr.strip()), vm.stderr
        doc = json.loads(vm.stdout)
        assert [o["ref"] for o in doc["offline"]] == ["vmbase@1"]
        disk = doc["drives"][-1]["path_on_host"]
        assert hashlib.sha256(Path(disk).read_bytes()).hexdigest() == want["d0"]
        node.kill()
        node.start()
        v1, = json.loads(node.cli("vm", "ps", "--json").stdout)
        assert [o["ref"] for o in v1["offline"]] == ["vmbase@1"], v1
        assert "using the resolution of vmbase@1 from" in node.cli("vm", "ps").stdout
        node.cli("vm", "down", "v1")
    finally:
        away_store.back()
    for sid in ("d0", "d1", "d2", "d3"):
        node.cli("disk", "rm", sid)


@pytest.fixture
def hung_node(tmp_path, s3_server):
    """Envs e@1 and f@1 in an S3 store the daemon reaches directly (no relay),
    so that SIGSTOP of the server hangs every request: connections accepted,
    nothing answered. The daemon waits for it at most 1 s (``--store-wait``)."""
    url = f"s3://{TEST_BUCKET}/t/{uuid.uuid4().hex[:16]}"
    store = open_store(url, s3_server.endpoint)
    publish_base_env(tmp_path, store)
    create_env(RefStore(store), "f", "1", ["base@1"])
    store.close()
    daemon = NodeDaemon(tmp_path / "node", ["--store", url, "--s3-endpoint", s3_server.endpoint],
                        cache_size="64M", read_timeout=4.0)
    daemon.extra_args = ["--store-wait", "1"]
    daemon.start()
    try:
        yield daemon
    finally:
        left = daemon.cleanup()
        assert left == [], f"mounts left behind: {left}"


@pytest.mark.daemon_log(LOST)
def test_ups_fall_back_together_when_the_store_hangs(hung_node, s3_server):
    """A SIGSTOPped S3 server: the ups waiting on it fall back to the node's
    resolution together, once --store-wait is up (one outage line, not one per
    up); an env never resolved here fails with exit 8 saying so."""
    node = hung_node
    want = (Path(up(node, "e@1", "s0").stdout.strip()) / "data" / "file0").read_bytes()
    wait_for_log(node, r"INFO layerfs\.node\.[\w.]+: layerfs daemon ready")
    os.kill(s3_server.process.pid, signal.SIGSTOP)
    try:
        argv = [*LAYERFS, "up", "e@1", "--prefetch", "none", "--root", str(node.root)]
        started = time.monotonic()
        procs = [subprocess.Popen([*argv, "--id", f"s{i}"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for i in range(1, 5)]
        outs = [(p.wait(timeout=60), *p.communicate()) for p in procs]
        took = time.monotonic() - started
        for rc, stdout, stderr in outs:
            assert rc == 0 and NOTE.match(stderr.strip()), stderr
            assert (Path(stdout.strip()) / "data" / "file0").read_bytes() == want
        never = up(node, "f@1", "s9", check=False)
        assert never.returncode == StoreUnreachable.exit_code, never.stderr
        line, = never.stderr.strip().splitlines()
        assert "f@1 was never resolved on this node" in line, line
        lost = re.findall(LOST, node.log())
        assert len(lost) == 1, lost  # one outage, found once, for every waiting up
        print(f"4 concurrent ups of a resolved env with the store hung: {took:.2f}s")
    finally:
        os.kill(s3_server.process.pid, signal.SIGCONT)
    wait_for_log(node, r"INFO layerfs\.node\.replica\.storehealth: store \S+ reachable again")
    for sid in ("s0", "s1", "s2", "s3", "s4"):
        node.cli("down", sid)
