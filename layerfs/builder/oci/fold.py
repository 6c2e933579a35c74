"""Folding consecutive image layers into one layer tree, as overlayfs would show them.

A :class:`FoldingAssembler` takes the tar entries of several image layers,
bottom first, one after the other (:meth:`begin_layer` before each,
:meth:`end_layer` after), and applies each layer to what the lower layers of
the same group left:

- a whiteout deletes what the group's lower layers put there and stays a
  whiteout (it may name something below the group);
- an opaque directory loses what the group's lower layers put in it and stays
  opaque;
- a directory that replaces a non-directory (or a whiteout) becomes opaque, as
  overlayfs stops merging at a non-directory; a directory over an opaque one
  stays opaque;
- a hard link may name a file from a lower layer of the group;
- a directory a layer needs but does not list (a parent of its entries) is a
  plain 0755 directory, as it is in that layer built alone: overlayfs shows
  the uppermost layer's directory.

When the group starts at the image's bottom there is nothing below it:
whiteouts are dropped and no directory needs to be opaque.

A folded layer's manifest records where it came from in its ``source``:
``oci:`` and its image layers' diff_ids, bottom first, comma separated; a list
longer than a manifest string may be (:data:`~layerfs.bounds.MAX_STRING`) is
summed up by :func:`fold_source` as its first and last diff_ids, their count
and the sha256 of the whole list (the hash the layer's name holds).
"""

from __future__ import annotations

import stat
from collections.abc import Callable
from typing import IO

from layerfs.bounds import MAX_STRING
from layerfs.tree import FsNode

from ..assembler import OPAQUE_XATTR, LayerAssembler
from ..pipeline import ChunkPipeline
from ..tarsource import OPAQUE as OPAQUE_MARKER

OPAQUE_KEY, OPAQUE_VALUE = OPAQUE_XATTR
Path = tuple[bytes, ...]


def fold_source(diff_ids: list[str], list_hash: str) -> str:
    """The ``source`` of a layer folded from ``diff_ids`` (bottom first), whose
    comma-separated list hashes to ``list_hash``: the list, or its summary where
    the list is longer than :data:`MAX_STRING`."""
    listed = "oci:" + ",".join(diff_ids)
    if len(listed) <= MAX_STRING:
        return listed
    return (f"oci:{diff_ids[0]},...,{diff_ids[-1]} ({len(diff_ids)} layers, "
            f"sha256 of the list {list_hash})")


def is_whiteout(node: FsNode) -> bool:
    """An overlayfs whiteout: a 0:0 character device."""
    return stat.S_ISCHR(node.mode) and node.rdev_major == 0 and node.rdev_minor == 0


class FoldingAssembler(LayerAssembler):
    """A layer assembler that stacks several image layers into one tree."""

    def __init__(self, pipeline: ChunkPipeline, on_file: Callable[[], None] | None = None,
                 on_warning: Callable[[str], None] | None = None) -> None:
        super().__init__(pipeline, on_file, on_warning)
        self.at_bottom = False  # the group starts at the image's bottom layer
        self.added: set[Path] = set()  # paths (and their parents) the current layer names
        self.layer_opaque: list[list[bytes]] = []

    def begin_layer(self) -> None:
        """A layer starts; its root is a plain directory unless it lists one."""
        self.added = set()
        self.layer_opaque = []
        root = FsNode.directory()
        root.children = self.tree.root.children
        self.tree.root = root

    def end_layer(self) -> None:
        """Apply the layer's opaque markers, now that all its entries are in."""
        for dir_parts in self.layer_opaque:
            node = self.opaque_dir(dir_parts)
            self._prune(dir_parts, node)
            if not self.at_bottom:
                node.xattrs[OPAQUE_KEY] = OPAQUE_VALUE

    def add(self, parts: list[bytes], node: FsNode, data: IO[bytes] | None = None) -> None:
        self._parents(parts)
        self._mark(parts)
        if is_whiteout(node):
            self.tree.remove(parts)
            if not self.at_bottom:
                super().add(parts, node)
            return
        if node.is_dir and not self.at_bottom and self._hides_below(parts):
            node.xattrs[OPAQUE_KEY] = OPAQUE_VALUE
        super().add(parts, node, data)

    def _hides_below(self, parts: list[bytes]) -> bool:
        """A directory put here must be opaque: it replaces a non-directory
        or an opaque directory of a lower layer of the group."""
        old = self.tree.lookup(parts)
        if old is None:
            return False
        return not old.is_dir or old.xattrs.get(OPAQUE_KEY) == OPAQUE_VALUE

    def link(self, parts: list[bytes], target: list[bytes]) -> None:
        self._parents(parts)
        self._mark(parts)
        super().link(parts, target)

    def mark_opaque(self, dir_parts: list[bytes]) -> None:
        self._parents([*dir_parts, OPAQUE_MARKER])
        self._mark(dir_parts)
        self.layer_opaque.append(dir_parts)

    def _mark(self, parts: list[bytes]) -> None:
        for i in range(1, len(parts) + 1):
            self.added.add(tuple(parts[:i]))

    def _parents(self, parts: list[bytes]) -> None:
        """The parents of an entry, as a layer of its own would have them: a
        parent this layer does not list is a plain 0755 directory (overlayfs
        shows the uppermost layer's directory), and one that a lower layer of
        the group made a non-directory becomes an opaque directory."""
        for i in range(1, len(parts)):
            prefix = parts[:i]
            node = self.tree.lookup(prefix)
            if node is None or tuple(prefix) in self.added:
                continue
            new = FsNode.directory()
            if node.is_dir:
                opaque = node.xattrs.get(OPAQUE_KEY)
                if opaque is not None:
                    new.xattrs[OPAQUE_KEY] = opaque
            elif not self.at_bottom:
                new.xattrs[OPAQUE_KEY] = OPAQUE_VALUE
            self.tree.put(prefix, new)

    def _prune(self, prefix: list[bytes], node: FsNode) -> None:
        """Drop what lower layers of the group put under the opaque ``prefix``."""
        assert node.children is not None
        for name, child in list(node.children.items()):
            path = [*prefix, name]
            if tuple(path) not in self.added:
                del node.children[name]
            elif child.is_dir:
                self._prune(path, child)
