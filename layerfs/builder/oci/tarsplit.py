"""Tar-split records: an image layer's tar rebuilt byte for byte on export.

At import, :class:`TarSplitRecorder` sees the layer's uncompressed tar stream
go by (teed by the importer) and keeps everything of it that is not file
content: header blocks, pax and GNU extension blocks, padding, the
end-of-archive blocks and any bytes after them (the *raw* stream), and, for
each regular file whose content the layer stores, where in the raw stream its
content goes and which file it is. Once the layer's tree is final,
:meth:`TarSplitRecorder.record` serializes that as one blob (format below),
stored beside the meta image and named by the layer manifest's optional
``tar_split`` field. At export, :func:`write_tar_from_record` writes the raw
stream with the file contents (read from the store through the chunk table,
every chunk sha256-checked) put back in, and the exporter checks the tar's
sha256 against the recorded diff_id.

The blob (all integers unsigned little-endian)::

    magic "LFTSPLT1" | u64 index_len | index (zstd frame, index_len bytes)
                                     | raw stream (zstd frame, the rest)

    index:  u64 raw_size | u64 tar_size | u64 count
            | u64 entries | u64 hard_links | u64 whiteouts | u64 opaque_dirs
            | count × content
    content: u8 kind | u64 raw_offset | u64 size | by kind:
        1 FILE    u32 n | n bytes: the path in the layer's tree ("a/b", "" never)
        2 CHUNKS  u32 n | n × i64: the content's chunk addresses in the layer's blob
                  (blocks; -1 a hole), for a file the tree no longer holds at its
                  name (a later entry of the tar replaced it)
        3 INLINE  size bytes: the content itself, for such a file kept inline

The tar is the raw stream with each content's ``size`` bytes inserted at
``raw_offset`` (non-decreasing, at most ``raw_size``); ``tar_size`` is
``raw_size`` plus the contents. Read back, the record is hostile input: the
blob's digest is checked first, then every length against the bounds below
and the layer (a FILE must name a regular file of exactly ``size`` bytes;
CHUNKS must have one address per chunk, inside the blob), and the raw stream
must end exactly at ``raw_size``. A layer whose record would exceed the
bounds gets none (its export rebuilds the tar from the tree); the recorder
stops holding anything as soon as it knows (so a hostile tar costs it at most
:data:`~layerfs.manifest.MAX_TAR_SPLIT` of memory).
"""

from __future__ import annotations

import io
import logging
import stat
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import BinaryIO

import zstandard

from layerfs.errors import IntegrityError
from layerfs.formats.erofs import BLOCK
from layerfs.manifest import MAX_TAR_SPLIT, TarSplitRef
from layerfs.store.base import Store, sha256_digest
from layerfs.tree import HOLE, FileTree, FsNode

from .layertar import FETCH_WORKERS, BlobRanges, ChunkFeed, TarStats, _PieceReader, file_pieces

log = logging.getLogger(__name__)

MAGIC = b"LFTSPLT1"
FILE, CHUNKS, INLINE = 1, 2, 3
MAX_RAW = 1 << 30  # raw (non-content) bytes of one layer's tar
MAX_INDEX = 256 << 20  # the decompressed index
MAX_PATH = 1 << 20  # one FILE path (tar names are bounded by the pax header bound)
MAX_INLINE = BLOCK  # an INLINE content (inline files are smaller than a block)
MAX_CHUNKS = 1 << 32  # addresses of one CHUNKS content
ZSTD_LEVEL = 9
COPY = 1 << 20  # bytes per read or write, and raw bytes per compressor call
HEADER = struct.Struct("<QQQQQQQ")
CONTENT = struct.Struct("<BQQ")
COUNT = struct.Struct("<I")


@dataclass
class _Content:
    raw_offset: int
    size: int
    parts: list[bytes]
    node: FsNode


