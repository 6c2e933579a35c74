"""Node leases and revocations, on both store backends: what a node's sandboxes
and vms use is in its lease, so `rm` + `gc --grace 0` leaves them reading
(gc says what it kept and for whom, `rm` who still holds the layer); once they
are down gc frees it. A revoked env or layer is refused by the node's next
`up`, its store away or not, and `revoke` names the sandboxes still on it."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from support import build
from support.baseenv import CHUNK, publish_base_env
from support.nodes import NodeDaemon
from support.storeaway import STORE_LOST

from harness.daemonproc import LAYERFS
from harness.s3server import free_ports
from layerfs.builder.disk import build_disk
from layerfs.errors import Revoked
from layerfs.gc import collect
from layerfs.leases import Holder, Lease, lease_key, write_lease
from layerfs.refstore import ENVS, LAYERS, RefStore
from layerfs.retention import remove
from layerfs.store.base import Store

TTL = "5"  # seconds: the node renews every second
LOST = STORE_LOST



@pytest.fixture
def node(starts_a_server, tmp_path, store, away_store):
    """Env e@1 (layers up@1 over base@1) and a daemon on it with a 5 s lease."""
    publish_base_env(tmp_path, store)
    daemon = NodeDaemon(tmp_path / "node", away_store.cli_args(), cache_size="64M",
                        read_timeout=4.0)
    daemon.extra_args = ["--lease-ttl", TTL]
    daemon.start()
    try:
        yield daemon
    finally:
        left = daemon.cleanup()
        assert left == [], f"mounts left behind: {left}"


def cli(store_args: list[str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*LAYERFS, *args, *store_args], capture_output=True, text=True,
                          timeout=120)
    assert not check or proc.returncode == 0, proc.stderr
    return proc


def node_id(node: NodeDaemon) -> str:
    return (node.root / "node-id").read_text().strip()


def lease(store: Store, node: NodeDaemon) -> Lease:
    key = lease_key(node_id(node))
    return Lease.from_bytes(store.get(key), key)


def renewed(store: Store, node: NodeDaemon, timeout: float = 20.0) -> Lease:
    """The node's lease once it has been written twice more (so that the
    revocations read after the first of them are in the node's replica)."""
    deadline = time.monotonic() + timeout
    since = time.time()
    for _ in range(2):
        while (got := lease(store, node)).renewed <= since:
            assert time.monotonic() < deadline, "the node's lease is not renewed"
            time.sleep(0.1)
        since = got.renewed
    return got


def read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def test_gc_keeps_what_a_running_sandbox_and_a_vm_use(node, store, store_args, tmp_path):
    rootfs = Path(node.cli("up", "e@1", "--id", "s1", "--prefetch", "none").stdout.strip())
    vm = json.loads(node.cli("vm", "up", "e@1", "--id", "v1", "--disk-size", "1M",
                             "--json").stdout)
    devices = [Path(d["path_on_host"]) for d in vm["drives"] if d["role"] == "device"]
    refstore = RefStore(store)
    env = refstore.env(refstore.resolve(ENVS, "e@1"))
    held = {h.kind + " " + h.id: h for h in renewed(store, node).holders}
    layers = [layer.digest for layer in env.layers]
    assert list(held["sandbox s1"].digests) == layers and list(held["vm v1"].digests) == layers

    removed = cli(store_args, "rm", "e@1", "up@1", "base@1").stdout
    who = f"node {node_id(node)} "
    assert re.search(rf"removed layer base@1\n  still held by {who}\(\S+\) sandbox s1, "
                     rf"{who}\(\S+\) vm v1", removed), removed
    doc = json.loads(cli(store_args, "gc", "--grace", "0", "--json").stdout)
    kept = {(k["holder"], k["digest"]): k for k in doc["kept_for_leases"]}
    assert set(kept) == {(h, d) for h in ("sandbox s1", "vm v1") for d in layers}, kept
    assert all(not k["gone"] for k in kept.values())
    assert all(kept["sandbox s1", d]["blobs"] > 2 and kept["vm v1", d]["blobs"] == 0
               for d in layers)  # (the holder first in the lease counts them)
    assert node_id(node) in doc["live_leases"]
    text = cli(store_args, "gc", "--grace", "0").stdout
    assert f"kept for {who}" in text and "sandbox s1: sha256:" in text

    # every byte still reads, though no ref reaches it: in the sandbox, and the vm's devices
    base = tmp_path / "base" / "data"
    assert read_tree(rootfs / "data") == read_tree(base)
    sizes = [(len(device.read_bytes()), device.stat().st_size) for device in devices]
    assert all(got == size for got, size in sizes) and sum(s for s, _ in sizes) > CHUNK, sizes

    node.cli("down", "s1")
    node.cli("vm", "down", "v1")
    assert renewed(store, node).holders == []
    freed = json.loads(cli(store_args, "gc", "--grace", "0", "--json").stdout)
    assert freed["kept_for_leases"] == [] and freed["deleted"] > 0
    assert not [d for d in layers if store.exists("blobs/sha256/" + d[7:])]


