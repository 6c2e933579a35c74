"""The FUSE keeper's protocol on its own: a pipe stands in for the
connection's file, so no mount is needed (tests/test_restart.py has the
real thing)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

INIT = b"\x28\x00\x00\x00\x1a\x00\x00\x00" + bytes(32)  # looks like a FUSE_INIT header


class KeeperRun:
    """A keeper over a pipe's read end, with a lease of ours."""

    def __init__(self, where: Path, grace: float) -> None:
        self.path = where / "keeper.sock"
        self.conn_r, self.conn_w = os.pipe()
        self.lease, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "layerfs.node.keeper", str(self.path), str(self.conn_r),
             INIT.hex(), str(theirs.fileno()), repr(grace)],
            pass_fds=[self.conn_r, theirs.fileno()], stderr=subprocess.PIPE, text=True)
        theirs.close()
        deadline = time.monotonic() + 10
        while not self.path.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)

    def take(self, request: bytes = b"take 5.0") -> tuple[socket.socket, bytes, list[int]]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(5)
        sock.connect(str(self.path))
        sock.sendall(request)
        init, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        return sock, init, fds

    def exited_within(self, seconds: float) -> bool:
        try:
            self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.lease.close()
        os.close(self.conn_r)
        os.close(self.conn_w)


@pytest.fixture
def keeper(tmp_path):
    runs: list[KeeperRun] = []
    yield lambda grace=5.0, where=tmp_path: runs.append(KeeperRun(where, grace)) or runs[-1]
    for run in runs:
        run.close()


def same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def test_a_take_gets_the_init_and_the_same_file(keeper):
    run = keeper()
    sock, init, fds = run.take()
    assert init == INIT and len(fds) == 1 and same_file(fds[0], run.conn_r)
    os.close(fds[0])
    sock.close()


@pytest.mark.parametrize("request_", [b"", b"give", b"take", b"take -1", b"take nan",
                                      b"take inf", b"take 1e400", b"\xff" * 64])
def test_anything_but_a_take_gets_nothing(keeper, request_):
    run = keeper()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(str(run.path))
    if request_:
        sock.sendall(request_)
    else:
        sock.shutdown(socket.SHUT_WR)
    data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
    assert (data, fds) == (b"", [])  # closed on us, no file
    sock.close()
    assert run.proc.poll() is None  # and the keeper keeps the connection


# as the test's unprivileged user: connect, ask, print what came
ASK = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.settimeout(10)
try:
    sock.connect(sys.argv[1])
    sock.sendall(b"take 5.0")
    data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
    print("files", len(fds))
except OSError as exc:
    print("error", exc.errno)
"""


def test_only_root_gets_the_file(keeper, local_user):
    where = Path(tempfile.mkdtemp(prefix="keeper-"))  # 0700 under /tmp, opened below
    where.chmod(0o755)  # the socket's mode alone keeps the user out
    try:
        check_callers(keeper(where=where), local_user)
    finally:
        shutil.rmtree(where)


def check_callers(run: KeeperRun, local_user) -> None:
    assert run.path.stat().st_mode & 0o777 == 0o600
    refused = local_user.python(ASK, str(run.path))
    assert refused.stdout.decode().split() == ["error", "13"]  # EACCES
    run.path.chmod(0o666)  # were the socket open to all, the keeper checks the caller itself
    asked = local_user.python(ASK, str(run.path)).stdout.decode().split()
    assert asked in (["files", "0"], ["error", "32"], ["error", "104"])  # closed on: no file
    sock, _, fds = run.take()  # and root still gets it
    assert len(fds) == 1
    os.close(fds[0])
    sock.close()


def test_the_grace_starts_when_the_last_lease_ends(keeper):
    run = keeper(grace=0.5)
    sock, _, fds = run.take(b"take 0.5")
    os.close(fds[0])
    run.lease.close()  # the first daemon is gone; the second still holds its lease
    assert not run.exited_within(1.5)
    sock.close()  # the second is gone too
    assert run.exited_within(5)
    assert "no daemon took the FUSE connection within 0.5 s: letting it go" in \
        run.proc.stderr.read()
    assert not run.path.exists()


def test_the_latest_take_sets_the_grace(keeper):
    run = keeper(grace=300)
    sock, _, fds = run.take(b"take 0.2")
    os.close(fds[0])
    run.lease.close()
    sock.close()
    assert run.exited_within(5)


def test_a_next_daemon_within_the_grace_keeps_it(keeper):
    run = keeper(grace=2)
    run.lease.close()
    time.sleep(0.5)
    sock, _, fds = run.take(b"take 2.0")
    os.close(fds[0])
    assert not run.exited_within(3)
    sock.close()


def test_end_on_a_lease_exits_at_once(keeper):
    run = keeper(grace=300)
    run.lease.send(b"end")
    assert run.exited_within(5)
    assert run.proc.returncode == 0 and run.proc.stderr.read() == ""


def test_the_connection_ending_exits(keeper, tmp_path):
    run = keeper(grace=300)
    os.close(run.conn_w)  # a pipe's read end reports POLLHUP: the stand-in for an abort
    run.conn_w = os.open(os.devnull, os.O_RDONLY)
    assert run.exited_within(5)


def test_a_silent_caller_does_not_hold_up_a_take(keeper):
    """Two root callers that connect and send nothing (a probe, a stopped
    process): a daemon's take behind them still gets the file at once, well
    within its own 5 s (else it would take the keeper for gone and detach
    every mount)."""
    run = keeper()
    silent = []
    for _ in range(2):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(str(run.path))
        silent.append(sock)
    time.sleep(0.1)  # the keeper has accepted them
    try:
        started = time.monotonic()
        sock, _, fds = run.take()
        took = time.monotonic() - started
    finally:
        for s in silent:
            s.close()
    assert len(fds) == 1, "no file"
    assert took < 4, f"the take waited {took:.1f} s behind silent callers"
    os.close(fds[0])
    sock.close()

