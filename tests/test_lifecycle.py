"""A sandbox's lifecycle for real: a stop, even with ups in flight, a busy
sandbox or a replica that fails, leaves nothing mounted under ROOT, and a
down that stopped half way (a busy mount, an LMDB error) can be asked again
until it is done.

Faults are injected in the real daemon process: it runs through a small
launcher that wraps ``Replica.put_trace`` and ``Replica.delete_sandbox`` so
that each raises ``lmdb.Error`` while a file of its name exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.baseenv import publish_base_env, up
from support.nodes import NodeDaemon

from layerfs.errors import DownIncomplete, SandboxBusy
from layerfs.node.client import Client
from layerfs.node.daemon.service import mounts_under

FILE_ONLY = pytest.mark.parametrize("store_location", ["file"], indirect=True)
LAUNCHER = textwrap.dedent("""
    import os, sys
    import lmdb
    from layerfs.node.replica.replica import Replica
    from layerfs.cli.main import main
    faults = sys.argv.pop(1)
    def failing(name):
        real = getattr(Replica, name)
        def call(self, *args):
            if os.path.exists(os.path.join(faults, name)):
                raise lmdb.Error("mdb_txn_commit: Input/output error")
            return real(self, *args)
        setattr(Replica, name, call)
    for name in ("put_trace", "delete_sandbox"):
        failing(name)
    main()
""")


@pytest.fixture
def node(starts_a_server, tmp_path, store, store_location):
    """Env e@1 and a daemon on it whose replica fails on demand (:data:`LAUNCHER`)."""
    publish_base_env(tmp_path, store)
    daemon = NodeDaemon(tmp_path / "node", store_location.cli_args(), cache_size="64M")
    daemon.faults = tmp_path / "faults"
    daemon.faults.mkdir()
    daemon.command = [sys.executable, "-c", LAUNCHER, str(daemon.faults)]
    daemon.start()
    try:
        yield daemon
    finally:
        left = daemon.cleanup()
        assert left == [], f"mounts left behind: {left}"


def fail(node: NodeDaemon, *calls: str) -> None:
    """From now on the daemon's ``Replica.<call>`` raises an LMDB error."""
    for call in calls:
        (node.faults / call).touch()


def heal(node: NodeDaemon) -> None:
    for fault in node.faults.iterdir():
        fault.unlink()


def below(node: NodeDaemon, part: str) -> list[str]:
    return [m for m in mounts_under(node.root) if part in m]


def holder(cwd: Path) -> subprocess.Popen:
    """A process whose working directory is ``cwd``: its mount is busy."""
    return subprocess.Popen(["sleep", "600"], cwd=cwd)


