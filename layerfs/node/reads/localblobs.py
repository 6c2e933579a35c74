"""Local blob files: a small layer's data blob, whole and verified, on the node's disk.

A layer whose data blob is at most ``--fetch-whole-below`` bytes is fetched
whole when it is first mounted on the node, rather than a store request per
small file as its files are read: its chunks in a few large range reads
(neighbouring chunks of one pack, up to ``WHOLE_SPAN`` stored bytes each;
a small pack whole), each chunk decoded and checked against its sha256 in a
worker thread and written at its blob offset into ``ROOT/blobs/<hex>``
(holes stay sparse and read as zeros, as in the FUSE blob file). Chunks the
node already holds (memory, a flight, the chunk cache) come from there. The
layer's EROFS mount then names that file as its device: every read of the
layer after the mount is the kernel's (ext4 and the page cache, once: EROFS
reads it with ``directio``), with no request to the daemon. A daemon that
dies or restarts leaves such mounts reading a complete file.

Trust, as for meta images: a file is complete or absent (written under
``blobs/tmp/``, renamed into place when every chunk is in); before a later
mount its chunks are hashed again against the chunk table, and the mount
names the open, checked file (``/proc/self/fd/N``), never the path again. A
file that fails is deleted (one warning) and fetched again.

A layer that cannot be fetched whole (the store away, a damaged chunk, ROOT
full) is mounted over its lazy FUSE blob file instead, with one warning:
its reads then fail or succeed one by one as before.

Bound: files of layers no mount uses are deleted, oldest use first, while
the files together exceed ``--local-blobs``.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import logging
import os
import shutil
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from ...chunks import pack_runs
from ...formats.chunktable import ChunkEntry, ChunkTable
from ...ratelog import RateLimitedLog
from .chunkstates import ChunkState, FetchError
from .fetcher import ChunkFetcher

log = logging.getLogger(__name__)

WHOLE_SPAN = 8 << 20  # stored bytes of one range read of a whole-layer fetch
WHOLE_GAP = 256 << 10  # ... which reads over at most this much between two chunks


@dataclass
class LocalBlob:
    """A checked local blob file, open: mount ``source``, then ``close`` it."""

    path: Path
    fd: int
    fetched: bool  # fetched just now (False: an existing file, checked again)

    @property
    def source(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    def close(self) -> None:
        os.close(self.fd)


class LocalBlobs:
    """The node's local blob files (``ROOT/blobs``), filled from the store."""

    def __init__(self, root: Path, fetcher: ChunkFetcher, whole_below: int,
                 limit: int) -> None:
        self.dir = root / "blobs"
        self.tmp = self.dir / "tmp"
        self.fetcher = fetcher
        self.whole_below = whole_below
        self.limit = limit
        self.in_use: dict[str, int] = {}  # hex → mounts using its file
        self.warnings = RateLimitedLog(log)

    def prepare(self) -> None:
        """At start (ROOT/blobs made root-only by the daemon): no temporaries
        a crash left."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(mode=0o700, parents=True, exist_ok=True)

    def wanted(self, table: ChunkTable) -> bool:
        """Whether the layer is small enough to be fetched whole."""
        return 0 < table.blob_size <= self.whole_below

    def path(self, hex_: str) -> Path:
        return self.dir / hex_

    async def open(self, hex_: str, table: ChunkTable) -> LocalBlob | None:
        """The layer's blob file, checked (an existing one) or fetched whole
        now; None (one warning) if neither can be had: mount the FUSE file."""
        path = self.path(hex_)
        fd = await trio.to_thread.run_sync(open_checked, path, table)
        if fd is not None:
            self._used(hex_)
            return LocalBlob(path, fd, fetched=False)
        try:
            fd = await self._fetch_whole(hex_, table)
        except (FetchError, OSError) as exc:
            self.warnings.warning("whole", "layer %s not fetched whole (%s): its reads go "
                                  "through the FUSE blob file", hex_[:16], exc)
            return None
        self._used(hex_)
        return LocalBlob(path, fd, fetched=True)

    async def adopt(self, hex_: str) -> bool:
        """A small layer's mount kept across a live restart: whether its
        local file is there (then counted in use: the mount reads it), else
        the mount is on the FUSE file."""
        if not await trio.to_thread.run_sync(self.path(hex_).exists):
            return False
        self._used(hex_)
        return True

    def _used(self, hex_: str) -> None:
        self.in_use[hex_] = self.in_use.get(hex_, 0) + 1

    async def release(self, hex_: str) -> None:
        """A mount of the file ended; files beyond the bound are dropped."""
        left = self.in_use.get(hex_, 0) - 1
        if left > 0:
            self.in_use[hex_] = left
            return
        self.in_use.pop(hex_, None)
        await trio.to_thread.run_sync(self.trim, frozenset(self.in_use))

    def trim(self, in_use: frozenset[str]) -> list[str]:
        """Worker thread: see :func:`trim_files`."""
        return trim_files(self.dir, self.limit, in_use)

    def forget(self, hex_: str) -> None:
        """Worker thread: a forgotten layer's file, gone (unless mounted)."""
        if hex_ not in self.in_use:
            self.path(hex_).unlink(missing_ok=True)

    async def _fetch_whole(self, hex_: str, table: ChunkTable) -> int:
        """Every chunk of the layer into a new file, renamed into place; the
        file open for reading."""
        tmp = self.tmp / f"{hex_}.{os.getpid()}.{id(table):x}"
        fd = await trio.to_thread.run_sync(new_sparse, tmp, table.blob_size)
        try:
            await self._fill(fd, table)
            await trio.to_thread.run_sync(os.rename, tmp, self.path(hex_))
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        try:
            return await trio.to_thread.run_sync(reopen_read_only, fd)
        finally:
            os.close(fd)

    async def _fill(self, fd: int, table: ChunkTable) -> None:
        """Every chunk of the layer at its blob offset in the file ``fd``
        (a chunk twice in the layer is written twice)."""
        def write(entry: ChunkEntry, data: bytes | memoryview) -> None:
            write_at(fd, data, entry.blob_offset)

        await fill_chunks(self.fetcher, table.entries, write)


