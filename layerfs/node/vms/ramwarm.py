"""A resumed vm's working set put into its RAM file's page cache by the daemon itself.

A resume whose snapshot has a pushed working set (the chunks a resume of it
touched in its first seconds: docs/vm.md) brings those pages into the RAM
file's page cache before the guest goes on, so that its first touches are
minor faults instead of a FUSE read each. Each run of the working set is
read from the RAM disk in the daemon (``WritableDisk.read``: the chain's
chunks fetched and checked as for any read, the fetch-ahead already on its
way) and handed to the kernel with FUSE's store notification
(``FUSE_NOTIFY_STORE``: ``pyfuse3.notify_store``), :data:`PIECE` bytes a
notification, :data:`AT_ONCE` pieces at once: no read request goes through
the kernel and back for it.

The rule that keeps it right: a store replaces what the page cache holds
for its pages, so it may only carry the disk's bytes while nothing else
writes the file. The guest's state is loaded, and the guest goes on, only
once the warm-up is done or stopped (``Vms._load_state``), and
:meth:`RamWarmUp.stop` takes the lock every store is made under: after it
returns, no store is made, so none can land on a page the guest (or its
VMM) has written since.

The file is opened once first, in a worker thread: the disk's first open
since it was made, at which the kernel drops the file's pages; the VMM's
later open keeps them (``WritableDisk.kernel_open``). It is closed in a
worker thread too (its flush is a request this daemon answers), abandoned
if the daemon stops meanwhile (no one would answer it). :meth:`RamWarmUp.stop`
waits for a store under way, which may wait for the kernel, which may wait
for this daemon: the trio thread calls it in a worker thread
(:meth:`RamWarmUp.stopped`). Nothing a warm-up meets ends the daemon: a
failure of any kind ends the warm-up with one line.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pyfuse3
import trio

from ...errors import LayerfsError
from ..reads.blobfiles import Buffer
from .diskfiles import SECTOR, WritableDisk

log = logging.getLogger(__name__)
PIECE = 4 << 20  # a working set's pages are stored this much a notification
AT_ONCE = 8  # pieces read and stored at once (4: the warm-up 10-15 % longer; 16: as 8)
WARM_TIMEOUT = 120.0  # seconds a guest waits for its working set at most


class RamWarmUp:
    """One resumed vm's warm-up: ``done`` (a trio.Event) once it has ended,
    however."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.stored = 0  # bytes handed to the kernel
        self._lock = threading.Lock()
        self._stopped = False

    def stop(self) -> None:
        """Worker thread: no store from now on (a store under way ends first)."""
        with self._lock:
            self._stopped = True

    async def stopped(self) -> None:
        """:meth:`stop`, from the trio thread."""
        await trio.to_thread.run_sync(self.stop)

    def _store(self, inode: int, offset: int, parts: list[Buffer]) -> None:
        """Worker thread: ``parts``, one after another from ``offset``, into
        the page cache of FUSE inode ``inode``, unless stopped (one
        notification a part: no copy to join them)."""
        with self._lock:
            if self._stopped:
                return
            for part in parts:
                if len(part):
                    pyfuse3.notify_store(inode, offset, part)  # type: ignore[arg-type]  # (any buffer)
                offset += len(part)
                self.stored += len(part)

    async def run(self, vid: str, disk: WritableDisk, path: str,
                  runs: list[tuple[int, int]]) -> None:
        """Store ``runs`` (``(offset, length)`` of the RAM file ``path``, the
        file of ``disk``); the first failure (the store away, the vm gone)
        stops it with one line: the guest faults in the rest. Logs what it
        stored; ``done`` set at the end, whatever happened."""
        started = time.monotonic()
        try:
            try:
                fd = await trio.to_thread.run_sync(os.open, path, os.O_RDONLY | os.O_CLOEXEC,
                                                   abandon_on_cancel=True)
            except OSError as exc:
                await self._given_up(vid, exc)
                return
            try:
                failed = await self._pieces(disk, runs)
            finally:
                await trio.to_thread.run_sync(os.close, fd, abandon_on_cancel=True)
        except Exception as exc:  # noqa: BLE001 - a warm-up never ends the daemon
            log.error("vm %s: its working set's read ahead failed: %r", vid, leaf(exc))
            await self._given_up(vid, None)
            return
        finally:
            self.done.set()
        if failed is not None:
            await self._given_up(vid, failed)
            return
        log.info("vm %s: working set read ahead (%d bytes in %d runs, %.3f s%s)", vid,
                 self.stored, len(runs), time.monotonic() - started,
                 "; stopped before the end" if self._stopped else "")

    async def _pieces(self, disk: WritableDisk,
                      runs: list[tuple[int, int]]) -> LayerfsError | OSError | None:
        """Read and store the runs' pieces (whole sectors: a run widened to
        them); the first failure ends it (returned)."""
        limiter = trio.CapacityLimiter(AT_ONCE)
        failed: list[LayerfsError | OSError] = []

        async def piece(offset: int, length: int) -> None:
            async with limiter:
                if self._stopped or failed:
                    return
                try:
                    parts = await disk.read_parts(offset // SECTOR, length // SECTOR)
                    await trio.to_thread.run_sync(self._store, disk.inode, offset, parts)
                except* (LayerfsError, OSError) as group:  # (a read of several chunks: a group)
                    first = leaf(group)
                    assert isinstance(first, (LayerfsError, OSError))
                    failed.append(first)
                    nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for start, size in runs:
                offset = start - start % SECTOR
                length = -(-(start + size) // SECTOR) * SECTOR - offset
                for at in range(0, length, PIECE):
                    nursery.start_soon(piece, offset + at, min(PIECE, length - at))
        return failed[0] if failed else None

    async def _given_up(self, vid: str, exc: LayerfsError | OSError | None) -> None:
        """A failure ends it: one warning line (``exc``; None: said already),
        unless it was stopped first (the vm went down: its disk's reads fail)."""
        stopped = self._stopped
        await self.stopped()
        self.done.set()
        if exc is None:
            return
        if stopped:
            log.debug("vm %s: its working set's read ahead ended: %s", vid, exc)
            return
        log.warning("vm %s: its working set is not read ahead (%s): the guest faults it in",
                    vid, exc)


def leaf(exc: BaseException) -> BaseException:
    """The first error a group holds, however nested (``exc`` if not a group)."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
