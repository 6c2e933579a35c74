"""The daemon's end of its lease with the keeper: the pre-content events the
keeper hands on (``ev N OFFSET COUNT`` with the event's descriptor), each
answered by the partial blob files (:mod:`..reads.partialblobs`), and the
``done N ...`` that tells the keeper which of its descriptors to close.

Neither side ever waits on the other in a blocking call (the keeper may be
waiting to hand this daemon an event while it sends a ``done``): the lease is
read without waiting, and ``done`` goes in batches by a task that waits until
the socket has room. Numbers are the keeper's: those of a keeper that died
are dropped, never said to the next one (it would close its own descriptors
of those numbers).
"""

from __future__ import annotations

import errno
import logging
import os
import socket

import trio

from ... import fanotify
from ...tasks import TaskGroup
from ..reads.partialblobs import PartialBlobs
from .connection import FuseConnection, receive

log = logging.getLogger(__name__)
DONE_BATCH = 500  # numbers in one ``done`` message (the keeper reads up to 8 KiB)


class KeeperLink:
    """The lease of ``conn``: events to ``partial`` (None: each fails, EIO)."""

    def __init__(self, conn: FuseConnection, partial: PartialBlobs | None,
                 tasks: TaskGroup) -> None:
        self.conn = conn
        self.partial = partial
        self.tasks = tasks
        self.answered: list[int] = []  # the keeper's events answered, not yet said so

    def read(self) -> bool:
        """Every message on the lease now, handled; False once it reads end
        of file (the keeper is gone: its numbers are forgotten)."""
        while self.conn.lease is not None:
            try:
                message, fds = receive(self.conn.lease)
            except BlockingIOError:
                return True
            if not message:
                self.answered.clear()
                return False
            self._event(message, fds)
        return True

    def _event(self, message: bytes, fds: list[int]) -> None:
        event = fanotify.parse_event_message(message)
        if event is None or len(fds) != 1 or self.partial is None:
            for fd in fds:
                os.close(fd)
            log.warning("ignored a message from the keeper: %r", message[:40])
            return
        lease = self.conn.lease

        def done(number: int) -> None:
            if self.conn.lease is not lease:  # a dead keeper's number: not the next keeper's
                return
            self.answered.append(number)
            if len(self.answered) == 1:
                self.tasks.start_soon(self._say_answered)
        if not self.tasks.start_soon(self.partial.answer, event, fds[0], done):
            os.close(fds[0])  # (not serving yet, or any more): the read fails
            fanotify.respond(self.partial.group, event.fd, errno.EIO)

    async def _say_answered(self) -> None:
        """``done`` for the answered events, in batches, waiting only for room."""
        while self.answered and self.conn.lease is not None:
            batch = self.answered[:DONE_BATCH]
            try:
                self.conn.lease.send(fanotify.done_message(batch), socket.MSG_DONTWAIT)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.conn.lease)
                continue
            except OSError:
                break  # the keeper is gone, with its descriptors
            del self.answered[:len(batch)]
        self.answered.clear()
