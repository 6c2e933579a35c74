"""A layerfs layer's tree as an OCI layer tar, streamed.

:func:`write_layer_tar` walks a :class:`~layerfs.tree.FileTree` (read from a
layer's meta image by :mod:`layerfs.formats.erofsread`) depth first, names
sorted, parents before children, and writes one PAX tar entry per name:
regular files (their bytes read through the layer's chunk table, every chunk
sha256-checked, a bounded number of range reads ahead), directories,
symlinks, character and block devices, fifos, and a tar hard link for every
further name of a hard-linked inode. Owners, modes (setuid, setgid and sticky
bits included), nanosecond mtimes (PAX ``mtime``) and xattrs (PAX
``SCHILY.xattr.*``) are kept as stored.

Overlayfs markers become OCI ones: a whiteout (a 0:0 character device) is an
empty ``.wh.NAME``, a directory with ``trusted.overlay.opaque=y`` is followed
by ``DIR/.wh..wh..opq``. Other ``trusted.overlay.*`` xattrs are overlayfs's
own state, which a sandbox never sees, and are not exported. Sockets cannot
be held by a tar and are skipped (counted).

:func:`fold_layers` merges layers (bottom first) into one tree the way
overlayfs shows them: upper entries replace lower ones, directories merge
unless the upper one is opaque, whiteouts delete.
"""

from __future__ import annotations

import bisect
import io
import stat
import tarfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import BinaryIO

from layerfs.chunks import fetch_run, pack_runs
from layerfs.errors import IntegrityError
from layerfs.formats.chunktable import ChunkEntry, ChunkTable
from layerfs.formats.erofs import BLOCK
from layerfs.store.base import Store
from layerfs.tree import HOLE, FileTree, FsNode

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
OPAQUE_XATTR = b"trusted.overlay.opaque"
OVERLAY_XATTRS = b"trusted.overlay."
RUNS_AHEAD = 8  # range reads in flight or decoded and waiting, per layer
FETCH_WORKERS = 8


def is_whiteout(node: FsNode) -> bool:
    return stat.S_ISCHR(node.mode) and node.rdev_major == 0 and node.rdev_minor == 0


def is_opaque(node: FsNode) -> bool:
    return node.is_dir and node.xattrs.get(OPAQUE_XATTR) == b"y"


@dataclass
class TarStats:
    """What one layer tar holds."""

    entries: int = 0
    file_bytes: int = 0
    hard_links: int = 0
    whiteouts: int = 0
    opaque_dirs: int = 0
    skipped_sockets: int = 0


@dataclass(frozen=True)
class _Piece:
    """A part of a file's data: ``length`` bytes of ``entry`` from ``start``,
    or zeros where ``entry`` is None (a hole, or blob bytes no chunk covers)."""

    entry: ChunkEntry | None
    start: int
    length: int


class BlobRanges:
    """Maps ranges of one layer's logical data blob onto its chunk table."""

    def __init__(self, table: ChunkTable) -> None:
        self.table = table
        self.offsets = [e.blob_offset for e in table.entries]

    def pieces(self, offset: int, length: int) -> Iterator[_Piece]:
        end = offset + length
        if end > self.table.blob_size:
            raise IntegrityError("chunk table", f"file data at blob offset {offset} lies past "
                                 f"the blob's end ({self.table.blob_size})")
        pos = offset
        while pos < end:
            i = bisect.bisect_right(self.offsets, pos) - 1
            entry = self.table.entries[i] if i >= 0 else None
            if entry is not None and pos < entry.blob_offset + entry.length:
                n = min(end, entry.blob_offset + entry.length) - pos
                yield _Piece(entry, pos - entry.blob_offset, n)
            else:
                following = self.offsets[i + 1] if i + 1 < len(self.offsets) else end
                n = min(end, following) - pos
                yield _Piece(None, 0, n)
            pos += n


def file_pieces(node: FsNode, ranges: BlobRanges, chunk_size: int) -> list[_Piece]:
    """Where the bytes of a chunk-based regular file are, chunk by chunk."""
    out: list[_Piece] = []
    for i, addr in enumerate(node.chunks):
        length = min(chunk_size, node.size - i * chunk_size)
        if addr == HOLE:
            out.append(_Piece(None, 0, length))
        else:
            out.extend(ranges.pieces(addr * BLOCK, length))
    return out


