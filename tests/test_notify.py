"""layerfs/node/daemon/systemd.py: the service notification protocol against a real
datagram socket (a path and an abstract name), a real daemon's READY,
STATUS and STOPPING on such a socket, and how the daemon finds its unit and
tells a restart job from a stop (tests/test_systemd.py runs all of it under
a real systemd)."""

from __future__ import annotations

import re
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import build, need_root
from support.nodes import NodeDaemon

from layerfs.builder.env import create_env
from layerfs.node.daemon import systemd
from layerfs.node.fuse import connection as fuseconn
from layerfs.refstore import RefStore
from layerfs.store import open_store


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[socket.socket]:
    """A stand-in for systemd's notification socket, at a path."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(30)
    yield sock
    sock.close()


def messages(sock: socket.socket, until: str) -> list[dict[str, str]]:
    """Datagrams as KEY=VALUE dicts, up to the first holding ``until``."""
    got: list[dict[str, str]] = []
    while not got or until not in got[-1]:
        data = sock.recv(4096).decode()
        got.append(dict(line.split("=", 1) for line in data.split("\n")))
    return got


def test_notifier_sends_to_a_path(manager: socket.socket) -> None:
    notifier = systemd.Notifier(manager.getsockname())
    assert notifier.enabled
    notifier.ready(systemd.sandboxes_status(0, "file:///s"))
    assert manager.recv(4096) == b"READY=1\nSTATUS=serving 0 sandboxes (store file:///s)"
    notifier.set_status(systemd.sandboxes_status(0, "file:///s"))  # unchanged: not sent
    notifier.set_status(systemd.sandboxes_status(1, "file:///s"))
    assert manager.recv(4096) == b"STATUS=serving 1 sandbox (store file:///s)"
    notifier.stopping("stopping")
    assert manager.recv(4096) == b"STOPPING=1\nSTATUS=stopping"


def test_notifier_abstract_name() -> None:
    name = f"layerfs-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        systemd.Notifier("@" + name).send("READY=1")
        assert sock.recv(64) == b"READY=1"


@pytest.mark.daemon_log(r"cannot notify the service manager at ")
def test_notifier_off_without_a_socket(tmp_path: Path, caplog) -> None:
    assert not systemd.Notifier("").enabled
    assert not systemd.Notifier("").send("READY=1")
    assert not systemd.Notifier("relative/path").enabled  # only paths and @names count
    gone = systemd.Notifier(str(tmp_path / "gone"))  # systemd's socket went away
    assert not gone.send("READY=1") and not gone.send("READY=1")
    warnings = [r for r in caplog.records if "cannot notify" in r.getMessage()]
    assert len(warnings) == 1  # once for the process


CGROUP_HYBRID = """12:pids:/system.slice/layerfs.service
1:name=systemd:/system.slice/layerfs.service
0::/system.slice/layerfs.service
"""
CGROUP_UNIFIED = "0::/system.slice/node-layerfs.service\n"
CGROUP_SCOPE = "0::/user.slice/user-0.slice/session-3.scope\n"


def test_own_unit() -> None:
    assert systemd.own_unit(CGROUP_HYBRID) == "layerfs.service"
    assert systemd.own_unit(CGROUP_UNIFIED) == "node-layerfs.service"
    assert systemd.own_unit(CGROUP_SCOPE) is None
    assert systemd.own_unit("") is None
    assert systemd.own_unit("0::/\n") is None


def test_job_type() -> None:
    assert systemd.job_type("123 layerfs.service restart running", "layerfs.service") == \
        "restart"
    assert systemd.job_type("124 layerfs.service stop running", "layerfs.service") == "stop"
    assert systemd.job_type("125 other.service restart waiting", "layerfs.service") is None
    assert systemd.job_type("garbage", "layerfs.service") is None


def test_outside_a_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    assert not systemd.in_service()
    assert not systemd.restart_queued()  # a SIGTERM is a stop
    assert systemd.keeper_command(["python", "-m", "k"]) == ["python", "-m", "k"]


def test_keeper_scope_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(systemd, "in_service", lambda: True)
    monkeypatch.setattr(systemd, "CGROUP", tmp_path / "cgroup")
    (tmp_path / "cgroup").write_text(CGROUP_HYBRID)
    tool = tmp_path / "systemd-run"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    first = systemd.keeper_command(["python", "-m", "k"])
    second = systemd.keeper_command(["python", "-m", "k"])
    assert first[:4] == [str(tool), "--scope", "--quiet", "--collect"]
    assert first[-4:] == ["--", "python", "-m", "k"]
    assert "--property=Before=layerfs.service" in first
    units = [a for a in first + second if a.startswith("--unit=")]
    assert units[0] != units[1] and all(u.endswith(".scope") for u in units)


@pytest.mark.daemon_log(r"cannot start the FUSE keeper in a scope of its own")
def test_keeper_without_its_scope(tmp_path: Path, caplog) -> None:
    """A scope that cannot be made (systemd-run fails): the keeper is started
    all the same, as the daemon's child, with one warning."""
    held, other = socket.socketpair()  # stands for the connection's file: never ends
    conn = fuseconn.FuseConnection(held.fileno(), bytes(40), taken_over=False)
    keeper = fuseconn.start_keeper(tmp_path, conn, 1.0,
                                   scope=lambda command: ["/bin/false", *command])
    try:
        assert keeper.args[:3] == [sys.executable, "-m", "layerfs.node.fuse.keeper"]
        assert (tmp_path / fuseconn.KEEPER_SOCKET).exists() and conn.lease is not None
        assert keeper.poll() is None
    finally:
        fuseconn.let_go(conn)  # `end`: the keeper exits
        assert keeper.wait(30) == 0
        held.close()
        other.close()
    assert [r.getMessage() for r in caplog.records if "scope" in r.getMessage()]


