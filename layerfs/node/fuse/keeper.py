"""The FUSE connection keeper: holds the daemon's ``/dev/fuse`` file open while
daemons come and go, and hands it to the next one.

``python -m layerfs.node.fuse.keeper SOCKET FD INIT_HEX LEASE_FD GRACE [GROUP_FD]`` is started
by the first daemon on a fresh mount, with the connection's file as ``FD`` (a
dup of the daemon's: the same open file, so requests a dying daemon had read
stay queued in the kernel instead of failing), the kernel's FUSE_INIT request
as ``INIT_HEX``, and its end of a socket pair as ``LEASE_FD``: the daemon's
lease. It listens on ``SOCKET`` (mode 0600, root only, checked again with
SO_PEERCRED). A caller that sends ``take GRACE`` gets the INIT bytes with the
file attached (SCM_RIGHTS), and its connection is its lease from then on.
Callers are served as their requests come, none waits on another; one that
sends nothing for 5 s is closed on.

Every number is checked before use, in a message as in the arguments: GRACE
is a plain decimal (as Python's ``repr`` of a float writes it: no sign,
``inf``, ``nan`` nor spaces) of at most :data:`MAX_GRACE` seconds (``layerfs
daemon --restart-grace``'s bound), file descriptors are plain non-negative
integers. A request that is anything else, or longer than
:data:`MAX_REQUEST` bytes, gets ``error REASON`` and no file, is logged (one
warning) and closed on; the keeper goes on serving. It does not share the
control protocol's parser (:mod:`layerfs.node.protocol`: JSON into typed
records, which imports layerfs): the keeper imports nothing that an upgrade
could change under a live connection.

A lease ends when its daemon's socket closes (the daemon exited or died). With
no lease left, the keeper waits GRACE seconds (the latest daemon's) for a next
daemon; if none takes the file by then, it exits and lets the connection go:
with no file left open, the kernel aborts it, and whatever waits on the node's
mounts gets an error instead of waiting for ever. A daemon that stops for good
sends ``end`` on its lease: the keeper exits at once. It also exits when the
connection ends (the FUSE mount was unmounted or aborted: ``poll`` reports an
error on the file) or on SIGTERM.

It keeps the daemon's fanotify pre-content group too (``GROUP_FD``, when the
kernel has one: :mod:`layerfs.fanotify`), for the same reason: a group whose last
descriptor closes allows the reads still waiting on it, and they would get a
partly fetched file's holes. The keeper is the group's only reader: each
event goes to the newest lease (``ev N OFFSET COUNT`` with the event's
descriptor attached), the daemon fills the range, answers the kernel itself
(naming the keeper's descriptor number N) and says ``done N``; the keeper
then closes its descriptor. Events a daemon had and did not answer when its
lease ended go to the next daemon that takes the file; when the keeper ends,
every event still pending is denied with EIO. A ``take`` gets the group with
the FUSE file.

A keeper that ends while its group still marks files (a mount over one, or
a detached one, may still be read, and without the group such reads would
return the file's holes) lingers: the FUSE file goes, the group stays, and
every read of a partial file fails with EIO, until no mark is left or a
starting daemon sends ``take``: that one gets the group alone (``group``
instead of an INIT) and the lingering keeper exits.

Tiny on purpose: the standard library only, no layerfs imports beyond this
package's ``__init__`` and :mod:`layerfs.fanotify` (standard library only too), no
threads, nothing to upgrade but itself.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import re
import resource
import select
import signal
import socket
import struct
import sys
import time

from ... import fanotify

ROOT_UID = 0
CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
ERRORS = select.POLLERR | select.POLLHUP | select.POLLNVAL
TAKE, END = b"take", b"end"
GROUP_ONLY = b"group"  # a lingering keeper's answer to take: the group, no connection
CALLER_TIMEOUT = 5.0  # seconds a caller has to send its request before it is closed on
MAX_GRACE = 86400.0  # seconds; also ``layerfs daemon --restart-grace``'s bound
MAX_REQUEST = 64  # bytes: ``take`` and a grace as ``repr`` writes it fit many times over
LINGER_CHECK_MS = 5000  # how often a lingering keeper looks whether marks are left
MAX_LEASE_MESSAGE = 8192  # bytes: a daemon's ``done N ...`` of many events
DECIMAL = re.compile(rb"[0-9]{1,20}(\.[0-9]{1,20})?(e[+-]?[0-9]{1,3})?")
FD_NUMBER = re.compile(r"[0-9]{1,9}")
log = logging.getLogger("layerfs.node.fuse.keeper")


class BadRequest(ValueError):
    """A request or argument the keeper refuses; the message says why."""


def peer_uid(conn: socket.socket) -> int:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, CRED.size)
    return int(CRED.unpack(raw)[1])


def listen(path: str) -> socket.socket:
    """A unix socket at ``path`` only root can connect to (an old one
    replaced), listening before the name appears: bound to a temporary name,
    then renamed."""
    tmp = path + "~"  # one character more than the name itself: sun_path is short
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)
    try:
        server.bind(tmp)
    finally:
        os.umask(old)
    server.listen(8)
    os.rename(tmp, path)
    return server


def unlink_own(path: str, inode: int) -> None:
    """Remove ``path`` if it is still this keeper's socket (not a successor's)."""
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass


def shown(data: bytes) -> str:
    """The first bytes of a request, quoted, for an error line."""
    return repr(data[:20])[1:]  # without the b of a bytes literal


def parse_grace(text: bytes) -> float:
    """A grace in seconds: a plain decimal in [0, MAX_GRACE]; else BadRequest."""
    if DECIMAL.fullmatch(text) is None:
        raise BadRequest(f"grace {shown(text)} is not a plain decimal number")
    value = float(text)  # finite: at most 20 digits before an exponent of 3
    if not 0 <= value <= MAX_GRACE:
        raise BadRequest(f"grace {value:g} s is outside 0-{MAX_GRACE:g} s")
    return value


def parse_take(message: bytes, truncated: bool = False) -> float:
    """The grace of a ``take GRACE`` request (``truncated``: it was longer
    than MAX_REQUEST bytes); BadRequest for anything else."""
    if truncated:
        raise BadRequest(f"a request longer than {MAX_REQUEST} bytes")
    word, space, grace = message.partition(b" ")
    if word != TAKE or not space:
        raise BadRequest(f"not a take request: {shown(message)}")
    return parse_grace(grace)


def parse_fd(text: str) -> int:
    """A file descriptor number argument; else BadRequest."""
    if FD_NUMBER.fullmatch(text) is None:
        raise BadRequest(f"file descriptor {text[:20]!r} is not a plain number")
    return int(text)


class Keeper:
    """The file, its INIT request, and the daemons' leases."""

    def __init__(self, server: socket.socket, fuse_fd: int, init: bytes,
                 lease: socket.socket, grace: float, group: int | None = None) -> None:
        self.server, self.fuse_fd, self.init, self.grace = server, fuse_fd, init, grace
        self.group = group
        self.leases: dict[int, socket.socket] = {}  # oldest first: events go to the newest
        # pre-content events read and not answered: its descriptor number → (event, the
        # lease it went to, None while no daemon has it); the numbers no daemon has, in order
        self.pending: dict[int, tuple[fanotify.PreRead, int | None]] = {}
        self.unassigned: collections.deque[int] = collections.deque()
        # callers accepted and not yet heard: (socket, when accepted); none blocks the others
        self.callers: dict[int, tuple[socket.socket, float]] = {}
        self.poller = select.poll()
        self.poller.register(server.fileno(), select.POLLIN)
        self.poller.register(fuse_fd, 0)  # errors only: never read the connection's requests
        if group is not None:
            self.poller.register(group, select.POLLIN)
        self.alone_since = 0.0
        self.add_lease(lease)

    def add_lease(self, lease: socket.socket) -> None:
        self.leases[lease.fileno()] = lease
        self.poller.register(lease.fileno(), select.POLLIN)

    def drop_lease(self, fd: int) -> None:
        self.poller.unregister(fd)
        self.leases.pop(fd).close()
        if not self.leases:
            self.alone_since = time.monotonic()
        for number, (event, holder) in list(self.pending.items()):
            if holder == fd:  # its daemon is gone: the next one answers it
                self.pending[number] = (event, None)
                self.unassigned.append(number)
        self.hand_on()

    def take_events(self) -> None:
        """Read the group's new events and hand each to the newest daemon."""
        assert self.group is not None
        for event in fanotify.read_events(self.group):
            self.pending[event.fd] = (event, None)
            self.unassigned.append(event.fd)
        self.hand_on()

    def hand_on(self) -> None:
        """Pending events no daemon has go to the newest lease, as many as its
        socket takes now (the rest when it has room: never waiting on a
        daemon, which may be waiting on the keeper)."""
        if not self.leases:
            return
        fd = next(reversed(self.leases))
        while self.unassigned:
            number = self.unassigned[0]
            event, holder = self.pending.get(number, (None, 0))
            if event is None or holder is not None:
                self.unassigned.popleft()  # answered, or handed on already
                continue
            try:
                fanotify.send_event(self.leases[fd], event)
            except BlockingIOError:
                self.poller.modify(fd, select.POLLIN | select.POLLOUT)
                return
            except OSError:
                return  # its daemon is going: the lease's end hands them on
            self.unassigned.popleft()
            self.pending[number] = (event, fd)

    def answered(self, numbers: list[int]) -> None:
        """A daemon answered these events: their descriptors are closed."""
        for number in numbers:
            if self.pending.pop(number, None) is not None:
                os.close(number)

    def linger(self) -> None:
        """The keeper's end with files still marked: see the module docstring."""
        assert self.group is not None
        self.poller.unregister(self.fuse_fd)
        os.close(self.fuse_fd)
        for fd in list(self.leases):
            self.drop_lease(fd)
        log.warning("the keeper keeps the pre-content group of partly fetched layers that "
                    "mounts may still read: their reads fail (EIO) until a daemon starts")
        while fanotify.marked_inodes(self.group):
            for fd, _ in self.poller.poll(LINGER_CHECK_MS):
                if fd == self.group:
                    for event in fanotify.read_events(self.group):
                        fanotify.respond(self.group, event.fd, errno.EIO)
                        os.close(event.fd)
                elif fd == self.server.fileno():
                    self.accept()
                elif fd in self.callers and self.hand_group(fd):
                    return
            self.drop_silent_callers()

    def hand_group(self, fd: int) -> bool:
        """A lingering keeper's answer to ``take``: the group alone; whether
        it went (then the keeper exits)."""
        assert self.group is not None
        conn, _ = self.callers.pop(fd)
        self.poller.unregister(fd)
        try:
            message, _, flags, _ = conn.recvmsg(MAX_REQUEST)
            parse_take(message, truncated=bool(flags & socket.MSG_TRUNC))
            socket.send_fds(conn, [GROUP_ONLY], [self.group])
        except (BadRequest, OSError):
            conn.close()
            return False
        conn.close()
        return True

    def deny_pending(self) -> None:
        """The keeper ends: every event still pending fails its read (EIO)."""
        if self.group is None:
            return
        for number in list(self.pending):
            fanotify.respond(self.group, number, errno.EIO)
            os.close(number)
        if self.pending:
            log.warning("%d reads of partly fetched layers failed: no daemon answered them",
                        len(self.pending))
        self.pending.clear()

    def accept(self) -> None:
        """A new caller: kept until its request comes (or CALLER_TIMEOUT passes)."""
        try:
            conn, _ = self.server.accept()
        except OSError:
            return
        if peer_uid(conn) != ROOT_UID:
            conn.close()
            return
        conn.setblocking(False)
        self.callers[conn.fileno()] = (conn, time.monotonic())
        self.poller.register(conn.fileno(), select.POLLIN)

    def hand_out(self, fd: int) -> None:
        """A caller's request: ``take GRACE`` gets the file and makes its
        connection a lease; anything else gets an error answer and is closed on."""
        conn, _ = self.callers.pop(fd)
        self.poller.unregister(fd)
        try:
            message, _, flags, _ = conn.recvmsg(MAX_REQUEST)
            if not message and not flags & socket.MSG_TRUNC:
                raise ConnectionError("the caller went away")  # said nothing: no error
            grace = parse_take(message, truncated=bool(flags & socket.MSG_TRUNC))
            fds = [self.fuse_fd] if self.group is None else [self.fuse_fd, self.group]
            socket.send_fds(conn, [self.init], fds)
        except BadRequest as exc:
            self.refuse(conn, str(exc))
            return
        except OSError:
            conn.close()  # the caller went away; the next one asks again
            return
        self.grace = grace
        self.add_lease(conn)
        self.hand_on()

    @staticmethod
    def refuse(conn: socket.socket, reason: str) -> None:
        """Answer a bad request with ``error REASON`` (one log line) and close on it."""
        log.warning("refused a request on the keeper socket: %s", reason)
        try:
            conn.send(b"error " + reason.encode("ascii", "backslashreplace"))
        except OSError:
            pass  # gone already
        conn.close()

    def drop_silent_callers(self) -> None:
        now = time.monotonic()
        for fd, (conn, since) in list(self.callers.items()):
            if now - since >= CALLER_TIMEOUT:
                del self.callers[fd]
                self.poller.unregister(fd)
                conn.close()

    def lease_says(self, fd: int) -> bool:
        """Read a lease; False if its daemon asked the keeper to end."""
        try:
            message = self.leases[fd].recv(MAX_LEASE_MESSAGE)
        except OSError:
            message = b""
        if message == END:
            return False
        done = fanotify.parse_done_message(message)
        if done is not None:
            self.answered(done)
        elif not message:
            self.drop_lease(fd)  # its daemon is gone
        else:
            log.warning("ignored a message on a lease: %s", shown(message))
        return True

    def timeout_ms(self) -> int | None:
        """Until the next deadline: the grace's end, or a silent caller's."""
        now = time.monotonic()
        deadlines = [since + CALLER_TIMEOUT for _, since in self.callers.values()]
        if not self.leases:
            deadlines.append(self.alone_since + self.grace)
        if not deadlines:
            return None
        return max(0, int((min(deadlines) - now) * 1000) + 1)

    def serve(self) -> str:
        """Run until there is nothing left to keep; the reason."""
        while True:
            events = self.poller.poll(self.timeout_ms())
            for fd, flags in events:
                if fd == self.fuse_fd:
                    if flags & ERRORS:
                        return ""  # the connection is gone: nothing left to keep
                elif fd == self.group:
                    self.take_events()
                elif fd == self.server.fileno():
                    self.accept()
                elif fd in self.callers:
                    self.hand_out(fd)
                elif fd in self.leases and flags & select.POLLOUT:
                    self.poller.modify(fd, select.POLLIN)  # room again
                    self.hand_on()
                    if flags & select.POLLIN and not self.lease_says(fd):
                        return ""
                elif fd in self.leases and not self.lease_says(fd):
                    return ""
            self.drop_silent_callers()
            if not self.leases and time.monotonic() >= self.alone_since + self.grace:
                return f"no daemon took the FUSE connection within {self.grace:g} s"


