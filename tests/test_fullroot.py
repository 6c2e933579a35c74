"""A full ROOT is an ordinary day: a real daemon on a small ext4 ROOT that a
sandbox fills until ENOSPC keeps serving reads (not cached, a rate-limited
warning), refuses a new ``up`` and a ``run`` with exit 16 on one line, takes
the full sandbox down, and brings sandboxes up again once there is room; the
cache's bound is lowered at start to what the file system has room for. The
replica's LMDB commits on a full file system get the held space back. Over a
partial blob file, a read that finds no room fails with EIO, never returns
other bytes, and succeeds once there is room."""

from __future__ import annotations

import errno
import logging
import os
import re
from pathlib import Path

import pytest
from support import MiB, build, need_root, small_ext4
from support.nodes import NodeDaemon

from layerfs.errors import NodeFull
from layerfs.node.replica.replica import Replica
from layerfs.node.sandboxes.rootspace import RootSpace
from layerfs.ratelog import RateLimitedLog
from layerfs.store.file import FileStore

CACHE_WARNING = r"cannot write cache file for chunk \w+: \[Errno 28\]"
HELD_GIVEN_UP = r"gave up the \d+ MiB held for the daemon's state"
CACHE_LOWERED = r"WARNING layerfs\.node\.daemon\.service: cache bound lowered from "


def fill_up(path: Path) -> None:
    """Write ``path`` until its file system is full (ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, bytes(4 * MiB)):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def big_layer(tmp_path: Path) -> tuple[bytes, Path]:
    """Layer big@1 (one 24 MiB file of 1 MiB chunks) in a file store: its
    file's bytes and the store's directory."""
    need_root()
    src = tmp_path / "big"
    src.mkdir()
    data = os.urandom(24 * MiB)
    (src / "data").write_bytes(data)
    store = tmp_path / "store"
    build(FileStore(str(store)), str(src), name="big", chunk_size=1 << 20)
    return data, store


def one_line_exit_16(proc) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == NodeFull.exit_code == 16, proc.stderr
    assert len(lines) == 1 and "ROOT is full" in lines[0], proc.stderr


@pytest.mark.daemon_log(CACHE_WARNING, HELD_GIVEN_UP, CACHE_LOWERED)
def test_a_sandbox_filling_root_leaves_the_node_serving(tmp_path):
    data, store = big_layer(tmp_path)
    with small_ext4(tmp_path, 160 * MiB) as small:
        node = NodeDaemon(small / "node", ["--store", f"file://{store}"], cache_size="20G")
        node.log_path = tmp_path / "daemon.log"  # not on the ROOT that fills up
        node.start()
        try:
            assert re.search(r"cache bound lowered from 20,480 MiB \(--cache-size\) to \d+ MiB: "
                             r"ROOT's file system has \d+ MiB free of 1\d\d MiB", node.log())
            rootfs = Path(node.cli("up", "--layer", "big@1", "--id", "s1").stdout.strip())
            fill_up(rootfs / "filler")  # the sandbox's upper takes what is left

            one_line_exit_16(node.cli("up", "--layer", "big@1", "--id", "s2", check=False))
            one_line_exit_16(node.cli("run", "s1", "--", "true", check=False))
            assert (rootfs / "data").read_bytes() == data  # fetched, verified, not cached
            cache = node.request("stats")["cache"]
            # the full disk was met: served without a cache file, or cached in room
            # that evicting other chunks made (once the held space is free, both happen)
            assert cache["not_cached"] + cache["no_space_evictions"] > 0, cache
            warnings = re.findall(CACHE_WARNING, node.log())
            assert len(warnings) <= 2, f"{len(warnings)} cache warnings"  # no line per chunk

            node.stop()  # a restart on the full disk brings the sandbox back
            node.start()
            assert node.request("ps")["sandboxes"][0]["state"] == "up"
            node.cli("down", "s1")
            node.cli("up", "--layer", "big@1", "--id", "s2")
            node.cli("down", "s2")
        finally:
            assert node.cleanup() == []


PARTIAL_FAILED = r"a read of layer data failed \(EIO\): .*No space left"


@pytest.mark.daemon_log(HELD_GIVEN_UP, CACHE_LOWERED, PARTIAL_FAILED)
def test_a_full_root_fails_partial_file_reads_with_eio_until_there_is_room(tmp_path):
    """Over a partial blob file, a read of data the node has not got needs
    room on ROOT for it: the fill makes room (the held space), and what still
    does not fit fails with EIO, never with other bytes; once the sandbox's
    file is gone, the same reads succeed."""
    data, store = big_layer(tmp_path)
    with small_ext4(tmp_path, 160 * MiB) as small:
        node = NodeDaemon(small / "node", ["--store", f"file://{store}"], cache_size="20G",
                          kernel_reads=True)
        node.log_path = tmp_path / "daemon.log"  # not on the ROOT that fills up
        node.start()
        try:
            rootfs = Path(node.cli("up", "--layer", "big@1", "--id", "s1").stdout.strip())
            assert [layer["partial"] for layer in node.request("stats")["layers"].values()] \
                == [True]
            fill_up(rootfs / "filler")
            try:
                got = (rootfs / "data").read_bytes()
                assert got == data  # the held space was room enough
            except OSError as exc:
                assert exc.errno == errno.EIO
            (rootfs / "filler").unlink()
            assert (rootfs / "data").read_bytes() == data
            node.cli("down", "s1")
        finally:
            assert node.cleanup() == []


@pytest.mark.daemon_log(HELD_GIVEN_UP)
def test_a_replica_commit_on_a_full_root_uses_the_held_space(tmp_path):
    """A trace bigger than anything free: its commit fails for want of room
    (LMDB says ENOSPC or EIO), gets the held space, and goes through."""
    need_root()
    with small_ext4(tmp_path, 32 * MiB) as small:
        space = RootSpace(small, reserve=16 * MiB)  # holds 4 MiB
        assert space.take() and space.held() == 4 * MiB
        replica = Replica(small, make_room=space.release)
        try:
            fill_up(small / "filler")
            order = list(range(200_000))  # about 1.3 MiB of JSON
            replica.put_trace("sha256:" + "a" * 64, order)
            assert replica.trace("sha256:" + "a" * 64) == order
            assert space.held() == 0
        finally:
            replica.close()
        (small / "filler").unlink()
        space.retake()
        assert space.held() == 4 * MiB


@pytest.mark.daemon_log(r"cannot write chunk \d+", "another kind")
def test_repeated_warnings_are_one_line_a_minute_with_a_count(caplog):
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("t.rate"), clock=lambda: now[0])
    for i in range(1766):
        now[0] = i * 0.01
        limited.warning("ENOSPC", "cannot write chunk %d", i)
    limited.warning("EIO", "another kind")
    now[0] = 61.0
    limited.warning("ENOSPC", "cannot write chunk %d", 1766)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["cannot write chunk 0", "another kind",
                     "cannot write chunk 1766 (and 1,765 more like it in the last 61 s)"]