class ChunkFeed:
    """Fetches and verifies chunks in the order they are asked for, at most
    :data:`RUNS_AHEAD` runs (range reads) ahead, so a layer is never whole in
    memory. ``next(entry)`` must be called in the order of ``entries``."""

    def __init__(self, store: Store, entries: list[ChunkEntry], pool: ThreadPoolExecutor) -> None:
        self.store = store
        self.runs = pack_runs(entries)
        self.pool = pool
        self.pending: deque[Future[list[tuple[ChunkEntry, bytes]]]] = deque()
        self.ready: deque[tuple[ChunkEntry, bytes]] = deque()
        self._fill()

    def _fetch(self, run: list[ChunkEntry]) -> list[tuple[ChunkEntry, bytes]]:
        out = []
        for entry, result in zip(run, fetch_run(self.store, run), strict=True):
            if isinstance(result, IntegrityError):
                raise result
            out.append((entry, result))
        return out

    def _fill(self) -> None:
        while len(self.pending) < RUNS_AHEAD:
            run = next(self.runs, None)
            if run is None:
                return
            self.pending.append(self.pool.submit(self._fetch, run))

    def next(self, entry: ChunkEntry) -> bytes:
        if not self.ready:
            self.ready.extend(self.pending.popleft().result())
            self._fill()
        got, data = self.ready.popleft()
        assert got is entry, "chunks asked for out of order"
        return data

    def close(self) -> None:
        for fut in self.pending:
            fut.cancel()


class _PieceReader:
    """A file object over a file's pieces, for ``tarfile.addfile``: each
    ``read(n)`` returns exactly ``n`` bytes until the file ends."""

    def __init__(self, pieces: list[_Piece], feed: ChunkFeed) -> None:
        self.pieces = deque(pieces)
        self.feed = feed
        self.current = memoryview(b"")

    def _next_piece(self) -> bool:
        if not self.pieces:
            return False
        piece = self.pieces.popleft()
        if piece.entry is None:
            self.current = memoryview(bytes(piece.length))
        else:
            data = memoryview(self.feed.next(piece.entry))
            self.current = data[piece.start : piece.start + piece.length]
        return True

    def read(self, n: int = -1) -> bytes:
        parts = []
        want = n
        while want != 0:
            if not self.current and not self._next_piece():
                break
            take = len(self.current) if want < 0 else min(want, len(self.current))
            parts.append(self.current[:take])
            self.current = self.current[take:]
            if want > 0:
                want -= take
        return b"".join(parts)


@dataclass
class LayerTree:
    """A tree to write as one layer tar, and where its files' bytes are:
    ``source_of`` gives each regular file's blob ranges and chunk size."""

    tree: FileTree
    source_of: Callable[[FsNode], tuple[BlobRanges, int]]
    stats: TarStats = field(default_factory=TarStats)


def _walk(tree: FileTree) -> Iterator[tuple[str, FsNode]]:
    """(tar name, node) depth first, names sorted, parents before children."""
    stack: list[tuple[str, FsNode]] = [(".", tree.root)]
    while stack:
        path, node = stack.pop()
        yield path, node
        if node.children:
            prefix = "" if path == "." else path + "/"
            for name in sorted(node.children, reverse=True):
                text = name.decode("utf-8", "surrogateescape")
                stack.append((prefix + text, node.children[name]))


def pax_time(seconds: int, nanoseconds: int) -> str:
    """A PAX time value: ``seconds + nanoseconds / 10**9`` as a decimal (the
    sign applies to the whole number, so -1 s + 0.25 s is ``-0.750000000``)."""
    total = seconds * 10**9 + nanoseconds
    sign = "-" if total < 0 else ""
    whole, frac = divmod(abs(total), 10**9)
    return f"{sign}{whole}.{frac:09d}"


def _header(path: str, node: FsNode) -> tarfile.TarInfo:
    info = tarfile.TarInfo(path)
    info.mode = node.mode & 0o7777
    info.uid, info.gid = node.uid, node.gid
    info.uname = info.gname = ""
    info.mtime = node.mtime
    pax = {"mtime": pax_time(node.mtime, node.mtime_ns)}
    for name, value in sorted(node.xattrs.items()):
        if name.startswith(OVERLAY_XATTRS):
            continue
        key = "SCHILY.xattr." + name.decode("utf-8", "surrogateescape")
        pax[key] = value.decode("utf-8", "surrogateescape")
    info.pax_headers = pax
    return info


def _marker(path: str, node: FsNode) -> tarfile.TarInfo:
    """An empty regular file standing for a whiteout or an opaque directory."""
    info = tarfile.TarInfo(path)
    info.mode, info.mtime = 0, node.mtime
    info.uname = info.gname = ""
    return info