@pytest.mark.daemon_log(LOST)
def test_a_revoked_env_or_layer_is_refused_with_the_store_away(node, store, store_args,
                                                                away_store):
    node.cli("up", "e@1", "--id", "s1", "--prefetch", "none")
    renewed(store, node)  # (s1 in the node's lease)
    refstore = RefStore(store)
    digest = refstore.resolve(LAYERS, "up@1")
    made = cli(store_args, "revoke", "up@1", "--reason", "leaked key").stdout
    assert made.startswith(f"revoked layer up@1 ({digest}): nodes refuse new ups of it"), made
    assert f"still on it: node {node_id(node)} " in made and "sandbox s1" in made
    assert "layerfs down --force s1" in made
    renewed(store, node)
    refused = node.cli("up", "e@1", "--id", "s2", check=False)
    assert refused.returncode == Revoked.exit_code, refused.stderr
    line, = refused.stderr.strip().splitlines()
    assert f"layer {digest} of env e@1 is revoked since " in line and "leaked key" in line
    env_digest = refstore.resolve(ENVS, "e@1")
    away_store.away()
    try:
        for args in (["e@1"], [env_digest], ["--layer", digest]):
            again = node.cli("up", *args, "--id", "s3", check=False)
            assert again.returncode == Revoked.exit_code, (args, again.stderr)
        vm = node.cli("vm", "up", "e@1", "--id", "v1", "--disk-size", "1M", check=False)
        assert vm.returncode == Revoked.exit_code, vm.stderr
        assert "s1" in node.cli("ps").stdout  # what was up stays up, for an operator
    finally:
        away_store.back()
    node.cli("down", "--force", "s1")
    cli(store_args, "unrevoke", "up@1")
    renewed(store, node)
    node.cli("up", "e@1", "--id", "s4", "--prefetch", "none")
    renewed(store, node)
    made = cli(store_args, "revoke", "e@1", "--json").stdout  # the env itself, this time
    assert [h["id"] for h in json.loads(made)["still_on_it"]] == ["s4"], made
    renewed(store, node)
    refused = node.cli("up", "e@1", "--id", "s5", check=False)
    assert refused.returncode == Revoked.exit_code, refused.stderr
    assert f"env e@1 ({env_digest}) is revoked since " in refused.stderr
    assert node.cli("up", "--layer", digest, "--id", "s5").returncode == 0  # its layer is not
    cli(store_args, "unrevoke", "e@1")
    for sid in ("s4", "s5"):
        node.cli("down", sid)
    gone = cli(store_args, "unrevoke", "up@1", check=False)
    assert gone.returncode == 5 and "no such revocation: up@1 (sha256:" in gone.stderr


@pytest.mark.daemon_log(r"ERROR layerfs\.node\.sandboxes\.dataloss: sandbox s[12]: the data of "
                        r"its layer ",
                        r"ERROR layerfs\.node\.reads\.fetcher: chunk \w+: object not found",
                        r"ERROR layerfs\.node\.fuse\.nodefs: ")
def test_a_sandbox_whose_data_is_gone_says_so(node, store, tmp_path):
    """Its packs deleted behind the node's back (here by hand; a gc that knew
    no lease, a lost volume): the read fails, and ps, the log and the metric
    say which sandbox lost which layer."""
    port = free_ports(1)[0]
    node.stop()
    node.extra_args += ["--metrics", f"127.0.0.1:{port}"]
    node.start()
    rootfs = Path(node.cli("up", "e@1", "--id", "s1", "--prefetch", "none").stdout.strip())
    node.cli("up", "e@1", "--id", "s2", "--prefetch", "none")
    refstore = RefStore(store)
    base = refstore.resolve(LAYERS, "base@1")
    for pack in refstore.chunk_table(refstore.layer(base)).packs():
        store.delete("blobs/sha256/" + pack.removeprefix("sha256:"))
    with pytest.raises(OSError) as failed:
        (rootfs / "data" / "file2").read_bytes()
    assert failed.value.errno == errno.EIO
    states = {r["id"]: r["state"] for r in node.request("ps")["sandboxes"]}
    assert states == {"s1": "data_lost", "s2": "data_lost"}, states
    assert re.search(r"s1 +data_lost ", node.cli("ps").stdout)
    assert re.search(rf"ERROR layerfs\.node\.sandboxes\.dataloss: sandbox s1: the data of its "
                     rf"layer "
                     rf"{base} \(e@1\) is gone from the store \(pack sha256:\w+ missing\)",
                     node.log())
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        metrics = reply.read().decode()
    assert f'layerfs_sandbox_data_lost_total{{layer="{base}"}} 2.0' in metrics, metrics
    node.cli("down", "s1")
    node.kill()  # a restarted daemon says so too, for the sandbox still up
    node.start()
    assert [(r["id"], r["state"]) for r in node.request("ps")["sandboxes"]] == [
        ("s2", "data_lost")]
    node.cli("down", "s2")


