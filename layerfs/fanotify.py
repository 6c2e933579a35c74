"""fanotify pre-content groups: the kernel's other way, beside FUSE, to ask
the daemon for bytes it has not got yet (Linux 6.14+).

A large layer's EROFS mount reads a sparse local blob file marked with
``FAN_PRE_ACCESS``; each read the mount makes of that file stops in a
permission event carrying its range until a listener answers it. The daemon
fills the range (through the event's own descriptor, which raises no event)
and allows the read, or denies it with an errno the reader gets
(layerfs/node/reads/partialblobs.py). The group is kept by the keeper, as
the FUSE connection is (a group whose last descriptor closes allows its
pending events: the readers would get the file's holes, zeros), and the
keeper (layerfs/node/fuse/keeper.py) reads the events and hands them to the
daemon of the moment.

Standard library only, like the keeper that imports it: a ctypes binding of
``fanotify_init`` and ``fanotify_mark`` (no maintained Python package binds
pre-content events and their range records), the event records, and the
keeper's messages that carry them.
"""

from __future__ import annotations

import array
import ctypes
import errno
import os
import re
import resource
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

FAN_CLOEXEC, FAN_NONBLOCK = 0x1, 0x2
FAN_CLASS_PRE_CONTENT = 0x8
FAN_MARK_ADD, FAN_MARK_REMOVE, FAN_MARK_DONT_FOLLOW = 0x1, 0x2, 0x4
AT_FDCWD = -100
FAN_PRE_ACCESS = 0x00100000
FAN_ALLOW, FAN_DENY = 0x1, 0x2
FAN_EVENT_INFO_TYPE_RANGE = 6
FAN_NOFD = -1
EVENT = struct.Struct("IBBHQii")  # event metadata: len, version, _, meta len, mask, fd, pid
INFO_HEADER = struct.Struct("BBH")  # fanotify_event_info_header: type, pad, len
RANGE = struct.Struct("QQ")  # fanotify_event_info_range after its header and 4 bytes of padding
RESPONSE = struct.Struct("iI")  # fanotify_response: fd, response
READ_SIZE = 64 << 10
EVENT_MESSAGE = re.compile(rb"ev ([0-9]{1,9}) ([0-9]{1,20}) ([0-9]{1,20})")
DONE_MESSAGE = re.compile(rb"done( [0-9]{1,9})+")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int,
                                ctypes.c_char_p]


@dataclass(frozen=True)
class PreRead:
    """One pending read of a marked file: the event's descriptor (in the
    process that read the event) and the byte range the reader wants."""

    fd: int
    offset: int
    count: int


def new_group() -> int:
    """A pre-content group whose event descriptors open read-write (the
    daemon fills the file through them); OSError where the kernel has none."""
    fd = _libc.fanotify_init(FAN_CLASS_PRE_CONTENT | FAN_CLOEXEC | FAN_NONBLOCK,
                             os.O_RDWR | os.O_LARGEFILE)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"no fanotify pre-content group: {os.strerror(err)}")
    return fd


def _mark(group: int, flags: int, fd: int) -> None:
    if _libc.fanotify_mark(group, flags, FAN_PRE_ACCESS, fd, None) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def mark(group: int, fd: int) -> None:
    """Every later open of the file ``fd`` names raises pre-content events
    (opens made before, ``fd`` itself included, do not)."""
    _mark(group, FAN_MARK_ADD, fd)


def unmark(group: int, fd: int) -> None:
    """The file is complete: its reads raise no event from now on."""
    try:
        _mark(group, FAN_MARK_REMOVE, fd)
    except OSError as exc:
        if exc.errno != errno.ENOENT:  # (not marked: nothing to remove)
            raise


def unmark_path(group: int, path: str) -> None:
    """The file at ``path`` (not followed if a link) is no longer marked."""
    flags = FAN_MARK_REMOVE | FAN_MARK_DONT_FOLLOW
    if _libc.fanotify_mark(group, flags, FAN_PRE_ACCESS, AT_FDCWD, path.encode()) < 0:
        err = ctypes.get_errno()
        if err not in (errno.ENOENT,):
            raise OSError(err, os.strerror(err), path)


