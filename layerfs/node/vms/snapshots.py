"""A vm suspended into the store, and what a resume reads back.

``vm suspend`` drives the VMM (QEMU) through its QMP socket: the migration
capability ``x-ignore-shared`` on, the guest stopped, its device state
migrated into a file (``exec:cat > STATE``: a few hundred KB, since RAM
mapped shared from a file is left out of the stream), QEMU told to quit.
The snapshot is then one sealed block layer (an LSMT layer, as ``disk
commit`` makes) laid out as::

    [0, ram_size)                      the guest's RAM (zero pages not stored)
    [ram_size, ...)                    the device state (the migration stream),
                                       in a state area of at least STATE_AREA
    the last 4096 bytes                a JSON header (:class:`SnapshotHeader`)

and the writable disk is committed as ``NAME-disk@VERSION``. A resume
makes a writable disk over the snapshot layer (``ID-ram``, served lazily
through FUSE like any disk), reads the header and the state from it, and
hands the VMM that file as its RAM, mapped shared (a page faults in from
the store on first touch; a page the guest writes is written back to the
disk), with ``-incoming defer``; the daemon loads the state through QMP.

A second suspend of a resumed vm: its RAM is that disk (left out of the
stream again); the dirty pages flushed, the state and the header written
into the disk, the disk is committed over the snapshot it resumed from:
only the pages written since are stored.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import stat
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...builder.disk import DiskSource, scan_image
from ...errors import UsageError
from ...formats import lsmt
from .residency import Process

HEADER_BYTES = 4096
STATE_AREA = 64 << 20  # room for the device state in a snapshot (a hole where unused)
SNAPSHOT_KIND = "layerfs-vm-snapshot"
MIGRATE_TIMEOUT = 600.0  # seconds a device-state save may take


class QmpError(UsageError):
    """the VMM's QMP socket: {}"""


@dataclass
class SnapshotHeader:
    """What a resume needs besides the RAM and the state."""

    ram_size: int
    state_bytes: int
    layers: list[str]  # the env's layer digests, top first
    disk: str  # the writable disk's commit (digest)
    pmem: str = ""
    kind: str = SNAPSHOT_KIND
    drives: list[str] = field(default_factory=list)  # the drive ids, in order

    def pack(self) -> bytes:
        raw = json.dumps(asdict(self)).encode()
        if len(raw) >= HEADER_BYTES:
            raise UsageError("the vm has too many layers for a snapshot header")
        return raw.ljust(HEADER_BYTES, b"\0")

    @classmethod
    def unpack(cls, raw: bytes, what: str) -> SnapshotHeader:
        try:
            doc = json.loads(bytes(raw).rstrip(b"\0"))
            header = cls(**doc)
        except (ValueError, TypeError) as exc:
            raise UsageError(f"{what} is not a vm snapshot ({exc})") from None
        if header.kind != SNAPSHOT_KIND:
            raise UsageError(f"{what} is not a vm snapshot")
        ints = (header.ram_size, header.state_bytes)
        strs = [header.disk, header.pmem, *header.layers, *header.drives]
        if (not all(type(n) is int and n >= 0 for n in ints) or header.ram_size % lsmt.SECTOR
                or not isinstance(header.layers, list) or not isinstance(header.drives, list)
                or not all(isinstance(x, str) for x in strs)):
            raise UsageError(f"{what}: its vm snapshot header is damaged")
        return header


class Qmp:
    """A QMP connection (worker thread): commands in, answers out, events skipped."""

    def __init__(self, path: str, timeout: float = 30.0, wait: float = 0.0) -> None:
        """Connect to ``path``, trying again for ``wait`` seconds while it is
        not there or not listening yet (QEMU binds, then listens)."""
        deadline = time.monotonic() + wait
        while True:
            try:  # (the VMM's user may write its directory: a socket, not a link to one)
                if not stat.S_ISSOCK(os.lstat(path).st_mode):
                    raise QmpError(f"{path} is not a socket")
            except FileNotFoundError:
                pass
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.settimeout(timeout)
            try:
                self.sock.connect(path)
                break
            except OSError as exc:
                self.sock.close()
                if time.monotonic() >= deadline or not isinstance(
                        exc, (ConnectionRefusedError, FileNotFoundError)):
                    raise QmpError(f"cannot reach {path}: {exc.strerror}") from None
                time.sleep(0.02)
        self.file = self.sock.makefile("rwb")
        try:  # (the process that listens: the VMM)
            self.peer_pid = peer_pid(self.sock)
        except OSError:
            self.peer_pid = 0
        self._answer()  # the greeting
        self.cmd("qmp_capabilities")

    def _answer(self) -> dict:
        while True:
            line = self.file.readline()
            if not line:
                raise QmpError("closed by the VMM")
            doc = json.loads(line)
            if "event" not in doc:
                return doc

    def cmd(self, name: str, **arguments: object) -> object:
        self.file.write(json.dumps({"execute": name, "arguments": arguments}).encode() + b"\n")
        self.file.flush()
        doc = self._answer()
        if "error" in doc:
            raise QmpError(f"QMP {name}: {doc['error'].get('desc', doc['error'])}")
        return doc.get("return", doc.get("QMP"))

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def save_state(qmp_path: str, state: Path) -> None:
    """Worker thread: stop the guest, migrate its device state (RAM mapped
    shared left out) into ``state``, and end QEMU."""
    q = Qmp(qmp_path)
    try:
        state.unlink(missing_ok=True)
        q.cmd("migrate-set-capabilities",
              capabilities=[{"capability": "x-ignore-shared", "state": True}])
        q.cmd("stop")
        q.cmd("migrate", uri=f"exec:cat > {shlex.quote(str(state))}")
        deadline = time.monotonic() + MIGRATE_TIMEOUT
        while True:
            info = q.cmd("query-migrate")
            status = info.get("status") if isinstance(info, dict) else None
            if status == "completed":
                break
            if status in ("failed", "cancelled") or time.monotonic() > deadline:
                q.cmd("cont")
                raise QmpError(f"the migration to {state} {status or 'timed out'}: {info}")
            time.sleep(0.05)
        try:
            q.cmd("quit")
        except (QmpError, OSError):
            pass  # it quits before it answers, or just after
    finally:
        q.close()