async def fill_chunks(fetcher: ChunkFetcher, entries: list[ChunkEntry],
                      sink: Callable[[ChunkEntry, bytes | memoryview], None]) -> None:
    """Each of ``entries`` handed, decoded and checked, to ``sink`` (in a
    worker thread: it writes it): the chunks the node holds from where they
    are, the others from the store in runs of neighbours (``pack_runs``, up to
    ``WHOLE_SPAN``), all at once within the fetcher's slots, by one deadline.
    The first failure (FetchError, OSError) ends the others and is raised."""
    held = [e for e in entries if fetcher.state(e.sha256) is not ChunkState.ABSENT]
    absent = sorted((e for e in entries if fetcher.state(e.sha256) is ChunkState.ABSENT),
                    key=lambda e: (e.pack, e.pack_offset))
    deadline = fetcher.deadline()
    failed: list[Exception] = []

    async def from_node(entry: ChunkEntry) -> None:
        data = await fetcher.get(entry, deadline=deadline)
        await trio.to_thread.run_sync(sink, entry, data)

    async def task(step: Callable[[], Awaitable[None]], cancel: trio.CancelScope) -> None:
        try:
            await step()
        except (FetchError, OSError) as exc:
            failed.append(exc)
            cancel.cancel()

    async with trio.open_nursery() as nursery:
        for run in pack_runs(absent, span=WHOLE_SPAN, gap=WHOLE_GAP):
            nursery.start_soon(task, functools.partial(fetcher.read_run_into, run, sink,
                                                       deadline), nursery.cancel_scope)
        for entry in held:
            nursery.start_soon(task, functools.partial(from_node, entry), nursery.cancel_scope)
    if failed:
        raise failed[0]


def trim_files(directory: Path, limit: int, in_use: frozenset[str]) -> list[str]:
    """Worker thread: delete the files of ``directory`` no mount uses
    (``in_use``: the loop's count, as it was when called), least recently
    used first, while all of them together take more than ``limit`` bytes of
    disk; their names."""
    files = []
    for entry in os.scandir(directory):
        if entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            files.append((st.st_atime, entry.name, st.st_blocks * 512))
    total = sum(size for _, _, size in files)
    dropped = []
    for _, name, size in sorted(files):
        if total <= limit:
            break
        if name in in_use:
            continue
        (directory / name).unlink(missing_ok=True)
        total -= size
        dropped.append(name)
    if dropped:
        log.info("%s: files of %d unused layers deleted (bound %d MiB)", directory,
                 len(dropped), limit >> 20)
    return dropped


def new_sparse(path: Path, size: int) -> int:
    """Worker thread: a new root-only file of ``size`` bytes, all holes, open."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_at(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Worker thread: all of ``data`` at ``offset``."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def reopen_read_only(fd: int) -> int:
    """Worker thread: the same file again, read-only (what the mount gets)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def open_checked(path: Path, table: ChunkTable) -> int | None:
    """Worker thread: the existing blob file, open, if it is a regular
    root-owned file of the blob's size whose every chunk matches its sha256;
    else None (a damaged one is deleted with one warning)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ELOOP):
            log.warning("local blob file %s cannot be opened: %s", path, exc)
        return None
    problem = _problem(fd, table)
    if problem is None:
        os.utime(fd)  # its last use, for the bound's order
        return fd
    os.close(fd)
    log.warning("local blob file %s %s; fetching the layer again", path, problem)
    path.unlink(missing_ok=True)
    return None


def _problem(fd: int, table: ChunkTable) -> str | None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != 0:
        return "is not a regular file of root's"
    if st.st_size != table.blob_size:
        return f"has {st.st_size} bytes, not {table.blob_size}"
    for entry in table.entries:
        data = os.pread(fd, entry.length, entry.blob_offset)
        if len(data) != entry.length or hashlib.sha256(data).digest() != entry.sha256:
            return f"does not hold chunk {entry.sha256.hex()[:16]} at {entry.blob_offset}"
    return None