@dataclass
class TarSplitRecorder:
    """Sees one layer's tar stream go by (:meth:`feed`) and what the tar reader
    makes of it (:meth:`member`, :meth:`content`); ``dropped`` says why no
    record will be made, if so."""

    pos: int = 0  # stream bytes seen
    mark: int = 0  # stream offset of pending[0]
    pending: bytearray = field(default_factory=bytearray)
    raw_size: int = 0
    contents: list[_Content] = field(default_factory=list)
    stats: TarStats = field(default_factory=TarStats)
    dropped: str = ""
    _packer: zstandard.ZstdCompressionObj = field(
        default_factory=lambda: zstandard.ZstdCompressor(level=ZSTD_LEVEL).compressobj())
    _packed: list[bytes] = field(default_factory=list)
    _unpacked: bytearray = field(default_factory=bytearray)  # raw bytes for the compressor
    _packed_size: int = 0

    def feed(self, data: bytes) -> None:
        """The next bytes of the stream, as the tar reader reads them."""
        start, self.pos = self.pos, self.pos + len(data)
        if self.dropped or self.pos <= self.mark:
            return
        self.pending += data[max(0, self.mark - start):]

    def member(self, offset: int, kind: str = "") -> None:
        """A member's headers start at ``offset``: all before it is classified."""
        self.stats.entries += 1
        if kind:
            setattr(self.stats, kind, getattr(self.stats, kind) + 1)
        self._raw_until(offset)

    def content(self, offset: int, size: int, parts: list[bytes], node: FsNode) -> None:
        """The ``size`` bytes at stream ``offset`` are the content of ``node``,
        added to the tree at ``parts``; they are not kept."""
        if self.dropped:
            return
        if not self.mark <= offset <= self.pos:
            self._drop(f"content at byte {offset} out of order")
            return
        self._raw_until(offset)
        self.contents.append(_Content(self.raw_size, size, parts, node))
        self.stats.file_bytes += size
        end = offset + size
        del self.pending[: max(0, min(end, self.pos) - self.mark)]
        self.mark = end

    def _raw_until(self, offset: int) -> None:
        if self.dropped or offset <= self.mark:
            return
        take = min(offset, self.pos) - self.mark
        self._raw(self.pending[:take])
        del self.pending[:take]
        self.mark += take

    def _raw(self, data: bytes | bytearray) -> None:
        self.raw_size += len(data)
        if self.raw_size > MAX_RAW:
            self._drop(f"more than {MAX_RAW >> 20} MiB of tar headers")
            return
        self._unpacked += data
        if len(self._unpacked) >= COPY:
            self._packed.append(self._packer.compress(bytes(self._unpacked)))
            self._packed_size += len(self._packed[-1])
            self._unpacked.clear()
            if self._packed_size > MAX_TAR_SPLIT:  # what is held in memory meanwhile
                self._drop(f"a record of more than {MAX_TAR_SPLIT >> 20} MiB")

    def _drop(self, why: str) -> None:
        self.dropped = why
        self.pending.clear()
        self.contents.clear()
        self._packed.clear()
        self._unpacked.clear()

    def finish(self) -> None:
        """The stream has ended: what is pending is raw."""
        self._raw_until(self.pos)
        if not self.dropped and self.pos != self.raw_size + self.stats.file_bytes:
            self._drop("the stream and its contents do not add up")

    def record(self, tree: FileTree, diff_id: str) -> bytes | None:
        """The record blob for the finished layer ``tree`` (its files' chunks
        placed), or None if it cannot be made."""
        if self.dropped:
            log.info("no tar-split record for %s: %s", diff_id, self.dropped)
            return None
        index = io.BytesIO()
        s = self.stats
        index.write(HEADER.pack(self.raw_size, self.pos, len(self.contents), s.entries,
                                s.hard_links, s.whiteouts, s.opaque_dirs))
        for item in self.contents:
            index.write(_content_bytes(item, tree))
        if index.tell() > MAX_INDEX:
            log.info("no tar-split record for %s: an index of %d bytes", diff_id, index.tell())
            return None
        packed_index = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(index.getvalue())
        raw = b"".join([*self._packed, self._packer.compress(bytes(self._unpacked)),
                        self._packer.flush()])
        blob = b"".join([MAGIC, struct.pack("<Q", len(packed_index)), packed_index, raw])
        if len(blob) > MAX_TAR_SPLIT:
            log.info("no tar-split record for %s: %d bytes", diff_id, len(blob))
            return None
        return blob