def test_daemon_notifies(tmp_path: Path, manager: socket.socket,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A real daemon with $NOTIFY_SOCKET: READY=1 once it answers, STATUS
    after `up` and `down`, STOPPING=1 at SIGTERM (not a service here: a stop)."""
    need_root()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "hello").write_text("hello\n")
    (tmp_path / "store").mkdir()
    store = open_store(f"file://{tmp_path / 'store'}")
    try:
        build(store, str(tmp_path / "src"), name="hello")
        create_env(RefStore(store), "e", "1", ["hello@1"])
    finally:
        store.close()
    monkeypatch.setenv("NOTIFY_SOCKET", manager.getsockname())
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    node = NodeDaemon(tmp_path / "node", ["--store", f"file://{tmp_path / 'store'}"])
    try:
        node.start()
        ready = messages(manager, "READY")
        url = f"file://{tmp_path / 'store'}"
        assert ready[-1] == {"READY": "1", "STATUS": f"serving 0 sandboxes (store {url})"}
        assert b"NOTIFY_SOCKET=" not in keeper_environ(node)  # the daemon's alone
        node.cli("up", "e@1", "--id", "s1")
        assert messages(manager, "STATUS")[-1] == {"STATUS": f"serving 1 sandbox (store {url})"}
        node.cli("down", "s1")
        assert messages(manager, "STATUS")[-1]["STATUS"].startswith("serving 0 sandboxes")
        assert node.stop() == 0  # SIGTERM
        stop = messages(manager, "STOPPING")
        assert stop[-1] == {"STOPPING": "1", "STATUS": "stopping"}
        assert messages(manager, "STATUS")[-1]["STATUS"].startswith("stopping: unmounting")
    finally:
        left = node.cleanup()
    assert not left


def keeper_environ(node: NodeDaemon) -> bytes:
    pid = re.findall(r"the FUSE connection is kept by pid (\d+)", node.log())[-1]
    return Path(f"/proc/{pid}/environ").read_bytes()
