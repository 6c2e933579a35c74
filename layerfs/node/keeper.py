"""The FUSE connection keeper: holds the daemon's ``/dev/fuse`` file open while
daemons come and go, and hands it to the next one.

``python -m layerfs.node.keeper SOCKET FD INIT_HEX`` is started by the first
daemon on a fresh mount, with the connection's file as ``FD`` (a dup of the
daemon's: the same open file, so requests a dying daemon had read stay queued
in the kernel instead of failing) and the kernel's FUSE_INIT request as
``INIT_HEX``. It listens on ``SOCKET`` (mode 0600, root only, checked again
with SO_PEERCRED) and sends every caller the INIT bytes with the file attached
(SCM_RIGHTS). It exits when the connection ends (the FUSE mount was unmounted
or aborted: ``poll`` reports an error on the file) or on SIGTERM.

Tiny on purpose: the standard library only, no layerfs imports beyond this
package's empty ``__init__``, no threads, nothing to upgrade but itself.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import sys

ROOT_UID = 0
CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_uid(conn: socket.socket) -> int:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, CRED.size)
    return int(CRED.unpack(raw)[1])


def listen(path: str) -> socket.socket:
    """A unix socket at ``path`` only root can connect to (an old one replaced)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)
    try:
        server.bind(path)
    finally:
        os.umask(old)
    server.listen(8)
    return server


def hand_out(server: socket.socket, fuse_fd: int, init: bytes) -> None:
    conn, _ = server.accept()
    with conn:
        conn.settimeout(5)
        if peer_uid(conn) != ROOT_UID:
            return
        try:
            socket.send_fds(conn, [init], [fuse_fd])
        except OSError:
            pass  # the caller went away; the next one asks again


def serve(path: str, fuse_fd: int, init: bytes) -> None:
    server = listen(path)
    poller = select.poll()
    poller.register(server.fileno(), select.POLLIN)
    poller.register(fuse_fd, 0)  # errors only: never read the connection's requests
    try:
        while True:
            for fd, events in poller.poll():
                if fd == fuse_fd and events & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    return  # the connection is gone: nothing left to keep
                if fd == server.fileno():
                    hand_out(server, fuse_fd, init)
    finally:
        server.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def main(argv: list[str]) -> int:
    path, fd, init_hex = argv
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is meant for the daemon
    serve(path, int(fd), bytes.fromhex(init_hex))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
