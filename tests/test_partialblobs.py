"""Larger layers over partial blob files the daemon fills as they are read
(``--kernel-reads``, layerfs/node/reads/partialblobs.py, fanotify pre-content
events kept by the keeper): the same bytes as the source, reads of data the
node holds answered without a store request, a file left with wrong bytes
fetched again, a layer unmounted while its read-ahead fills, a damaged
chunk failing only the file that holds it, a daemon killed while a read
waits (the next daemon answers it), and a read still waiting when no daemon
comes back fails with EIO, not with the file's holes; a sandbox that read
a layer while its daemon and keeper were both dead is marked data_lost.

Tier: node (a real daemon, kernel EROFS and overlay mounts, fanotify; root).
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import build, damage_chunk, need_root
from support.nodes import NodeDaemon, serving, wait_for
from support.nodes import up_lazy as up

from layerfs.builder.env import create_env
from layerfs.refstore import RefStore


def make_tree(root: Path, seed: int) -> dict[str, str]:
    """Three files of several chunks each and 60 small ones; sha256 by path."""
    rng = random.Random(seed)
    sums = {}
    for i, size in enumerate((5 << 20 | 123, 3 << 20, 2 << 20 | 777)):
        sums[f"big{i}"] = write(root / f"big{i}", rng.randbytes(size))
    for i in range(60):
        sums[f"small/f{i}"] = write(root / f"small/f{i}", rng.randbytes(rng.randint(100, 20000)))
    return sums


def write(path: Path, data: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def sums_of(top: Path, names) -> dict[str, str]:
    return {rel: hashlib.sha256((top / rel).read_bytes()).hexdigest() for rel in names}


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


@pytest.fixture
def published(tmp_path, store):
    """Env e@1: a layer of 10 MiB (``data``, larger than --fetch-whole-below)
    over a busybox base; the data's sums."""
    need_root()
    base = tmp_path / "base"
    for sub in ("bin", "proc", "dev", "tmp"):
        (base / sub).mkdir(parents=True)
    shutil.copy("/bin/busybox", base / "bin" / "busybox")
    sums = make_tree(tmp_path / "dsrc" / "data", seed=36)
    build(store, str(base), name="base")
    build(store, str(tmp_path / "dsrc"), name="data")
    create_env(RefStore(store), "e", "1", ["data@1", "base@1"])
    return sums


def new_node(tmp_path: Path, store_location, grace: float = 60) -> NodeDaemon:
    node = NodeDaemon(tmp_path / "node", store_location.cli_args(), cache_size="256M",
                      read_timeout=4.0, whole_below="1M", kernel_reads=True)
    node.extra_args = ["--restart-grace", str(grace)]
    return node


@pytest.fixture
def node(tmp_path, store_location, published):
    yield from serving(new_node(tmp_path, store_location))


def data_hex(store) -> str:
    return RefStore(store).resolve("layers", "data@1").removeprefix("sha256:")


def test_a_large_layer_is_read_through_its_partial_file(node, published, store):
    rootfs = up(node, "s1")
    layer = node.request("stats")["layers"]["sha256:" + data_hex(store)]
    assert layer["partial"] and not layer["local"]
    assert sums_of(rootfs / "data", published) == published
    partial = node.root / "blobs" / "partial" / data_hex(store)
    assert partial.stat().st_uid == 0 and partial.stat().st_mode & 0o077 == 0
    before = node.request("stats")["store"].get("get", 0)
    drop_caches()  # the data is on the node: read again without a store request
    assert sums_of(rootfs / "data", published) == published
    assert node.request("stats")["store"].get("get", 0) == before
    node.cli("down", "s1")


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.daemon\.service: unmounted stale ")
def test_wrong_bytes_left_in_a_partial_file_are_fetched_again(node, published, store):
    rootfs = up(node, "s1")
    assert sums_of(rootfs / "data", published) == published
    node.cli("down", "s1")  # unmounted, unmarked: the file is kept
    partial = node.root / "blobs" / "partial" / data_hex(store)
    with open(partial, "r+b") as f:
        for offset in range(0, partial.stat().st_size, 1 << 20):
            f.seek(offset + 4096)
            f.write(b"\xa5" * 4096)
    drop_caches()
    rootfs = up(node, "s2")
    assert sums_of(rootfs / "data", published) == published
    node.cli("down", "s2")


READER = "import sys, hashlib; print(hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest())"


def start_reader(path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", READER, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def waiting(reader: subprocess.Popen[str], seconds: float = 1.0) -> bool:
    """Whether the reader is still blocked after ``seconds``."""
    time.sleep(seconds)
    return reader.poll() is None


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.daemon\.service: unmounted stale ")
def test_a_read_waiting_on_a_killed_daemon_is_answered_by_the_next(node, published):
    rootfs = up(node, "s1")
    os.kill(node.proc.pid, signal.SIGSTOP)  # events reach it and wait
    try:
        reader = start_reader(rootfs / "data" / "big0")
        assert waiting(reader)
    finally:
        os.kill(node.proc.pid, signal.SIGKILL)
    node.kill()
    node.start()  # takes the connection and the group over from the keeper
    out, err = reader.communicate(timeout=60)
    assert reader.returncode == 0, err
    assert out.strip() == published["big0"]
    node.cli("down", "s1")


def kill_daemon_and_keeper(node: NodeDaemon) -> None:
    keeper = int(re.findall(r"the FUSE connection is kept by pid (\d+)", node.log())[-1])
    node.kill()
    os.kill(keeper, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{keeper}").exists()
             or " Z " in Path(f"/proc/{keeper}/stat").read_text(), "the keeper to die")


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.daemon\.service: unmounted stale ",
                        r"ERROR layerfs\.node\.sandboxes\.dataloss: sandbox s1: its layer "
                        r"sha256:[0-9a-f]{64} \(e@1\) was read with no daemon and no keeper")