def read_state(path: Path) -> bytes:
    """Worker thread: the device state QEMU wrote (as the VMM's user, in a
    directory that user may write): a regular file, never through a link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise QmpError(f"{path} is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def new_private_file(path: Path, mode: int) -> int:
    """Worker thread: ``path`` made new for writing (never through a link or
    over a file the VMM's user put there), its descriptor."""
    path.unlink(missing_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                   mode)


def flush_file(path: str) -> None:
    """Worker thread: the dirty pages of ``path`` (a RAM disk's FUSE file a
    VMM mapped shared) written back (the daemon serves those writes on its
    loop meanwhile)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def peer_pid(sock: socket.socket) -> int:
    """The process id of a connected unix socket's other end (0: unknown)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)[0]


@dataclass
class StateLoaded:
    """A resumed vm's device state loaded: how long it took, and the VMM's
    process (its QMP socket's peer; None where not known)."""

    seconds: float
    vmm: Process | None


def load_state(qmp_path: str, state: str) -> StateLoaded:
    """Worker thread: load device state file ``state`` into a QEMU started
    with ``-incoming defer`` (its RAM the snapshot's, so ``x-ignore-shared``
    as on the side that saved it), then let it run (it comes back paused,
    the state the saved side was stopped in)."""
    started = time.monotonic()
    q = Qmp(qmp_path, wait=10.0)
    vmm = Process.of(q.peer_pid)
    try:
        q.cmd("migrate-set-capabilities",
              capabilities=[{"capability": "x-ignore-shared", "state": True}])
        q.cmd("migrate-incoming", uri=f"exec:cat {shlex.quote(state)}")
        deadline = time.monotonic() + MIGRATE_TIMEOUT
        while True:
            info = q.cmd("query-migrate")
            status = info.get("status") if isinstance(info, dict) else None
            if status == "completed":  # paused, as the saved side was: go on
                q.cmd("cont")
                return StateLoaded(time.monotonic() - started, vmm)
            if status in ("failed", "cancelled") or time.monotonic() > deadline:
                raise QmpError(f"loading {state}: {status or 'timed out'}: {info}")
            time.sleep(0.01)
    finally:
        q.close()


def coalesce(ranges: list[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges clipped to ``[0, limit)``, sorted, the
    touching and overlapping ones joined into runs."""
    runs: list[tuple[int, int]] = []
    for off, length in sorted(ranges):
        off, end = max(off, 0), min(off + length, limit)
        if end <= off:
            continue
        if runs and off <= runs[-1][0] + runs[-1][1]:
            start = runs[-1][0]
            runs[-1] = (start, max(end, start + runs[-1][1]) - start)
        else:
            runs.append((off, end - off))
    return runs


def snapshot_source(ram: Path, ram_size: int, state: bytes,
                    header: SnapshotHeader) -> DiskSource:
    """The snapshot layer's contents: the RAM file's non-zero blocks, the
    state, the header; room for a larger state between them (a hole)."""
    state_len = -(-len(state) // lsmt.SECTOR) * lsmt.SECTOR
    size = ram_size + max(state_len, STATE_AREA) + HEADER_BYTES  # (a resumed vm's next)
    header_at = size - HEADER_BYTES - ram_size
    tail = state.ljust(state_len, b"\0")
    ram_src = scan_image(str(ram), False)
    maps = [m for m in ram_src.mappings if m.offset * lsmt.SECTOR < ram_size]
    for at, part in ((ram_size, tail), (ram_size + header_at, header.pack())):
        first = at // lsmt.SECTOR
        maps += lsmt.split_extent(first, len(part) // lsmt.SECTOR,
                                  first + lsmt.HT_SPACE // lsmt.SECTOR)

    def read(offset: int, length: int) -> bytes:
        if offset >= ram_size + header_at:
            return header.pack()[offset - ram_size - header_at:][:length]
        if offset >= ram_size:
            return tail[offset - ram_size : offset - ram_size + length]
        assert offset + length <= ram_size
        return ram_src.read(offset, length)

    return DiskSource(size, maps, read)