def _content_bytes(item: _Content, tree: FileTree) -> bytes:
    head = (item.raw_offset, item.size)
    path = b"/".join(item.parts)
    if tree.lookup(item.parts) is item.node and item.parts and len(path) <= MAX_PATH:
        return CONTENT.pack(FILE, *head) + COUNT.pack(len(path)) + path
    if item.node.inline is not None:
        return CONTENT.pack(INLINE, *head) + item.node.inline
    chunks = item.node.chunks
    return (CONTENT.pack(CHUNKS, *head) + COUNT.pack(len(chunks))
            + struct.pack(f"<{len(chunks)}q", *chunks))


def tar_split_ref(blob: bytes, diff_id: str, recorder: TarSplitRecorder) -> TarSplitRef:
    return TarSplitRef(sha256_digest(blob), len(blob), diff_id, recorder.pos)


class TeeReader:
    """Passes reads through, showing each piece to ``see``."""

    def __init__(self, raw: BinaryIO, see: Callable[[bytes], None]) -> None:
        self.raw, self.see = raw, see

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        if data:
            self.see(data)
        return data

    def close(self) -> None:
        self.raw.close()


# -- reading a record back --

@dataclass(frozen=True)
class RecordedContent:
    """Where one content goes and the file it is (a path, or the file itself)."""

    raw_offset: int
    size: int
    node: FsNode


@dataclass
class TarSplit:
    """A parsed, checked record: its contents and the raw stream's reader."""

    raw_size: int
    tar_size: int
    contents: list[RecordedContent]
    stats: TarStats
    raw: BinaryIO


class _Index:
    """A bounds-checked reader over the decompressed index."""

    def __init__(self, data: bytes, what: str) -> None:
        self.data, self.pos, self.what = data, 0, what

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise IntegrityError(self.what, "index ends early")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: struct.Struct) -> tuple[int, ...]:
        return fmt.unpack(self.take(fmt.size))

    def done(self) -> bool:
        return self.pos == len(self.data)


def read_record(store: Store, ref: TarSplitRef, tree: FileTree, chunk_size: int,
                what: str) -> TarSplit:
    """The record ``ref`` names, fetched, digest-checked and parsed against the
    layer's ``tree``; IntegrityError (naming ``what``) for anything amiss."""
    what = f"tar-split record of {what}"
    try:
        blob = store.get_blob(ref.digest)
    except IntegrityError:
        raise IntegrityError(what, f"content does not match its digest {ref.digest}") from None
    if len(blob) != ref.size:
        raise IntegrityError(what, f"{len(blob)} bytes, its manifest says {ref.size}")
    if blob[:8] != MAGIC or len(blob) < 16:
        raise IntegrityError(what, "not a tar-split record")
    (index_len,) = struct.unpack("<Q", blob[8:16])
    if index_len > len(blob) - 16:
        raise IntegrityError(what, "index runs past the record's end")
    index = _Index(_decompress(blob[16 : 16 + index_len], MAX_INDEX, what), what)
    raw_size, tar_size, count, *counts = index.unpack(HEADER)
    if raw_size > MAX_RAW or tar_size != ref.tar_size or tar_size < raw_size:
        raise IntegrityError(what, "sizes out of range")
    contents = _read_contents(index, count, raw_size, tree, chunk_size)
    if not index.done():
        raise IntegrityError(what, "bytes after the index")
    if raw_size + sum(c.size for c in contents) != tar_size:
        raise IntegrityError(what, "contents and raw bytes do not add up to the tar")
    entries, hard_links, whiteouts, opaque_dirs = counts
    stats = TarStats(entries, tar_size - raw_size, hard_links, whiteouts, opaque_dirs)
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob[16 + index_len :]),
                                                     read_across_frames=True)
    return TarSplit(raw_size, tar_size, contents, stats, raw)  # type: ignore[arg-type]


def _decompress(data: bytes, limit: int, what: str) -> bytes:
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data))
    try:
        out = reader.read(limit + 1)
    except zstandard.ZstdError as exc:
        raise IntegrityError(what, f"index does not decompress ({exc})") from None
    if len(out) > limit:
        raise IntegrityError(what, f"index larger than {limit >> 20} MiB")
    return out


