"""Partial blob files: a large layer's data blob on the node's disk, filled as it is read.

A layer too large to fetch whole (:mod:`.localblobs`) is mounted over a
sparse file of its blob's size, ``ROOT/blobs/partial/<hex>``, marked with a
fanotify pre-content mark (:mod:`layerfs.fanotify`). Every read the layer's
EROFS mount makes of that file stops in an event carrying its range; the
keeper hands the event to the daemon (:meth:`PartialBlobs.answer`), which
writes the range's missing chunks into the file, each decoded and checked
against its sha256 first, and then allows the read. So a range the node
holds is read by the kernel from ext4 (the daemon only says yes), and the
data is in the page cache once: EROFS reads the file with ``directio``.
Once every chunk of the blob is in, the mark is removed and its reads raise
no event at all. A read that brings in a program's or library's first chunk
from its start hands it to the library fetch-ahead (the libraries it names
come into the node's memory and cache, where the loader's fills find them).

Trust: only this daemon's checked writes count (``PartialBlob.present``).
A file that was there before (an earlier mount, an earlier daemon) may
hold anything: each of its chunks is hashed again on its first read, and
fetched again if it does not match (a hole is fetched without hashing). A
read is allowed only when every chunk it covers is present; a failure (the
store away past ``--read-timeout``, a damaged chunk) denies it with EIO.
A daemon killed in the middle of a fill leaves its events with the keeper,
which hands them to the next daemon: that one sees the chunk absent, fetches
it and allows the read. Reads never see a hole the daemon did not fill.

Writes go through a descriptor that raises no event: one opened before the
mark (a fresh mount), or an event's own (a mount kept across a restart, or
a file the group marks already: one a mount of an earlier daemon may still
read, whose mark must never lapse).

Bound: files of layers no mount uses are deleted, oldest use first, while
the files together exceed the bound (``--cache-size``: they hold what the
chunk cache held for these layers).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ... import fanotify
from ...formats.chunktable import FILE_START, ChunkEntry
from ...formats.elfdeps import is_elf
from ...ratelog import RateLimitedLog
from ...sizes import NO_SPACE
from ...tasks import TaskGroup
from .blobfiles import BlobFile
from .chunkstates import FetchError
from .fetcher import ChunkFetcher
from .libraryahead import LibraryAhead
from .localblobs import fill_chunks, trim_files, write_at

log = logging.getLogger(__name__)

# sync_file_range: wait for any writeback of the range, write it, wait for that
SYNC_RANGE_ALL = 0x1 | 0x2 | 0x4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]

NO_SPACE_RETRIES = 2  # rooms made and new tries of a write that found ROOT full
AHEAD_FIRST = 2 << 20  # a read that continues a stream fills this far past it ...
AHEAD_MOST = 32 << 20  # ... doubling with each such read up to this


@dataclass(eq=False)
class PartialBlob:
    """One layer's partial file while the layer is mounted."""

    blob: BlobFile  # the chunk table's index, the access trace, bytes read
    path: Path
    writer: int | None  # writes through it raise no event (None: the next event's)
    may_hold: bool  # the file was there before: its chunks are checked before use
    hold: int | None = None  # the file, open for its mount's source while it has no writer
    present: bytearray = field(default_factory=bytearray)  # per entry: checked in the file
    missing: int = 0
    flights: dict[int, trio.Event] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)  # why an entry's last fill failed
    stream_end: int = -1  # where the last read ended
    ahead: int = 0  # how far past a stream the next fill goes
    ahead_end: int = 0  # what is filled (or filling) ahead of the stream so far
    released: bool = False  # its mount ended: nothing more is written

    def __post_init__(self) -> None:
        self.present = bytearray(len(self.blob.table.entries))
        self.missing = len(self.present)

    @property
    def hex(self) -> str:
        return self.path.name