def marked_inodes(group: int) -> set[int]:
    """The inode numbers the group has marks on (from its fdinfo)."""
    found = set()
    with open(f"/proc/self/fdinfo/{group}") as info:
        for line in info:
            if line.startswith("fanotify ino:"):
                found.add(int(line.split()[1].removeprefix("ino:"), 16))
    return found


def parse_events(buf: bytes) -> list[PreRead]:
    """The pending reads in a buffer read from the group (an event without a
    range record, which a pre-content group does not send, gets count 0)."""
    reads, pos = [], 0
    while pos + EVENT.size <= len(buf):
        length, _, _, meta_len, _, efd, _ = EVENT.unpack_from(buf, pos)
        if length < EVENT.size:
            break
        offset = count = 0
        info = pos + meta_len
        while info + INFO_HEADER.size <= pos + length:
            kind, _, info_len = INFO_HEADER.unpack_from(buf, info)
            if info_len == 0:
                break
            if kind == FAN_EVENT_INFO_TYPE_RANGE:
                offset, count = RANGE.unpack_from(buf, info + 8)
            info += info_len
        if efd != FAN_NOFD:
            reads.append(PreRead(efd, offset, count))
        pos += length
    return reads


def read_events(group: int) -> list[PreRead]:
    """The events the group has now (none: an empty list). A reader out of
    descriptors gets none: the kernel denies the event it could not give
    a descriptor (its read fails with EPERM) instead of leaving it pending."""
    try:
        return parse_events(os.read(group, READ_SIZE))
    except BlockingIOError:
        return []
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            return []
        raise


def respond(group: int, fd: int, error: int = 0) -> None:
    """Answer the event whose descriptor number is ``fd`` (in the process
    that read it): allow the read, or fail it with ``error``."""
    answer = FAN_ALLOW if not error else FAN_DENY | (error & 0xFF) << 24
    try:
        os.write(group, RESPONSE.pack(fd, answer))
    except FileNotFoundError:
        pass  # answered already (by a daemon before a restart)


def numbers_below() -> int:
    """A bound on the event numbers of a reader this process starts: its
    descriptor numbers stay below the hard limit it inherits, which the
    kernel caps at ``fs.nr_open``."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    try:
        cap = int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        cap = 1 << 20
    return cap if hard == resource.RLIM_INFINITY else min(hard, cap)


def deny_all(group: int, below: int, error: int = errno.EIO) -> int:
    """Fail every event read and not answered whose descriptor number is
    below ``below``: those of a reader that died (its numbers are unknown
    and may be given again to the next reader's events, which an answer
    by number would confuse with them); how many there were."""
    denied = 0
    answer = FAN_DENY | (error & 0xFF) << 24
    for number in range(below):
        try:
            os.write(group, RESPONSE.pack(number, answer))
        except FileNotFoundError:
            continue
        denied += 1
    return denied


def event_message(event: PreRead) -> bytes:
    """The keeper's message that hands a daemon one event (its descriptor
    goes along with SCM_RIGHTS; the number is the keeper's, which the answer
    names)."""
    return b"ev %d %d %d" % (event.fd, event.offset, event.count)


def parse_event_message(message: bytes) -> PreRead | None:
    """(keeper's descriptor number, offset, count) of an ``ev`` message."""
    match = EVENT_MESSAGE.fullmatch(message)
    if match is None:
        return None
    return PreRead(*(int(g) for g in match.groups()))


def send_event(sock: socket.socket, event: PreRead) -> None:
    """Hand ``event`` on over a unix socket, its descriptor attached, without
    waiting (BlockingIOError when the socket is full; ``socket.send_fds`` of
    Python 3.11 drops its flags and would wait)."""
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [event.fd]))]
    sock.sendmsg([event_message(event)], rights, socket.MSG_DONTWAIT)


def done_message(numbers: list[int]) -> bytes:
    """A daemon's word that it answered these events (the keeper closes them)."""
    return b"done " + b" ".join(b"%d" % n for n in numbers)


def parse_done_message(message: bytes) -> list[int] | None:
    if DONE_MESSAGE.fullmatch(message) is None:
        return None
    return [int(n) for n in message.split()[1:]]
