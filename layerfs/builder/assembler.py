"""Collects source entries into a file tree, sending file data to the pipeline.

Sources call :meth:`LayerAssembler.add` for each entry in their own order; the
assembler keeps small files inline, chunks the rest, links hard links to the
same node and counts what it saw. What an inode cannot hold is refused (owners,
device numbers, sizes) or, for mtimes, clamped to the nearest time it can hold
and reported once, in :meth:`LayerAssembler.finish`.
"""

from __future__ import annotations

import logging
import stat
from collections.abc import Callable
from typing import IO

from layerfs.errors import SourceError, UnsupportedEntry
from layerfs.formats.erofs import (
    DEV_MAJOR_LIMIT,
    DEV_MINOR_LIMIT,
    ID_LIMIT,
    clamp_mtime,
    max_inline_file,
    xattr_entry,
)
from layerfs.manifest import TreeCounts
from layerfs.tree import FileTree, FsNode

from .pipeline import ChunkPipeline

log = logging.getLogger(__name__)
OPAQUE_XATTR = (b"trusted.overlay.opaque", b"y")
MAX_FILE_SIZE = 2**44  # a blob addresses 2^32 blocks of 4 KiB


def display(parts: list[bytes]) -> str:
    return "/" + b"/".join(parts).decode(errors="replace")


class LayerAssembler:
    """The tree of one layer under construction."""

    def __init__(
        self, pipeline: ChunkPipeline, on_file: Callable[[], None] | None = None,
        on_warning: Callable[[str], None] | None = None,
    ) -> None:
        self.tree = FileTree()
        self.pipeline = pipeline
        self.counts = TreeCounts()
        self.on_file = on_file
        self.on_warning = on_warning or log.warning
        self.opaque: list[list[bytes]] = []
        self.clamped_mtimes = 0
        self._chunked: list[tuple[FsNode, int]] = []  # (node, its file number in the pipeline)

    def add(self, parts: list[bytes], node: FsNode, data: IO[bytes] | None = None) -> None:
        """Add one entry; regular files read ``node.size`` bytes from ``data``."""
        self._check(parts, node)
        if node.is_reg:
            self._add_data(parts, node, data)
        self._count(node)
        self.tree.put(parts, node)
        if self.on_file:
            self.on_file()

    def _check(self, parts: list[bytes], node: FsNode) -> None:
        """Refuse what an inode cannot hold; clamp an mtime it cannot hold."""
        for key, raw in node.xattrs.items():
            try:
                xattr_entry(key, raw)
            except ValueError as exc:
                raise SourceError(display(parts), str(exc)) from None
        for what, value, limit in (("uid", node.uid, ID_LIMIT), ("gid", node.gid, ID_LIMIT),
                                   ("device major", node.rdev_major, DEV_MAJOR_LIMIT),
                                   ("device minor", node.rdev_minor, DEV_MINOR_LIMIT),
                                   ("size", node.size, MAX_FILE_SIZE + 1)):
            if not 0 <= value < limit:
                raise UnsupportedEntry(display(parts), f"{what} {value} out of range "
                                       f"(0 to {limit - 1})")
        fitted = clamp_mtime(node.mtime, node.mtime_ns)
        if fitted != (node.mtime, node.mtime_ns):
            node.mtime, node.mtime_ns = fitted
            self.clamped_mtimes += 1

    def _add_data(self, parts: list[bytes], node: FsNode, data: IO[bytes] | None) -> None:
        if node.size <= max_inline_file(node.xattrs):
            content = data.read(node.size) if data and node.size else b""
            if len(content) != node.size:
                raise SourceError(display(parts), "file changed or ended while reading")
            node.inline = content
            self.counts.inline_bytes += node.size
        else:
            assert data is not None
            try:
                self._chunked.append((node, self.pipeline.add_file(data, node.size)))
            except EOFError as exc:
                raise SourceError(display(parts), f"file changed while reading ({exc})") from None
        self.counts.file_bytes += node.size

    def _count(self, node: FsNode) -> None:
        fmt = stat.S_IFMT(node.mode)
        if fmt == stat.S_IFREG:
            self.counts.files += 1
        elif fmt == stat.S_IFDIR:
            self.counts.dirs += 1
        elif fmt == stat.S_IFLNK:
            self.counts.symlinks += 1
        else:
            self.counts.others += 1

    def link(self, parts: list[bytes], target: list[bytes]) -> None:
        """Hard link ``parts`` to the existing non-directory ``target``."""
        node = self.tree.lookup(target)
        if node is None or node.is_dir:
            raise SourceError(display(parts), f"hard link to missing {display(target)}")
        self.tree.put(parts, node)

    def set_root(self, node: FsNode) -> None:
        if not node.is_dir:
            raise SourceError("/", "the root must be a directory")
        self._check([], node)
        self.tree.put([], node)

    def mark_opaque(self, dir_parts: list[bytes]) -> None:
        """Mark a directory opaque; applied by :meth:`finish`, after its own entry."""
        self.opaque.append(dir_parts)

    def opaque_dir(self, dir_parts: list[bytes]) -> FsNode:
        """The directory an opaque marker names (made if the source never
        listed it); SourceError if it is not a directory."""
        node = self.tree.lookup(dir_parts)
        if node is None:
            node = FsNode.directory()
            self.tree.put(dir_parts, node)
        if not node.is_dir:
            raise SourceError(display(dir_parts), "opaque marker in a non-directory")
        return node

    def place_chunks(self, file_chunks: list[list[int]]) -> None:
        """Give each chunked file its blob addresses, once the pipeline settled them."""
        for node, number in self._chunked:
            node.chunks = file_chunks[number]

    def finish(self) -> FileTree:
        for dir_parts in self.opaque:
            self.opaque_dir(dir_parts).xattrs[OPAQUE_XATTR[0]] = OPAQUE_XATTR[1]
        if self.clamped_mtimes:
            self.on_warning(f"{self.clamped_mtimes} entries have an mtime beyond what EROFS "
                            "holds (a signed 64-bit second); stored the nearest time it holds")
        return self.tree

    def remove(self, parts: list[bytes]) -> None:
        self.tree.remove(parts)