def test_gc_keeps_a_vms_drive_chain(node, store, store_args, tmp_path):
    """A vm over a disk chain (a commit over a sealed base): both refs removed,
    gc keeps the chain for the vm's writable disk, and the disk reads the same."""
    image = tmp_path / "base.img"
    image.write_bytes(os.urandom(3 << 20))
    build_disk(RefStore(store), str(image), "vmbase", "1")
    node.cli("disk", "create", "d1", "--base", "vmbase@1")
    with open(node.root / "fuse" / "disks" / "d1", "r+b") as f:
        f.write(os.urandom(1 << 16))
    node.cli("disk", "commit", "d1", "--name", "vmcommit", "--version", "1")
    node.cli("disk", "rm", "d1")
    vm = json.loads(node.cli("vm", "up", "--id", "v1", "--base-disk", "vmcommit@1",
                             "--json").stdout)
    disk = Path(vm["drives"][-1]["path_on_host"])
    top = RefStore(store).resolve(LAYERS, "vmcommit@1")
    held = {str(h): h for h in renewed(store, node).holders}
    assert held["disk v1-rw"].digests == (top,), held
    cli(store_args, "rm", "vmcommit@1", "vmbase@1")
    doc = json.loads(cli(store_args, "gc", "--grace", "0", "--json").stdout)
    kept, = doc["kept_for_leases"]
    assert (kept["holder"], kept["digest"]) == ("disk v1-rw", top) and kept["blobs"] > 3, kept
    assert disk.read_bytes()[(1 << 16):] == image.read_bytes()[(1 << 16):]
    node.cli("vm", "down", "v1")


def test_gc_and_expired_or_unreadable_leases(store, tmp_path):
    """A lease past its expiry keeps nothing (deleted a day after); one that
    cannot be read stops the sweep, as an unreadable ref does."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(200_000))
    refstore = RefStore(store)
    digest = build(store, str(src), name="t").digest
    now = time.time()
    old = Lease("gone-node", "h1", now - 3 * 86400, now - 2 * 86400,
                [Holder("sandbox", "s1", (digest,))])
    late = Lease("late-node", "h2", now - 20, now - 10, [Holder("sandbox", "s2", (digest,))])
    for lease in (old, late):
        write_lease(store, lease)
    remove(refstore, ["t@1"])
    report = collect(refstore, dry_run=False, grace=0)
    assert report.kept_for_leases == [] and report.deleted > 2 and report.swept
    assert {(e["node"], e["deleted"]) for e in report.expired_leases} == {
        ("gone-node", True), ("late-node", False)}
    assert store.head(lease_key("gone-node")) is None
    assert store.head(lease_key("late-node")) is not None

    store.put(lease_key("bad-node"), b"not json")
    store.put(lease_key("liar"), late.to_bytes())  # names late-node: not gc's to delete
    digest = build(store, str(src), name="u").digest
    remove(refstore, ["u@1"])
    report = collect(refstore, dry_run=False, grace=0)
    assert not report.swept and report.deleted == 0
    assert {u.what for u in report.unreadable} == {"lease bad-node", "lease liar"}
    assert "names node 'late-node'" in str(report.unreadable)


@pytest.mark.daemon_log(LOST)
def test_a_sandbox_up_while_the_store_was_away_is_kept(node, store, store_args, away_store):
    """Brought up from the node's resolution with the store away, the sandbox
    is in the node's lease soon after the store is back; gc then keeps it."""
    node.cli("up", "e@1", "--id", "s1", "--prefetch", "none")
    node.cli("down", "s1")
    away_store.away()
    try:
        rootfs = Path(node.cli("up", "e@1", "--id", "s2", "--prefetch", "none").stdout.strip())
    finally:
        away_store.back()
    held = renewed(store, node, timeout=30).holders
    assert [str(h) for h in held] == ["sandbox s2"], held
    cli(store_args, "rm", "e@1", "up@1", "base@1")
    doc = json.loads(cli(store_args, "gc", "--grace", "0", "--json").stdout)
    assert {k["holder"] for k in doc["kept_for_leases"]} == {"sandbox s2"}
    assert read_tree(rootfs / "data") == read_tree(node.root.parent / "base" / "data")
    node.cli("down", "s2")