def end(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(10)


def states(node: NodeDaemon) -> dict[str, dict]:
    return {r["id"]: r for r in node.request("ps")["sandboxes"]}


def stopped_cleanly(node: NodeDaemon) -> None:
    """SIGTERM: exit 0, and nothing left mounted below ROOT (FUSE included)."""
    assert node.stop() == 0
    assert mounts_under(node.root) == [], node.log()[-3000:]


def try_up(client: Client, sid: str) -> str:
    try:
        client.up(sid, "e@1")
        return "up"
    except Exception as exc:  # noqa: BLE001 - refused, cut off by the stop: either is fine
        return f"failed: {exc}"


def ups_cut_off(node: NodeDaemon, stop) -> tuple[dict[str, str], int]:
    """32 `up`s at once, and ``stop(node)`` as soon as the first overlay is
    mounted: each up's outcome, and how many were in flight then."""
    client = Client(node.root, timeout=60)
    ids = [f"u{i:02d}" for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(try_up, client, sid) for sid in ids]
        deadline = time.monotonic() + 30
        while not below(node, "/sandboxes/") and time.monotonic() < deadline:
            time.sleep(0.005)
        in_flight = sum(not f.done() for f in futures)
        stop(node)
        return dict(zip(ids, (f.result() for f in futures), strict=True)), in_flight


def each_done_or_gone(node: NodeDaemon, outcomes: dict[str, str]) -> None:
    """After a restart: every up that answered is up; every other one is up
    too or left nothing behind (no record, no directory); then all go down."""
    restored = states(node)
    assert {sid for sid, outcome in outcomes.items() if outcome == "up"} <= set(restored)
    assert all(r["state"] == "up" for r in restored.values()), restored
    assert set(os.listdir(node.root / "sandboxes")) == set(restored)
    for sid in restored:
        rootfs = node.root / "sandboxes" / sid / "rootfs"
        assert (rootfs / "lower" / "a").read_text() == "upper a"
        node.cli("down", sid)
    assert below(node, "/sandboxes/") == below(node, "/layers/") == []


@FILE_ONLY
def test_sigterm_during_32_ups_leaves_no_mount(node):
    """Each `up` in flight at the SIGTERM is either done and recorded (and
    comes back at the next start) or rolled back completely."""
    outcomes, in_flight = ups_cut_off(node, stopped_cleanly)
    assert in_flight > 0, outcomes
    node.start()
    each_done_or_gone(node, outcomes)


@FILE_ONLY
def test_kill_9_during_32_ups_is_rolled_back_at_the_next_start(node):
    """A daemon killed with ups in flight: the next one (taking the kept
    mounts over) rolls back each up it finds recorded as starting."""
    outcomes, in_flight = ups_cut_off(node, NodeDaemon.kill)
    assert in_flight > 0, outcomes
    node.start()
    each_done_or_gone(node, outcomes)


@FILE_ONLY
@pytest.mark.daemon_log(r"WARNING layerfs\.node\.sandboxes\.layermounts: access trace of layer "
                        r".* not saved",
                        r"WARNING layerfs\.node\.sandboxes\.layermounts: stopping: .* is busy")
def test_stop_with_sandboxes_up_leaves_no_mount(node):
    """A stop with three sandboxes up, one of them busy (a process has its
    working directory in it) and the replica failing to save traces, exits 0
    with nothing mounted; the next start brings the three back."""
    for sid in ("s1", "s2", "s3"):
        rootfs = up(node, sid)
        assert (rootfs / "data" / "file1").read_bytes()  # read: the layers have traces
    busy = holder(node.root / "sandboxes" / "s2" / "rootfs" / "data")
    try:
        fail(node, "put_trace")
        stopped_cleanly(node)
    finally:
        end(busy)
    heal(node)
    node.start()
    assert {sid: r["state"] for sid, r in states(node).items()} == dict.fromkeys(
        ("s1", "s2", "s3"), "up")
    for sid in ("s1", "s2", "s3"):
        assert (node.root / "sandboxes" / sid / "rootfs" / "lower" / "a").read_text() == "upper a"
        node.cli("down", sid)


@FILE_ONLY
def test_a_down_stopped_by_a_busy_mount_is_repeated_until_done(node):
    """A busy rootfs, then a busy layer mount: each `down` fails with one
    line and the busy exit code, the sandbox is `down_failed` and says why;
    once the process is gone, `down` again goes on where it stopped."""
    rootfs = up(node, "s1")
    assert (rootfs / "data" / "file0").read_bytes()
    for busy_path, still_mounted in ((rootfs / "data", "/sandboxes/"), (None, "/layers/")):
        if busy_path is None:  # the rootfs is unmounted by now: hold a layer mount instead
            busy_path = Path(below(node, "/layers/")[0])
        busy = holder(busy_path)
        try:
            proc = node.cli("down", "s1", check=False)
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == SandboxBusy.exit_code and len(lines) == 1, proc.stderr
            assert "is busy" in lines[0] and "run it again" in lines[0]
            record = states(node)["s1"]
            assert record["state"] == "down_failed" and "is busy" in record["error"]
            assert below(node, still_mounted)
        finally:
            end(busy)
    assert below(node, "/sandboxes/") == []  # the rootfs stayed unmounted
    node.cli("down", "s1")
    assert states(node) == {}
    assert below(node, "/sandboxes/") == below(node, "/layers/") == []
    assert not (node.root / "sandboxes" / "s1").exists()
    up(node, "s1")  # the id and the layers can be used again
    node.cli("down", "s1")


@FILE_ONLY
@pytest.mark.daemon_log(r"WARNING layerfs\.node\.sandboxes\.layermounts: access trace of layer "
                        r".* not saved",
                        r"ERROR layerfs\.node\.sandboxes\.manager: sandbox s1: down stopped while "
                        r"deleting its record")
def test_a_down_stopped_by_an_lmdb_error_is_repeated_until_done(node):
    """A trace that cannot be saved never keeps a layer mounted; a record
    that cannot be deleted fails the down with one line, and `down` again
    finishes it once the replica works."""
    rootfs = up(node, "s1")
    assert (rootfs / "data" / "file0").read_bytes()
    fail(node, "put_trace", "delete_sandbox")
    proc = node.cli("down", "s1", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == DownIncomplete.exit_code and len(lines) == 1, proc.stderr
    assert "down stopped while deleting its record" in lines[0]
    assert "Input/output error" in lines[0] and "run it again" in lines[0]
    assert states(node)["s1"]["state"] == "down_failed"
    assert below(node, "/sandboxes/") == below(node, "/layers/") == []  # unmounted all the same
    again = node.cli("down", "s1", check=False)
    assert again.returncode == DownIncomplete.exit_code, again.stderr  # the replica still fails
    heal(node)
    node.cli("down", "s1")
    assert states(node) == {}
    assert not (node.root / "sandboxes" / "s1").exists()
    assert os.listdir(node.root / "sandboxes") == []