def _read_contents(index: _Index, count: int, raw_size: int, tree: FileTree,
                   chunk_size: int) -> list[RecordedContent]:
    what = index.what
    if count > (len(index.data) - index.pos) // CONTENT.size:
        raise IntegrityError(what, f"{count} contents in a smaller index")
    out: list[RecordedContent] = []
    last = 0
    for i in range(count):
        kind, raw_offset, size = index.unpack(CONTENT)
        if not last <= raw_offset <= raw_size:
            raise IntegrityError(what, f"content {i}: raw offset {raw_offset} out of order")
        last = raw_offset
        out.append(RecordedContent(raw_offset, size, _content_node(index, kind, size, tree,
                                                                   chunk_size, i)))
    return out


def _content_node(index: _Index, kind: int, size: int, tree: FileTree, chunk_size: int,
                  i: int) -> FsNode:
    what = index.what
    if kind == FILE:
        (n,) = index.unpack(COUNT)
        if not 0 < n <= MAX_PATH:
            raise IntegrityError(what, f"content {i}: a path of {n} bytes")
        path = index.take(n)
        node = tree.lookup(path.split(b"/"))
        if node is None or not stat.S_ISREG(node.mode) or node.size != size:
            shown = path[:200].decode("utf-8", "replace")
            raise IntegrityError(what, f"content {i}: /{shown} is not a regular file of "
                                 f"{size} bytes in the layer")
        return node
    if kind == INLINE:
        if size > MAX_INLINE:
            raise IntegrityError(what, f"content {i}: {size} bytes inline")
        return FsNode(mode=stat.S_IFREG, size=size, inline=index.take(size))
    if kind == CHUNKS:
        (n,) = index.unpack(COUNT)
        if n != -(-size // chunk_size) or n > MAX_CHUNKS:
            raise IntegrityError(what, f"content {i}: {n} chunks for {size} bytes")
        chunks = list(struct.unpack(f"<{n}q", index.take(8 * n)))
        if any(c < 0 and c != HOLE for c in chunks):
            raise IntegrityError(what, f"content {i}: a negative chunk address")
        return FsNode(mode=stat.S_IFREG, size=size, chunks=chunks)
    raise IntegrityError(what, f"content {i}: unknown kind {kind}")


# -- writing the tar --

def write_tar_from_record(store: Store, split: TarSplit, ranges: BlobRanges, chunk_size: int,
                          out: BinaryIO, what: str) -> None:
    """The recorded tar to ``out``: raw bytes and contents in their order."""
    pieces = [file_pieces(c.node, ranges, chunk_size) if c.node.inline is None else []
              for c in split.contents]
    entries = [p.entry for file in pieces for p in file if p.entry is not None]
    raw = _RawReader(split.raw, split.raw_size, f"tar-split record of {what}")
    with ThreadPoolExecutor(FETCH_WORKERS) as pool:
        feed = ChunkFeed(store, entries, pool)
        try:
            for content, file in zip(split.contents, pieces, strict=True):
                raw.copy_to(content.raw_offset, out)
                if content.node.inline is not None:
                    out.write(content.node.inline)
                else:
                    _copy(_PieceReader(file, feed), content.size, out)
            raw.copy_to(split.raw_size, out)
            raw.check_end()
        finally:
            feed.close()


def _copy(reader: _PieceReader, size: int, out: BinaryIO) -> None:
    while size:
        data = reader.read(min(size, COPY))
        out.write(data)
        size -= len(data)


class _RawReader:
    """The raw stream, handed out up to given offsets; it must hold exactly ``size`` bytes."""

    def __init__(self, stream: BinaryIO, size: int, what: str) -> None:
        self.stream, self.size, self.pos, self.what = stream, size, 0, what

    def copy_to(self, offset: int, out: BinaryIO) -> None:
        while self.pos < offset:
            data = self._read(min(offset - self.pos, COPY))
            if not data:
                raise IntegrityError(self.what, f"raw stream ends at byte {self.pos}, "
                                     f"not {self.size}")
            out.write(data)
            self.pos += len(data)

    def check_end(self) -> None:
        if self._read(1):
            raise IntegrityError(self.what, f"raw stream longer than {self.size} bytes")

    def _read(self, n: int) -> bytes:
        try:
            return self.stream.read(n)
        except zstandard.ZstdError as exc:
            raise IntegrityError(self.what, f"raw stream does not decompress ({exc})") from None
