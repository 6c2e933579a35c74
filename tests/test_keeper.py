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

pytestmark = pytest.mark.end_to_end  # the CLI and outside tools, end to end

INIT = b"\x28\x00\x00\x00\x1a\x00\x00\x00" + bytes(32)  # looks like a FUSE_INIT header


class KeeperRun:
    """A keeper over a pipe's read end, with a lease of ours."""

    def __init__(self, where: Path, grace: float) -> None:
        self.path = where / "keeper.sock"
        self.conn_r, self.conn_w = os.pipe()
        self.lease, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "layerfs.node.fuse.keeper", str(self.path), str(self.conn_r),
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


BAD_REQUESTS = [b"give", b"take", b"take ", b"take -1", b"take nan", b"take inf",
                b"take 1e400", b"take 1e308", b"take 86401", b"take 1e5", b"take  5",
                b"take 5.0 5.0", b"take 5.0\n", b"take +5", b"take 0x10", b"take 1_0",
                b"take \xd9\xa5", b"tak", b"take 5" + b"0" * 100, b"\xff" * 64,
                b"take 5.0" + b" " * 100_000]


def ask(run: KeeperRun, request: bytes) -> tuple[bytes, list[int]]:
    """What the keeper answers to ``request`` (nothing sent if empty): data and files."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(str(run.path))
    if request:
        sock.sendall(request)
    else:
        sock.shutdown(socket.SHUT_WR)
    data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
    assert sock.recv(4096) == b""  # closed on us
    sock.close()
    return data, fds


@pytest.mark.parametrize("request_", [b"", b"give", b"take", b"\xff" * 64])
def test_anything_but_a_take_gets_nothing(keeper, request_):
    run = keeper()
    data, fds = ask(run, request_)
    assert fds == [] and data == (b"error not a take request: " + repr(request_[:20]).encode()[1:]
                                  if request_ else b"")  # a caller that said nothing: no answer
    assert run.proc.poll() is None  # and the keeper keeps the connection


def test_bad_numbers_and_garbage_get_an_error_and_the_keeper_goes_on(keeper):
    """A grace that is not a plain decimal in 0-86400 s (1e308 once made the
    keeper's poll timeout overflow when the last lease ended, and the
    keeper died with the connection), a request too long, garbage: each
    gets one error answer, no file, and one log line; the keeper then hands
    the file to a good take, and with no lease left waits that take's
    grace as it should."""
    run = keeper()
    for request in BAD_REQUESTS:
        data, fds = ask(run, request)
        assert fds == [] and data.startswith(b"error "), (request[:20], data)
        assert run.proc.poll() is None, request[:20]
    assert ask(run, b"take 1e308")[0] == b"error grace 1e+308 s is outside 0-86400 s"
    assert ask(run, b"take " + b"5" * 60)[0] == b"error a request longer than 64 bytes"
    sock, init, fds = run.take(b"take 0.5")
    assert init == INIT and len(fds) == 1 and same_file(fds[0], run.conn_r)
    os.close(fds[0])
    run.lease.send(b"\x00garbage")  # a lease's message other than end: ignored
    run.lease.close()
    assert not run.exited_within(0.3)
    sock.close()  # no lease left: the grace of the last take
    assert run.exited_within(5) and run.proc.returncode == 0
    log = run.proc.stderr.read()
    assert "Traceback" not in log
    assert log.count("refused a request on the keeper socket") == len(BAD_REQUESTS) + 2
    assert "ignored a message on a lease: '\\x00garbage'" in log
    assert log.rstrip().endswith("no daemon took the FUSE connection within 0.5 s: letting it "
                                 "go; reads waiting on its mounts fail")


def test_a_take_of_1e308_leaves_the_keeper_its_grace(keeper):
    """``take 1e308`` was taken as a lease with that grace, and when the
    leases ended the keeper's poll timeout overflowed: it died with a
    traceback, and the connection with it. Now it is refused, and the
    keeper waits the grace it has."""
    run = keeper(grace=0.5)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(str(run.path))
    sock.sendall(b"take 1e308")
    data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
    for fd in fds:
        os.close(fd)
    sock.close()
    run.lease.close()
    assert run.exited_within(5)
    log = run.proc.stderr.read()
    assert run.proc.returncode == 0 and "Traceback" not in log, log
    assert (data, fds) == (b"error grace 1e+308 s is outside 0-86400 s", [])
    assert "no daemon took the FUSE connection within 0.5 s" in log


@pytest.mark.parametrize("grace,fd", [("1e308", None), ("nan", None), ("-1", None),
                                      ("5.0", "-1"), ("5.0", "3 ")])
def test_bad_numbers_in_the_arguments_are_one_line(tmp_path, grace, fd):
    r, w = os.pipe()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "layerfs.node.fuse.keeper", str(tmp_path / "k.sock"),
             fd or str(r), INIT.hex(), str(r), grace],
            pass_fds=[r], capture_output=True, text=True, timeout=30)
    finally:
        os.close(r)
        os.close(w)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "usage: keeper" in lines[0], lines
    assert not (tmp_path / "k.sock").exists()


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