class PartialBlobs:
    """The node's partial blob files (``ROOT/blobs/partial``) and the answers to their events."""

    def __init__(self, root: Path, fetcher: ChunkFetcher, group: int, limit: int,
                 tasks: TaskGroup, make_room: Callable[[int], bool] = lambda _: False) -> None:
        """``make_room(nbytes)``: a worker thread's way to free room on ROOT's
        file system for a fill that found it full (the chunk cache's least
        recently used files, the held space); whether it freed any."""
        self.dir = root / "blobs" / "partial"
        self.fetcher = fetcher
        self.make_room = make_room
        self.group = group
        self.limit = limit
        self.tasks = tasks
        self.by_inode: dict[tuple[int, int], PartialBlob] = {}
        self.by_hex: dict[str, PartialBlob] = {}
        self.restored = trio.Event()  # set once kept mounts are adopted
        self.serving = False  # a keeper reads the group (else layers mount over FUSE files)
        self.warnings = RateLimitedLog(log)

    def prepare(self) -> None:
        """At start: the directory, root's only."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def path(self, hex_: str) -> Path:
        return self.dir / hex_

    def serve(self) -> None:
        """A keeper reads the group and hands its events to this daemon: new
        mounts of large layers use partial files from now on."""
        self.serving = True

    async def complete(self, hex_: str) -> bool:
        """Every chunk of a mounted layer into its file (a busy mount at a
        stop); whether it is complete."""
        part = self.by_hex.get(hex_)
        if part is None or part.writer is None:
            return part is not None and part.missing == 0
        try:
            await self._ensure(part, list(range(len(part.present))))
        except (FetchError, OSError) as exc:
            log.error("layer %s could not be fetched whole: %s", hex_[:16], exc)
            return False
        return True

    async def open(self, blob: BlobFile) -> str:
        """The layer's partial file, open and marked: what its mount names as
        its device (``/proc/self/fd/N``: the checked file, not the name
        again). Marked before the mount opens it, so that every read the
        mount makes raises an event; :meth:`release` after the unmount, or
        when the mount fails."""
        hex_ = blob.name
        path = self.path(hex_)
        fd, fresh = await trio.to_thread.run_sync(open_partial, path, blob.table.blob_size)
        if os.fstat(fd).st_ino in fanotify.marked_inodes(self.group):  # marked all along
            self._add(PartialBlob(blob, path, None, may_hold=True, hold=fd), fd)
            return f"/proc/self/fd/{fd}"
        try:
            fanotify.mark(self.group, fd)
        except BaseException:
            os.close(fd)
            raise
        self._add(PartialBlob(blob, path, fd, may_hold=not fresh), fd)
        return f"/proc/self/fd/{fd}"

    async def adopt(self, blob: BlobFile) -> bool:
        """A kept mount's file (a live restart): known again, its chunks
        unknown (checked on first read); False if it is not there."""
        path = self.path(blob.name)
        try:
            st = await trio.to_thread.run_sync(os.stat, path)
        except FileNotFoundError:
            return False
        part = PartialBlob(blob, path, None, may_hold=True)
        self.by_inode[(st.st_dev, st.st_ino)] = part
        self.by_hex[blob.name] = part
        return True

    def _add(self, part: PartialBlob, fd: int) -> None:
        st = os.fstat(fd)
        self.by_inode[(st.st_dev, st.st_ino)] = part
        self.by_hex[part.hex] = part

    async def release(self, hex_: str) -> None:
        """The layer's mount ended: its mark and writer go; files beyond the
        bound are dropped."""
        part = self.by_hex.pop(hex_, None)
        if part is None:
            return
        self.by_inode = {k: v for k, v in self.by_inode.items() if v is not part}
        part.released = True
        while part.flights:  # fills (a read-ahead) still writing through its writer
            await next(iter(part.flights.values())).wait()
        fds, part.writer, part.hold = (part.writer, part.hold), None, None
        await trio.to_thread.run_sync(self._let_go, part.path, fds, frozenset(self.by_hex))

    def _let_go(self, path: Path, fds: tuple[int | None, int | None],
                mounted: frozenset[str]) -> None:
        """Worker thread: a released file's mark, if this daemon made it (a
        mark from before stays: a detached mount of an earlier daemon may
        read the file), and descriptors; then the bound."""
        if fds[1] is None:
            fanotify.unmark_path(self.group, str(path))
        for fd in fds:
            if fd is not None:
                os.close(fd)
        self.trim(mounted)

    def trim(self, mounted: frozenset[str]) -> list[str]:
        """Worker thread: files beyond the bound dropped, but none a mount
        uses (``mounted``) or the group marks (a mount of an earlier daemon
        may read it: deleting the file would end its mark)."""
        return trim_files(self.dir, self.limit, mounted | self._marked())

    def forget(self, hex_: str) -> None:
        """Worker thread: a forgotten layer's file, gone (unless a mount uses
        it or the group marks it)."""
        if hex_ not in self.by_hex and hex_ not in self._marked():
            self.path(hex_).unlink(missing_ok=True)

    def _marked(self) -> frozenset[str]:
        """Worker thread: the names of the files the group marks."""
        inodes = fanotify.marked_inodes(self.group)
        return frozenset(e.name for e in os.scandir(self.dir)
                         if e.inode() in inodes and e.is_file(follow_symlinks=False))

    # -- events --------------------------------------------------------------

    async def answer(self, event: fanotify.PreRead, fd: int,
                     reply: Callable[[int], None]) -> None:
        """One read of a partial file (``event.fd``: the keeper's number for
        it, ``fd``: this daemon's copy): its chunks in the file, then
        ``reply(0)`` (the read allowed); ``reply(EIO)`` if they cannot be
        had. No reply if the daemon exits first (the keeper keeps the event)."""
        error: int | None = errno.EIO
        try:
            part = await self._part_of(fd)
            if part is None:
                self.warnings.warning("unknown", "a read of a file that is no partial blob of "
                                      "a mounted layer: failed (EIO)")
            else:
                if part.writer is None:
                    part.writer = os.dup(fd)
                await self._fill_range(part, event.offset, event.count)
                error = 0
        except (FetchError, OSError) as exc:
            self.warnings.warning("fill", "a read of layer data failed (EIO): %s", exc)
        except trio.Cancelled:  # the daemon exits (a handover): the keeper keeps the
            error = None        # event for the next daemon, which fills and answers it
            raise
        finally:
            os.close(fd)
            if error is not None:
                reply(error)

    async def _part_of(self, fd: int) -> PartialBlob | None:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        if key not in self.by_inode:
            await self.restored.wait()  # a kept mount's read, before its adoption
        return self.by_inode.get(key)

    async def _fill_range(self, part: PartialBlob, offset: int, count: int) -> None:
        """The chunks a read of ``[offset, +count)`` covers in the file; a
        read from the start of a small file of several chunks brings the
        rest of the file along (one store request: a loader reads the rest
        next), as the FUSE path's file fetch-ahead does."""
        blob = part.blob
        end = min(offset + count, blob.size)
        entries = blob.table.entries
        wanted = [i for i in blob.span(offset, end)
                  if entries[i].blob_offset + entries[i].length > offset]
        blob.note_read(wanted, max(end - offset, 0))
        self._read_ahead(part, offset, end)
        absent = [i for i in wanted if not part.present[i]]
        first = bool(absent) and absent[0] == wanted[0] and bool(
            entries[wanted[0]].flags & FILE_START) and entries[wanted[0]].blob_offset == offset
        if first:
            absent += [j for j in blob.rest_of_file(wanted[0])
                       if j not in wanted and not part.present[j]]
        await self._ensure(part, absent)
        if first and blob.libraries is not None and part.writer is not None:
            fd = os.dup(part.writer)
            if not self.tasks.start_soon(self._libraries_of, blob.libraries, fd, wanted[0]):
                os.close(fd)

    @staticmethod
    async def _libraries_of(libraries: LibraryAhead, fd: int, i: int) -> None:
        """A file's first chunk that a read from its start just brought into
        the file (``fd``, closed here): if it is an ELF file, the library
        fetch-ahead reads it (the libraries it names come into the node's
        memory and cache, where the loader's fills then find them)."""
        entry = libraries.entries[i]
        try:
            data = await trio.to_thread.run_sync(read_if_elf, fd, entry.blob_offset,
                                                 entry.length)
        except OSError:
            return
        finally:
            os.close(fd)
        if data is not None:
            libraries.missed(i, data)

    def _read_ahead(self, part: PartialBlob, offset: int, end: int) -> None:
        """A read that continues the last one fills ahead of the stream, in
        the background, further each time."""
        streaming = offset == part.stream_end
        part.stream_end = end
        if not streaming:
            part.ahead = 0
            return
        part.ahead = min(max(part.ahead * 2, AHEAD_FIRST), AHEAD_MOST)
        start, stop = max(end, part.ahead_end), min(end + part.ahead, part.blob.size)
        if start >= stop:
            return
        part.ahead_end = stop
        indexes = [i for i in part.blob.span(start, stop)
                   if not part.present[i] and i not in part.flights]
        if indexes:
            self.tasks.start_soon(self._ahead, part, indexes)

    async def _ahead(self, part: PartialBlob, indexes: list[int]) -> None:
        try:
            await self._ensure(part, indexes)
        except (FetchError, OSError) as exc:  # a read that needs them tries again
            log.debug("read-ahead of layer %s: %s", part.hex[:16], exc)

    async def _ensure(self, part: PartialBlob, indexes: list[int]) -> None:
        """Entries ``indexes`` in the file, checked, or FetchError: those no
        one fills are filled now, those in flight waited for."""
        mine, theirs = [], []
        for i in indexes:
            if part.present[i]:
                continue
            if i in part.flights:
                theirs.append(part.flights[i])
            else:
                part.flights[i] = trio.Event()
                part.failures.pop(i, None)
                mine.append(i)
        try:
            if mine:
                await self._bring(part, mine)
        except (FetchError, OSError) as exc:  # said to the reads that waited for it too
            for i in mine:
                part.failures[i] = fill_failure(exc)
            raise
        finally:
            for i in mine:
                part.flights.pop(i).set()
        for flight in theirs:
            await flight.wait()
        absent = [i for i in indexes if not part.present[i]]
        if absent:
            entry = part.blob.table.entries[absent[0]]
            why = part.failures.get(absent[0])
            raise FetchError(f"chunk {entry.sha256.hex()[:16]} of layer {part.hex[:16]}",
                             "the fill another read started failed" + (f": {why}" if why else ""))

    async def _bring(self, part: PartialBlob, indexes: list[int]) -> None:
        """Into the file: chunks a file from before holds already (checked),
        the node's other copies, then the store's in runs of neighbours."""
        entries = part.blob.table.entries
        writer = part.writer
        if writer is None or part.released:
            raise FetchError(f"layer {part.hex[:16]}", "it is no longer mounted")
        if part.may_hold:
            found = await trio.to_thread.run_sync(held_in_file, writer, entries, indexes)
            self._present(part, found)
            indexes = [i for i in indexes if not part.present[i]]
        at: dict[bytes, list[int]] = {}  # a chunk twice in the blob is written twice
        for i in indexes:
            at.setdefault(entries[i].sha256, []).append(i)

        def sink(entry: ChunkEntry, data: bytes | memoryview) -> None:
            for i in at[entry.sha256]:  # worker thread: written, then counted present
                self._write(writer, data, entries[i].blob_offset)
            self._present(part, at[entry.sha256])

        await fill_chunks(self.fetcher, [entries[ix[0]] for ix in at.values()], sink)

    def _write(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        """Worker thread: :func:`write_through`; on a full file system, the
        files of layers no mount uses go, then what ``make_room`` frees, and
        the write is tried again (then the OSError: the read fails)."""
        for attempt in range(NO_SPACE_RETRIES + 1):
            try:
                write_through(fd, data, offset)
                return
            except OSError as exc:
                if exc.errno not in NO_SPACE or attempt == NO_SPACE_RETRIES:
                    raise
                unused = trim_files(self.dir, 0, frozenset(self.by_hex) | self._marked())
                if not unused and not self.make_room(max(2 * len(data), 16 << 20)):
                    raise

    def _present(self, part: PartialBlob, indexes: list[int]) -> None:
        """Entries now checked in the file; a complete file's mark goes."""
        for i in indexes:
            if not part.present[i]:
                part.present[i] = 1
                part.missing -= 1
        if part.missing == 0 and part.writer is not None:
            fanotify.unmark(self.group, part.writer)


def unguarded_layers(root: Path, stale_points: list[str]) -> dict[str, list[tuple[int, int]]]:
    """At a start that found no keeper and no group: the layers (hex) a
    crashed daemon had mounted over a partial file, each with the file's
    holes then. Their group went with the daemon and its keeper (both
    killed), and with it the file's mark: since then their mounts read the
    holes as zeros (:func:`reads_holes` says whether a hole is layer data)."""
    found = {}
    for point in map(Path, stale_points):
        if point.parent != root / "layers":
            continue
        try:
            fd = os.open(root / "blobs" / "partial" / point.name, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            found[point.name] = holes_of(fd)
        finally:
            os.close(fd)
    return found


def holes_of(fd: int) -> list[tuple[int, int]]:
    """The file's holes, ``(start, end)``."""
    size, out, at = os.fstat(fd).st_size, [], 0
    while at < size:
        hole = os.lseek(fd, at, os.SEEK_HOLE)
        if hole >= size:
            break
        try:
            at = os.lseek(fd, hole, os.SEEK_DATA)
        except OSError:  # ENXIO: a hole to the end
            at = size
        out.append((hole, at))
    return out


def reads_holes(blob: BlobFile, holes: list[tuple[int, int]]) -> bool:
    """Whether a chunk of ``blob`` lies (partly) in one of ``holes``: a
    read of it there got zeros (gaps between chunks are no data)."""
    entries = blob.table.entries
    return any(entries[i].blob_offset < end and start < entries[i].blob_offset + entries[i].length
               for start, end in holes for i in blob.span(start, end))


def open_partial(path: Path, size: int) -> tuple[int, bool]:
    """Worker thread: the partial file at ``path`` open read-write (before
    its mark, if it has none: then its writes raise no event), of ``size``
    bytes; whether it is new. A file that is not a regular file of root's,
    or of another size, is replaced by a new one."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == 0 and st.st_size == size:
            os.utime(fd)  # its last use, for the bound's order
            return fd, False
        os.close(fd)
        path.unlink()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd, True


def write_through(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Worker thread: ``data`` at ``offset``, on the disk and out of the page
    cache: the mount reads the file with O_DIRECT into its own cache (the
    bytes are cached once), and a read need not wait for their writeback."""
    write_at(fd, data, offset)
    if _libc.sync_file_range(fd, offset, len(data), SYNC_RANGE_ALL) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    os.posix_fadvise(fd, offset, len(data), os.POSIX_FADV_DONTNEED)


def read_if_elf(fd: int, offset: int, length: int) -> bytes | None:
    """Worker thread: the ``length`` bytes at ``offset`` if they start an ELF
    file (its magic read first), else None."""
    return os.pread(fd, length, offset) if is_elf(os.pread(fd, 4, offset)) else None


def held_in_file(fd: int, entries: list[ChunkEntry], indexes: list[int]) -> list[int]:
    """Worker thread: the entries a file from before holds, checked against
    their sha256 (a hole is not looked at)."""
    found = []
    for i in indexes:
        entry = entries[i]
        try:
            data_at = os.lseek(fd, entry.blob_offset, os.SEEK_DATA)
        except OSError:  # ENXIO: holes to the end
            continue
        if data_at >= entry.blob_offset + entry.length:
            continue
        data = os.pread(fd, entry.length, entry.blob_offset)
        if len(data) == entry.length and hashlib.sha256(data).digest() == entry.sha256:
            found.append(i)
    return found


def fill_failure(exc: FetchError | OSError) -> str:
    """Why a fill failed, in the words a read that waited for it repeats."""
    if isinstance(exc, FetchError):
        return str(exc.args[-1]) if exc.args else str(exc)
    return exc.strerror or str(exc)
