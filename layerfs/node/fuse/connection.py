"""The FUSE connection as a thing of its own, so that it outlives the daemon.

The daemon mounts ``ROOT/fuse`` itself (its own ``/dev/fuse`` file, ``fd=``
mount option), reads the kernel's FUSE_INIT request, and gives libfuse
(pyfuse3) the connection as ``/dev/fd/N``: libfuse then uses file N and does
not mount. libfuse must see a FUSE_INIT before it answers anything else, and a
daemon that takes over a running connection never gets one from the kernel,
so every daemon feeds libfuse the recorded INIT request through one end of a
socket pair that is file N at first (:func:`attach`), takes libfuse's answer
from the other end (forwarded to the kernel on a fresh mount, dropped on a
taken-over one, where the kernel has its answer already), and then puts the
real connection at N with ``dup2``. That happens in a trio run of its own
before the daemon's, so trio's epoll never saw file N as the socket.

A kept connection (:func:`take_over`) comes from the keeper
(:mod:`layerfs.node.fuse.keeper`) over a unix socket with SCM_RIGHTS: the same open
file as the dead daemon's, so the requests it had read and not answered are
still queued in the kernel's processing list. FUSE_NOTIFY_RESEND (Linux 6.9)
puts them back on the pending queue, with bit 63 of their ``unique`` set, and
the new daemon answers them (:func:`resend_pending`). A fresh mount tries the
same notification with nothing pending to learn whether the kernel has it.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyfuse3
import trio

from ...mounts import SAFE_FLAGS, mount

log = logging.getLogger(__name__)
FUSE_INIT = 26
NOTIFY_RESEND = 7  # enum fuse_notify_code, include/uapi/linux/fuse.h
IN_HEADER = struct.Struct("<IIQ")  # fuse_in_header: len, opcode, unique (the rest unread)
OUT_HEADER = struct.Struct("<IiQ")  # fuse_out_header: len, error (or notify code), unique
READ_SIZE = (1 << 20) + (1 << 16)  # more than any request the kernel may send
KEEPER_SOCKET = "keeper.sock"
GROUP_ONLY = b"group"  # a lingering keeper's answer (layerfs.node.fuse.keeper)


@dataclass
class FuseConnection:
    """One FUSE connection and how this daemon came by it."""

    fd: int  # the connection's /dev/fuse file (the keeper holds the same open file)
    init: bytes  # the kernel's FUSE_INIT request, as it came at the mount
    taken_over: bool  # from the keeper: the mounts above it are up and in use
    lease: socket.socket | None = None  # open while this daemon lives (see the keeper)
    # the fanotify pre-content group of the node's partly fetched layers (layerfs.fanotify), kept
    # by the keeper with the connection; None where the kernel has none
    group: int | None = None


def mount_fresh(mountpoint: Path, fsname: str = "layerfs") -> FuseConnection:
    """Open ``/dev/fuse``, mount it on ``mountpoint`` (``allow_other``,
    ``default_permissions``, nosuid, nodev) and read the kernel's FUSE_INIT."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        data = (f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other,"
                "default_permissions")
        mount(fsname, str(mountpoint), f"fuse.{fsname}", SAFE_FLAGS, data)
        init = os.read(fd, READ_SIZE)
    except BaseException:
        os.close(fd)
        raise
    _, opcode, _ = IN_HEADER.unpack_from(init)
    if opcode != FUSE_INIT:
        os.close(fd)
        raise OSError(errno.EPROTO, f"first FUSE request is opcode {opcode}, not FUSE_INIT")
    return FuseConnection(fd, init, taken_over=False)


@dataclass
class KeptGroup:
    """A lingering keeper's pre-content group, without a connection (see the
    keeper): the daemon starts afresh, with this group."""

    fd: int


def take_over(root: Path, grace: float) -> FuseConnection | KeptGroup | None:
    """The connection the keeper of ``root`` holds, or None when no keeper
    answers (none was started, or it is gone with the connection), or the
    group alone of a keeper that lingers. The socket stays open as this
    daemon's lease; ``grace``: how long the keeper waits for a next daemon
    once this one is gone."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(5)
    try:
        sock.connect(str(root / KEEPER_SOCKET))
        sock.sendall(b"take %r" % grace)
        init, fds, _, _ = socket.recv_fds(sock, 4096, 2)
    except OSError:
        sock.close()
        return None
    group_only = init == GROUP_ONLY and len(fds) == 1
    if len(fds) not in (1, 2) or len(init) < IN_HEADER.size and not group_only:
        for fd in fds:
            os.close(fd)
        sock.close()
        return None
    for fd in fds:
        os.set_inheritable(fd, False)
    sock.setblocking(False)  # the daemon's loop reads it (no timeout's hidden waits)
    if group_only:
        sock.close()
        return KeptGroup(fds[0])
    return FuseConnection(fds[0], init, taken_over=True, lease=sock,
                          group=fds[1] if len(fds) == 2 else None)


def receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One message on a lease and the descriptor it carries, without
    waiting (BlockingIOError if none is there; ``socket.recv_fds`` of
    Python 3.11 drops its flags and would wait)."""
    size = socket.CMSG_LEN(struct.calcsize("i"))
    message, ancillary, _, _ = sock.recvmsg(256, size, socket.MSG_DONTWAIT)
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds += struct.unpack(f"{usable // 4}i", data[:usable])
    return message, fds