class _TarWriter:
    def __init__(self, tar: tarfile.TarFile, layer: LayerTree, feed_for: Callable) -> None:
        self.tar = tar
        self.layer = layer
        self.stats = layer.stats
        self.feed_for = feed_for
        self.first_name: dict[int, str] = {}

    def write(self) -> None:
        for path, node in _walk(self.layer.tree):
            self._entry(path, node)

    def _entry(self, path: str, node: FsNode) -> None:
        fmt = stat.S_IFMT(node.mode)
        if fmt == stat.S_IFSOCK:
            self.stats.skipped_sockets += 1
            return
        if is_whiteout(node):
            head, _, name = path.rpartition("/")
            self._add(_marker(f"{head}/{WHITEOUT_PREFIX}{name}" if head else
                              WHITEOUT_PREFIX + name, node))
            self.stats.whiteouts += 1
            return
        if fmt != stat.S_IFDIR and node.links > 1:
            first = self.first_name.get(id(node))
            if first is not None:
                info = _header(path, node)
                info.type, info.linkname = tarfile.LNKTYPE, first
                self._add(info)
                self.stats.hard_links += 1
                return
            self.first_name[id(node)] = path
        info = _header(path, node)
        if fmt == stat.S_IFREG:
            self._regular(info, node)
            return
        if fmt == stat.S_IFDIR:
            info.type = tarfile.DIRTYPE
        elif fmt == stat.S_IFLNK:
            info.type = tarfile.SYMTYPE
            info.linkname = node.target.decode("utf-8", "surrogateescape")
        elif fmt in (stat.S_IFCHR, stat.S_IFBLK):
            info.type = tarfile.CHRTYPE if fmt == stat.S_IFCHR else tarfile.BLKTYPE
            info.devmajor, info.devminor = node.rdev_major, node.rdev_minor
        else:
            info.type = tarfile.FIFOTYPE
        self._add(info)
        if is_opaque(node):
            self._add(_marker(OPAQUE_MARKER if path == "." else f"{path}/{OPAQUE_MARKER}", node))
            self.stats.opaque_dirs += 1

    def _regular(self, info: tarfile.TarInfo, node: FsNode) -> None:
        info.size = node.size
        self.stats.file_bytes += node.size
        if node.inline is not None:
            self._add(info, io.BytesIO(node.inline))
            return
        ranges, chunk_size = self.layer.source_of(node)
        self._add(info, _PieceReader(file_pieces(node, ranges, chunk_size), self.feed_for(node)))

    def _add(self, info: tarfile.TarInfo, data: BinaryIO | _PieceReader | None = None) -> None:
        self.stats.entries += 1
        self.tar.addfile(info, data)  # type: ignore[arg-type]


def chunk_order(layer: LayerTree) -> dict[int, list[ChunkEntry]]:
    """Per blob-ranges object (by id), the chunk entries the tar reads, in tar order."""
    order: dict[int, list[ChunkEntry]] = {}
    seen: set[int] = set()
    for _path, node in _walk(layer.tree):
        if not node.is_reg or node.inline is not None or id(node) in seen:
            continue
        seen.add(id(node))
        ranges, chunk_size = layer.source_of(node)
        entries = order.setdefault(id(ranges), [])
        entries.extend(p.entry for p in file_pieces(node, ranges, chunk_size) if p.entry)
    return order


def write_layer_tar(store: Store, layer: LayerTree, out: BinaryIO) -> TarStats:
    """Write ``layer`` as an uncompressed PAX tar to ``out`` (see the module docstring)."""
    order = chunk_order(layer)
    with ThreadPoolExecutor(FETCH_WORKERS) as pool:
        feeds = {key: ChunkFeed(store, entries, pool) for key, entries in order.items()}

        def feed_for(node: FsNode) -> ChunkFeed:
            return feeds[id(layer.source_of(node)[0])]

        try:
            with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                _TarWriter(tar, layer, feed_for).write()
        finally:
            for feed in feeds.values():
                feed.close()
    return layer.stats


# -- folding --

def _dir_copy(node: FsNode) -> FsNode:
    copy = FsNode.directory(node.mode, node.uid, node.gid, node.mtime, node.mtime_ns)
    copy.xattrs = {k: v for k, v in node.xattrs.items() if k != OPAQUE_XATTR}
    return copy


def fold_layers(layers: list[FileTree]) -> tuple[FileTree, dict[int, int]]:
    """Merge trees given bottom first as overlayfs shows them; returns the tree
    and, per regular file node (by id), the index of the layer it comes from."""
    origin: dict[int, int] = {}
    merged = _dir_copy(layers[0].root) if layers else FsNode.directory()
    for index, tree in enumerate(layers):
        root_copy = _dir_copy(tree.root)
        root_copy.children = merged.children
        merged = root_copy
        _merge(merged, tree.root, index, origin)
    return FileTree(merged), origin


def _merge(dst: FsNode, src: FsNode, index: int, origin: dict[int, int]) -> None:
    assert dst.children is not None and src.children is not None
    for name, child in src.children.items():
        if is_whiteout(child):
            dst.children.pop(name, None)
            continue
        if not child.is_dir:
            dst.children[name] = child
            if child.is_reg:
                origin[id(child)] = index
            continue
        below = dst.children.get(name)
        copy = _dir_copy(child)
        if below is not None and below.is_dir and not is_opaque(child):
            copy.children = below.children
        dst.children[name] = copy
        _merge(copy, child, index, origin)