def test_a_sandbox_read_without_daemon_and_keeper_is_marked_data_lost(node, published, store):
    """kill -9 of the daemon and of its keeper ends the pre-content group,
    and the partial file's mark with it: the layer's mount reads the file's
    holes (zeros) until the next daemon, and a process holding the old mount
    reads them still. The next daemon marks the sandbox ``data_lost`` (one
    ERROR line, the layer named) for the scheduler to replace it."""
    rootfs = up(node, "s1")
    kill_daemon_and_keeper(node)
    assert sums_of(rootfs / "data", ["big1"])["big1"] != published["big1"]  # holes
    node.start()
    ps = {r["id"]: r for r in node.request("ps")["sandboxes"]}
    assert ps["s1"]["state"] == "data_lost"
    assert sums_of(rootfs / "data", published) == published  # mounted again, filled
    node.cli("down", "s1")


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.daemon\.service: unmounted stale ")
def test_a_complete_partial_file_read_without_its_group_marks_nothing(node, published):
    """The same crash after every chunk of both layers came in: their files
    have no hole, so nothing unverified could be read, and the sandbox stays up."""
    rootfs = up(node, "s1")
    assert sums_of(rootfs / "data", published) == published
    assert (rootfs / "bin" / "busybox").read_bytes() == Path("/bin/busybox").read_bytes()
    kill_daemon_and_keeper(node)
    node.start()
    ps = {r["id"]: r for r in node.request("ps")["sandboxes"]}
    assert ps["s1"]["state"] == "up"
    node.cli("down", "s1")


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.daemon\.service: unmounted stale ",
                        r"WARNING layerfs\.node\.fuse\.keeper: \d+ reads of partly fetched",
                        r"WARNING layerfs\.node\.fuse\.keeper: no daemon took the FUSE",
                        r"WARNING layerfs\.node\.fuse\.keeper: the keeper keeps the pre")
def test_a_read_no_daemon_answers_fails_with_eio_not_holes(tmp_path, store_location,
                                                          published):
    node = new_node(tmp_path, store_location, grace=1).start()
    try:
        rootfs = up(node, "s1")
        os.kill(node.proc.pid, signal.SIGSTOP)
        reader = start_reader(rootfs / "data" / "big1")
        try:
            assert waiting(reader)
        finally:
            os.kill(node.proc.pid, signal.SIGKILL)
        node.kill()  # no daemon comes back: the keeper denies the read and lingers
        out, err = reader.communicate(timeout=60)
        assert reader.returncode != 0 and "Input/output error" in err, (out, err)
        assert out.strip() != published["big1"]
        again = start_reader(rootfs / "data" / "big1")  # a read of the holes, later
        out, err = again.communicate(timeout=60)
        assert again.returncode != 0 and "Input/output error" in err, (out, err)
        node.start()  # takes the group from the lingering keeper, which exits
        rootfs = up(node, "s2")
        assert sums_of(rootfs / "data", published) == published
    finally:
        assert node.cleanup() == []


def test_a_layer_unmounted_while_its_read_ahead_fills_leaves_the_daemon_serving(node,
                                                                               published):
    rootfs = up(node, "s1")
    with open(rootfs / "data" / "big0", "rb") as f:  # a stream: fills run ahead of it
        for _ in range(3):
            f.read(1 << 20)
    node.cli("down", "s1")  # while those fills may still be writing
    rootfs = up(node, "s2")
    assert sums_of(rootfs / "data", published) == published
    node.cli("down", "s2")


@pytest.mark.daemon_log(r"ERROR layerfs\.node\.reads\.fetcher: .*(sha256 mismatch|cannot "
                        r"decompress)",
                        r"ERROR layerfs\.node\.reads\.fetcher: chunk \S+: ",
                        r"WARNING layerfs\.node\.reads\.partialblobs: a read of layer data "
                        r"failed \(EIO\)")
def test_a_damaged_chunk_fails_only_the_reads_that_need_it(node, published, store):
    damage_chunk(store, "sha256:" + data_hex(store))  # in the last big file
    rootfs = up(node, "s1")
    got = {}
    for rel in published:
        try:
            got[rel] = hashlib.sha256((rootfs / "data" / rel).read_bytes()).hexdigest()
        except OSError as exc:
            got[rel] = errno.errorcode[exc.errno or 0]
    bad = {rel for rel, s in got.items() if s != published[rel]}
    assert len(bad) == 1 and got[bad.pop()] == "EIO"
    assert node.request("stats")["layers"]["sha256:" + data_hex(store)]["partial"]
    node.cli("down", "s1")
