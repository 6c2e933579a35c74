"""Block disks on the node: sealed LSMT chains read lazily, and writable disks.

A :class:`SealedChain` is a stack of sealed layers (top first), each read
through its lazy blob file; the topmost layer that maps a sector wins, and
unmapped or zeroed sectors read as zeros. A :class:`WritableDisk` is an LSMT
writable layer over an optional chain: ``ROOT/disks/<id>/data`` (a header,
then every write appended) and ``ROOT/disks/<id>/index`` (a header, then an
append-only log of 16-byte mappings; later entries win). Reads look at the
writable layer, then the chain, then zeros. Writes of any size and alignment
work: partial sectors are read, merged and written whole.

Crash safety: a write appends its data, then its index entry; ``fsync``
syncs the data file, then the index file. On open, the log is read up to its
first entry that is torn, out of range or points past the data file, and cut
there: a crash loses at most writes that were not flushed, and a torn entry is
never used.

A write that cannot be stored whole (ROOT full: a short write or ENOSPC, or
EIO) fails with that errno and leaves no trace: both files are cut back to
where they ended before it, so no index entry of it survives to point at data
a later write overwrites. A failed ``fsync``, or a failed cut, marks the disk
failed: every later write and ``fsync`` answers EIO, since Linux forgets a
writeback error once it has reported it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import trio

from ...errors import UsageError
from ...formats import lsmt
from ..reads.blobfiles import BlobFile, Buffer, joined, zeros

log = logging.getLogger(__name__)
SECTOR = lsmt.SECTOR
DATA_START = lsmt.HT_SPACE // SECTOR  # first data sector of the data file


class SealedLayer:
    """One sealed layer: its blob file and its index, checked on load."""

    def __init__(self, name: str, blob: BlobFile, mappings: list[lsmt.Mapping],
                 virtual_size: int) -> None:
        self.name = name
        self.blob = blob
        self.mappings = mappings
        self.virtual_size = virtual_size

    @classmethod
    async def load(cls, name: str, blob: BlobFile) -> SealedLayer:
        size = blob.size
        if size < 2 * lsmt.HT_SPACE:
            raise lsmt.LsmtError(name, "file too small for a header and a trailer")
        raw = await blob.read(size - lsmt.HT_SPACE, lsmt.HT_SPACE)
        trailer = lsmt.HeaderTrailer.unpack(raw, f"{name} trailer")
        if trailer.flags & lsmt.FLAG_HEADER or not trailer.flags & lsmt.FLAG_SEALED:
            raise lsmt.LsmtError(name, "trailer flags do not say sealed")
        end = trailer.index_offset + 16 * trailer.index_size
        if trailer.index_offset < lsmt.HT_SPACE or end > size - lsmt.HT_SPACE:
            raise lsmt.LsmtError(name, "index outside the file")
        if trailer.virtual_size % SECTOR:
            raise lsmt.LsmtError(name, "disk size is not a multiple of 512")
        index = await blob.read(trailer.index_offset, 16 * trailer.index_size)
        maps = lsmt.parse_index(index, trailer.virtual_size, trailer.index_offset, name)
        return cls(name, blob, maps, trailer.virtual_size)


class SealedChain:
    """Sealed layers stacked top first, read as one disk."""

    def __init__(self, layers: list[SealedLayer]) -> None:
        if len(layers) > lsmt.MAX_LAYERS:
            raise UsageError(f"a disk chain has at most {lsmt.MAX_LAYERS} layers")
        self.layers = layers
        self.map = lsmt.SegmentMap()
        for tag in range(len(layers) - 1, -1, -1):  # bottom first: upper layers win
            for m in layers[tag].mappings:
                self.map.insert(lsmt.Mapping(m.offset, m.length, m.moffset, m.zeroed, tag))

    @property
    def virtual_size(self) -> int:
        return self.layers[0].virtual_size if self.layers else 0

    async def read_parts(self, sector: int, count: int) -> list[Buffer]:
        """The sectors as views into chunks and zeros, ``count * SECTOR`` bytes."""
        parts: list[Buffer] = []
        for start, length, m in self.map.lookup(sector, count):
            if m is None or m.zeroed:
                parts.append(zeros(length * SECTOR))
                continue
            blob = self.layers[m.tag].blob
            got = await blob.read_parts((m.moffset + start - m.offset) * SECTOR, length * SECTOR)
            parts += padded(got, length * SECTOR)
        return parts


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset``, or raise (a short write that cannot
    go on is ENOSPC)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]
        offset += written


def padded(parts: list[Buffer], size: int) -> list[Buffer]:
    """``parts`` followed by the zeros that make them ``size`` bytes long."""
    short = size - sum(len(p) for p in parts)
    return parts + [zeros(short)] if short > 0 else parts


@dataclass
class DiskState:
    id: str
    size: int
    base: str | None = None  # manifest digest of the top sealed layer below
    base_ref: str | None = None
    commit_mark: int = 0  # index log entries already sealed by a commit


class WritableDisk:
    """An LSMT writable layer over an optional sealed chain."""

    def __init__(self, path: Path, state: DiskState, chain: SealedChain | None) -> None:
        self.path = path
        self.state = state
        self.chain = chain
        self.map = lsmt.SegmentMap()
        self.log: list[lsmt.Mapping] = []
        self.data_end = DATA_START
        self.failed: OSError | None = None  # a lost write or fsync: refuse writes from now
        self.lock = trio.Lock()  # orders writes and commits; reads never take it
        self.io = trio.CapacityLimiter(4)
        self.inode = 0  # its file's inode under ROOT/fuse/disks (DiskManager sets it)
        self.pages_current = False  # the kernel's cached pages of its file are its bytes

    @property
    def size(self) -> int:
        return self.state.size

    # -- files (worker threads) --
    @classmethod
    def create(cls, path: Path, state: DiskState) -> None:
        if state.size <= 0 or state.size % SECTOR:
            raise UsageError(f"disk size {state.size} is not a positive multiple of 512")
        path.mkdir(parents=True)
        for name, flags in (("data", lsmt.FLAG_HEADER | lsmt.FLAG_DATA | lsmt.FLAG_SPARSE_RW),
                            ("index", lsmt.FLAG_HEADER)):
            header = lsmt.HeaderTrailer(flags, 0, 0, state.size, lsmt.new_uuid()).pack()
            with open(path / name, "wb") as f:
                f.write(header)
                f.flush()
                os.fsync(f.fileno())
        cls.save_state(path, state)

    @staticmethod
    def save_state(path: Path, state: DiskState) -> None:
        tmp = path / "state.json.tmp"
        tmp.write_text(json.dumps(asdict(state)))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.rename(tmp, path / "state.json")

    @staticmethod
    def load_state(path: Path) -> DiskState:
        return DiskState(**json.loads((path / "state.json").read_text()))

    def open_files(self) -> None:
        """Replay the index log; cut it at the first entry that cannot be trusted."""
        self.data_fd = os.open(self.path / "data", os.O_RDWR)
        self.index_fd = os.open(self.path / "index", os.O_RDWR)
        data_size = os.fstat(self.data_fd).st_size
        self.data_end = max(DATA_START, data_size // SECTOR)
        raw = os.pread(self.index_fd, os.fstat(self.index_fd).st_size, 0)
        lsmt.HeaderTrailer.unpack(raw[: lsmt.HT_SPACE], f"disk {self.state.id} index")
        good = lsmt.HT_SPACE
        limit = self.size // SECTOR
        for pos in range(lsmt.HT_SPACE, len(raw) - 15, 16):
            m = lsmt.Mapping.unpack(raw[pos : pos + 16])
            if (m.length == 0 or m.end > limit or m.moffset < DATA_START
                    or (m.moffset + m.length) * SECTOR > data_size):
                break
            self.log.append(m)
            self.map.insert(m)
            good = pos + 16
        if good != len(raw):
            log.warning("disk %s: index log cut after entry %d (%d bytes torn or invalid)",
                        self.state.id, len(self.log), len(raw) - good)
            os.ftruncate(self.index_fd, good)
        self.state.commit_mark = min(self.state.commit_mark, len(self.log))

    def close_files(self) -> None:
        os.fsync(self.data_fd)
        os.fsync(self.index_fd)
        os.close(self.data_fd)
        os.close(self.index_fd)

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise OSError(errno.EIO, f"disk {self.state.id} failed earlier: {self.failed}")

    def _append(self, sector: int, data: bytes) -> list[lsmt.Mapping]:
        """Store ``data`` and its index entries whole, or raise and store nothing."""
        self._check_usable()
        moffset = self.data_end
        maps = lsmt.split_extent(sector, len(data) // SECTOR, moffset)
        pos = lsmt.HT_SPACE + 16 * len(self.log)
        try:
            pwrite_all(self.data_fd, data, moffset * SECTOR)
            pwrite_all(self.index_fd, b"".join(m.pack() for m in maps), pos)
        except OSError as exc:
            log.warning("disk %s: write of %d bytes failed: %s", self.state.id, len(data), exc)
            self._cut_back(moffset * SECTOR, pos)
            raise
        return maps

    def _cut_back(self, data_size: int, index_size: int) -> None:
        """Drop what a failed write left in either file (truncating needs no space)."""
        try:
            os.ftruncate(self.index_fd, index_size)
            os.ftruncate(self.data_fd, data_size)
        except OSError as exc:
            self.failed = exc
            log.error("disk %s: cannot undo a failed write (%s); refusing writes", self.state.id,
                      exc)

    def sync(self) -> None:
        self._check_usable()
        try:
            os.fsync(self.data_fd)
            os.fsync(self.index_fd)
        except OSError as exc:
            self.failed = exc
            log.error("disk %s: fsync failed (%s); refusing writes", self.state.id, exc)
            raise OSError(errno.EIO, f"fsync of disk {self.state.id} failed: {exc}") from exc

    # -- I/O (trio) --
    async def read(self, off: int, size: int) -> Buffer:
        end = min(off + size, self.size)
        if off >= end:
            return b""
        first, last = off // SECTOR, -(-end // SECTOR)
        raw = joined(await self.read_parts(first, last - first))
        if off == first * SECTOR and end == last * SECTOR:
            return raw
        return memoryview(raw)[off - first * SECTOR : end - first * SECTOR]

    async def read_parts(self, sector: int, count: int) -> list[Buffer]:
        """The sectors as buffers, in order: the writable layer's, then the
        chain's (views into its chunks), then zeros."""
        parts: list[Buffer] = []
        for start, length, m in self.map.lookup(sector, count):
            data: list[Buffer]
            if m is not None:
                fpos = (m.moffset + start - m.offset) * SECTOR
                data = [await trio.to_thread.run_sync(os.pread, self.data_fd, length * SECTOR,
                                                      fpos, limiter=self.io)]
            elif self.chain is not None and start < self.chain.virtual_size // SECTOR:
                n = min(length, self.chain.virtual_size // SECTOR - start)
                data = await self.chain.read_parts(start, n)
            else:
                data = []
            parts += padded(data, length * SECTOR)
        return parts

    def kernel_open(self) -> bool:
        """An open of its file through FUSE: whether the kernel may keep what
        it caches of the file (``FOPEN_KEEP_CACHE``). The first open since the
        disk was made or restored drops it (an earlier disk of the same id had
        the same inode), as does the first after the daemon wrote to the disk
        other than through FUSE; its bytes change in no other way."""
        keep, self.pages_current = self.pages_current, True
        return keep

    async def write(self, off: int, buf: bytes, through_kernel: bool = False) -> int:
        """``buf`` at ``off``; ``through_kernel``: a FUSE write (the kernel's
        cached pages of the file have the bytes already)."""
        if not through_kernel:
            self.pages_current = False
        if off + len(buf) > self.size:
            raise OSError(27, "write past the end of the disk")  # EFBIG
        if not buf:
            return 0
        async with self.lock:
            first, last = off // SECTOR, -(-(off + len(buf)) // SECTOR)
            if off % SECTOR or (off + len(buf)) % SECTOR:
                whole = bytearray(joined(await self.read_parts(first, last - first)))
                whole[off - first * SECTOR : off - first * SECTOR + len(buf)] = buf
                data = bytes(whole)
            else:
                data = bytes(buf)
            maps = await trio.to_thread.run_sync(self._append, first, data, limiter=self.io)
            self.data_end += len(data) // SECTOR
            for m in maps:
                self.log.append(m)
                self.map.insert(m)
        return len(buf)

    async def flush(self) -> None:
        async with self.lock:
            await trio.to_thread.run_sync(self.sync, limiter=self.io)

    def changes_since_commit(self) -> list[lsmt.Mapping]:
        """The writes since the last commit, merged (later wins), sorted."""
        merged = lsmt.SegmentMap()
        for m in self.log[self.state.commit_mark :]:
            merged.insert(m)
        return list(merged.items)