def let_go(conn: FuseConnection) -> None:
    """This daemon stops for good: the keeper exits now, so that the
    connection ends with this process even where a busy mount outlives it."""
    if conn.lease is None:
        return
    try:
        conn.lease.settimeout(5)  # (the keeper reads its lease at once)
        conn.lease.send(b"end")
    except OSError:
        pass  # the keeper is gone already
    conn.lease.close()
    conn.lease = None


def attach(ops: pyfuse3.Operations, conn: FuseConnection, options: set[str]) -> None:
    """``pyfuse3.init`` on the connection: libfuse sees ``conn.init`` first
    (see the module docstring), then reads the real connection."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        pyfuse3.init(ops, f"/dev/fd/{theirs.fileno()}", options)
        ours.sendall(conn.init)
        reply = trio.run(_handshake, ours)
        if not conn.taken_over:
            os.write(conn.fd, reply)
        slot = theirs.detach()  # N stays open: libfuse reads it from now on
        os.dup2(conn.fd, slot, inheritable=False)
    finally:
        ours.close()
        theirs.close()


async def _handshake(ours: socket.socket) -> bytes:
    """Run pyfuse3's loop until libfuse has answered the INIT, then stop it
    (cancelled while it waits for the next request: nothing lost)."""
    sock = trio.socket.from_stdlib_socket(ours)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pyfuse3.main)
        reply = await sock.recv(READ_SIZE)
        nursery.cancel_scope.cancel()
    sock.detach()
    return reply


def resend_pending(conn: FuseConnection) -> bool:
    """Ask the kernel to queue again every request read and not answered
    (FUSE_NOTIFY_RESEND); False if this kernel has no such notification."""
    try:
        os.write(conn.fd, OUT_HEADER.pack(OUT_HEADER.size, NOTIFY_RESEND, 0))
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            return False
        raise
    return True


def start_keeper(root: Path, conn: FuseConnection, grace: float,
                 scope: Callable[[list[str]], list[str]] | None = None
                 ) -> subprocess.Popen[bytes]:
    """Start the keeper of ``conn`` in a session of its own (a kill of the
    daemon's process group leaves it), with this daemon's lease, and wait
    until it listens. ``scope``: the keeper's command run in a scope unit of
    its own (a daemon in a systemd service passes
    :func:`.daemon.systemd.keeper_command`: a restart of the service leaves
    it); if that scope cannot be made, as a plain child, one warning."""
    if scope is not None:
        try:
            return _start_keeper(root, conn, grace, scope)
        except OSError as exc:
            log.warning("cannot start the FUSE keeper in a scope of its own (%s): it runs in "
                        "the daemon's unit, which ends it at a restart or a crash", exc)
    return _start_keeper(root, conn, grace, lambda command: command)


def _start_keeper(root: Path, conn: FuseConnection, grace: float,
                  wrap: Callable[[list[str]], list[str]]) -> subprocess.Popen[bytes]:
    path = root / KEEPER_SOCKET
    path.unlink(missing_ok=True)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}  # the daemon's own
    group = [] if conn.group is None else [conn.group]
    try:
        keeper = subprocess.Popen(
            wrap([sys.executable, "-m", "layerfs.node.fuse.keeper", str(path), str(conn.fd),
                  conn.init.hex(), str(theirs.fileno()), repr(grace), *map(str, group)]),
            pass_fds=[conn.fd, theirs.fileno(), *group], start_new_session=True,
            stdin=subprocess.DEVNULL, env=env)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    for _ in range(500):
        if keeper.poll() is not None:
            ours.close()
            raise OSError(errno.ECHILD, f"the FUSE keeper exited with status {keeper.returncode}")
        if path.exists():
            ours.setblocking(False)  # the daemon's loop reads it
            conn.lease = ours  # only a keeper that listens holds this daemon's lease
            return keeper
        time.sleep(0.01)
    keeper.kill()
    ours.close()
    raise OSError(errno.ETIMEDOUT, "the FUSE keeper did not start listening")
