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

A keeper that dies leaves events whose numbers no one knows (read, not yet
handed on), and the next keeper's descriptors may get the same numbers: an
answer to its event N would let an older event N read the file's holes (the
kernel matches answers oldest first). So before the next keeper starts,
:meth:`KeeperLink.forget_keeper` lets the answers in progress finish (a few
seconds at most), then fails every number the dead keeper could have used;
an answer of the dead keeper's that comes later is dropped (its read failed
with EIO).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Callable

import trio

from ... import fanotify
from ...tasks import TaskGroup
from ..reads.partialblobs import PartialBlobs
from .connection import FuseConnection, receive

log = logging.getLogger(__name__)
DONE_BATCH = 500  # numbers in one ``done`` message (the keeper reads up to 8 KiB)
DEAD_KEEPER_WAIT = 5.0  # seconds the answers to a dead keeper's events have before all fail


class KeeperLink:
    """The lease of ``conn``: events to ``partial`` (None: each fails, EIO)."""

    def __init__(self, conn: FuseConnection, partial: PartialBlobs | None,
                 tasks: TaskGroup) -> None:
        self.conn = conn
        self.partial = partial
        self.tasks = tasks
        self.answered: list[int] = []  # the keeper's events answered, not yet said so
        self.keeper = 0  # counts the keepers that died: an answer is for this one's events
        self.answering = 0  # events being answered
        self.quiet = trio.Event()  # set when the count comes down to 0
        self.highest = -1  # the highest event number handed on

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
        lease, keeper, group = self.conn.lease, self.keeper, self.partial.group
        self.highest = max(self.highest, event.fd)

        def reply(error: int) -> None:
            if self.keeper != keeper:  # failed already (forget_keeper): the number is the
                return                 # next keeper's
            fanotify.respond(group, event.fd, error)
            if self.conn.lease is lease:  # a dead keeper's number: not said to the next one
                self._done(event.fd)
        if not self.tasks.start_soon(self._answer, event, fds[0], reply):
            os.close(fds[0])  # (not serving yet, or any more): the read fails
            fanotify.respond(group, event.fd, errno.EIO)

    async def _answer(self, event: fanotify.PreRead, fd: int,
                      reply: Callable[[int], None]) -> None:
        assert self.partial is not None
        self.answering += 1
        try:
            await self.partial.answer(event, fd, reply)
        finally:
            self.answering -= 1
            if not self.answering:
                self.quiet.set()
                self.quiet = trio.Event()

    def _done(self, number: int) -> None:
        self.answered.append(number)
        if len(self.answered) == 1:
            self.tasks.start_soon(self._say_answered)

    async def forget_keeper(self) -> int:
        """After the keeper died, before the next one reads an event: the
        answers in progress (``DEAD_KEEPER_WAIT`` at most), then every event
        the dead keeper left unanswered fails with EIO; how many did."""
        if self.partial is None:
            return 0
        with trio.move_on_after(DEAD_KEEPER_WAIT):
            while self.answering:
                await self.quiet.wait()
        below = max(self.highest + 1, fanotify.numbers_below())
        failed = await trio.to_thread.run_sync(fanotify.deny_all, self.partial.group, below)
        self.keeper += 1
        self.highest = -1
        return failed

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