class JsonLines(logging.Formatter):
    """layerfs.node.daemon.jsonlog's format (not imported: nothing of layerfs is)."""

    def format(self, record: logging.LogRecord) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return json.dumps({"time": f"{when}.{int(record.msecs):03d}Z",
                           "level": record.levelname, "logger": record.name,
                           "message": record.getMessage()})


def main(argv: list[str]) -> int:
    # records in the daemon's log format, on the stderr it shares with the daemon
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.environ.get("LAYERFS_LOG_FORMAT") == "json":  # the daemon's --log-format json
        logging.getLogger().handlers[0].setFormatter(JsonLines())
    try:
        if len(argv) not in (5, 6):
            raise BadRequest(f"{len(argv)} arguments")
        path, fd, init_hex, lease_fd, grace = argv[:5]
        group = parse_fd(argv[5]) if len(argv) == 6 else None
        fuse_fd, lease_no = parse_fd(fd), parse_fd(lease_fd)
        init, grace_s = bytes.fromhex(init_hex), parse_grace(grace.encode())
    except ValueError as exc:  # BadRequest, a wrong count, bad hex
        log.error("usage: keeper SOCKET FD INIT_HEX LEASE_FD GRACE [GROUP_FD]: %s", exc)
        return 2
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a descriptor per pending read
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is meant for the daemon
    lease = socket.socket(fileno=lease_no)
    server = listen(path)
    inode = os.stat(path).st_ino
    keeper = Keeper(server, fuse_fd, init, lease, grace_s, group)
    try:
        reason = keeper.serve()
        keeper.deny_pending()
        if reason:
            log.warning("%s: letting it go; reads waiting on its mounts fail", reason)
        if group is not None and fanotify.marked_inodes(group):
            keeper.linger()
    finally:
        keeper.deny_pending()
        unlink_own(path, inode)
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
