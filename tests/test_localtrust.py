"""The node does not trust its own disk: a meta image replaced under ROOT/meta
is never mounted as is, a cache file replaced by another chunk's is never
served, and a full ROOT leaves no temporary meta images behind. Real daemons,
kernel mounts, both store backends."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import build, need_root
from support.nodes import NodeDaemon, serving

from layerfs.errors import NodeFull
from layerfs.refstore import RefStore

CHUNK = 65536


@pytest.fixture
def two_layers(tmp_path, store) -> dict[str, str]:
    """Layers a@1 and b@1 of different trees; name → manifest digest."""
    need_root()
    digests = {}
    for name in ("a", "b"):
        src = tmp_path / f"src-{name}"
        (src / "data").mkdir(parents=True)
        (src / "which").write_text(f"layer {name}\n")
        for i in range(2):
            (src / "data" / f"f{i}").write_bytes(os.urandom(3 * CHUNK))
        digests[name] = build(store, str(src), name=name, chunk_size=CHUNK).digest
    return digests


@pytest.fixture
def node(starts_a_server, tmp_path, store_location, two_layers) -> Iterator[NodeDaemon]:
    yield from serving(NodeDaemon(tmp_path / "node", store_location.cli_args(),
                                  cache_size="64M"))


def up(node: NodeDaemon, sid: str, layer: str) -> Path:
    return Path(node.cli("up", "--layer", layer, "--id", sid).stdout.strip())


def meta_path(node: NodeDaemon, digest: str) -> Path:
    return node.root / "meta" / (digest.removeprefix("sha256:") + ".erofs")


@pytest.mark.parametrize("replacement", ["other-layer", "garbage"])
@pytest.mark.daemon_log(r"local meta image \S+ does not match its manifest's digest")
def test_a_replaced_meta_image_is_never_mounted(node, two_layers, replacement):
    up(node, "s0", "b@1")  # b's meta image is now in ROOT/meta too
    node.cli("down", "s0")
    up(node, "s1", "a@1")
    node.cli("down", "s1")  # a's layer is unmounted; its meta image stays
    victim = meta_path(node, two_layers["a"])
    good = victim.read_bytes()
    if replacement == "other-layer":
        fake = meta_path(node, two_layers["b"]).read_bytes()  # a valid image of b
    else:
        fake = os.urandom(len(good))
    victim.write_bytes(fake)
    rootfs = up(node, "s2", "a@1")
    assert (rootfs / "which").read_text() == "layer a\n"  # a's tree, not b's
    assert victim.read_bytes() == good  # fetched again from the store
    warnings = [line for line in node.log().splitlines()
                if "does not match its manifest's digest" in line]
    assert len(warnings) == 1 and str(victim) in warnings[0]
    node.cli("down", "s2")


def chunk_sha(data: bytes, index: int) -> str:
    return hashlib.sha256(data[index * CHUNK : (index + 1) * CHUNK]).hexdigest()


@pytest.mark.daemon_log(r"cache file \S+ is damaged")
def test_a_cache_file_of_another_chunk_is_never_served(node, store, two_layers):
    rootfs = up(node, "s1", "a@1")
    want = (rootfs / "data" / "f0").read_bytes()
    other = (rootfs / "data" / "f1").read_bytes()
    node.cli("down", "s1")
    assert node.stop() == 0  # drop the daemon's memory and the kernel's page cache
    refstore = RefStore(store)
    table = {e.sha256.hex() for e in refstore.chunk_table(refstore.layer(two_layers["a"])).entries}
    victim_sha, donor_sha = chunk_sha(want, 1), chunk_sha(other, 1)
    assert {victim_sha, donor_sha} <= table
    cache = node.root / "cache"
    victim = cache / victim_sha[:2] / victim_sha
    shutil.copyfile(cache / donor_sha[:2] / donor_sha, victim)  # a valid file, another chunk
    node.start()
    before = node.request("stats")["cache"]
    rootfs = up(node, "s2", "a@1")
    assert (rootfs / "data" / "f0").read_bytes() == want
    after = node.request("stats")["cache"]
    assert after["corrupt"] == 1
    assert after["bytes_fetched"] - before["bytes_fetched"] >= CHUNK  # refetched
    lines = [line for line in node.log().splitlines() if "damaged" in line]
    assert len(lines) == 1 and victim_sha in lines[0] and donor_sha in lines[0]
    node.cli("down", "s2")


@pytest.fixture
def small_root(tmp_path) -> Iterator[Path]:
    """A directory on an 8 MiB ext4 file system (loop-mounted), for ROOT."""
    need_root()
    image, mnt = tmp_path / "fs.img", tmp_path / "fs"
    with open(image, "wb") as f:
        f.truncate(8 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    mnt.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    try:
        yield mnt / "root"  # a subdirectory: the daemon detaches mounts at or below ROOT
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def fill(path: Path, leave: int) -> None:
    """Take the file system's free space down to about ``leave`` bytes."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    with open(path / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.daemon_log(r"removing stale temporary \S+0123\.tmp4242", r"No space left on device",
                        r"WARNING layerfs\.node\.daemon\.service: cache bound lowered from ")
def test_a_full_root_leaves_no_temporary_meta_images(tmp_path, store, store_location,
                                                      small_root):
    src = tmp_path / "many"
    src.mkdir()
    for i in range(1500):  # small files live inline in the meta image: ~3 MiB of it
        (src / f"f{i:04d}").write_bytes(os.urandom(2000))
    build(store, str(src), name="big-meta", chunk_size=CHUNK)
    stale = small_root / "meta" / "0123.tmp4242"  # as a killed daemon leaves it
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"partial")
    node = NodeDaemon(small_root, store_location.cli_args(), cache_size="1M").start()
    try:
        assert not stale.exists()  # removed at start
        fill(small_root, leave=1 << 20)
        proc = node.cli("up", "--layer", "big-meta@1", "--id", "s1", check=False)
        assert proc.returncode == NodeFull.exit_code, proc.stderr
        errors = proc.stderr.strip().splitlines()
        assert len(errors) == 1 and errors[0].startswith("layerfs: error: ROOT is full: ")
        assert [p.name for p in (small_root / "meta").iterdir()] == []
        assert node.request("ps")["sandboxes"] == []
    finally:
        assert node.cleanup() == []


@pytest.mark.daemon_log(r"local meta image \S+ does not match its manifest's digest")
def test_vm_up_hands_out_only_a_checked_meta_image(node, store, two_layers):
    up(node, "s0", "b@1")
    node.cli("down", "s0")
    up(node, "s1", "a@1")
    node.cli("down", "s1")
    victim = meta_path(node, two_layers["a"])
    victim.write_bytes(meta_path(node, two_layers["b"]).read_bytes())
    vm = json.loads(node.cli("vm", "up", "--layer", "a@1", "--id", "v1",
                             "--disk-size", "16M", "--json").stdout)
    drives = {d["drive_id"]: d for d in vm["drives"]}
    meta = Path(drives[vm["layers"][0]["meta_drive"]]["path_on_host"])
    refstore = RefStore(store)
    want = refstore.layer(two_layers["a"]).meta.raw_digest
    assert "sha256:" + hashlib.sha256(meta.read_bytes()).hexdigest() == want
    node.cli("vm", "down", "v1")
