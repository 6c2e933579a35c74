"""The in-memory file tree a layer is made of.

Sources (directories, tars) fill a tree of :class:`FsNode`; the EROFS writer
serialises it. A hard link is the same node object under several names.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass, field

HOLE = -1  # chunk address of an all-zero chunk: not stored, reads as zeros


@dataclass(eq=False)
class FsNode:
    mode: int  # st_mode, type bits included
    uid: int = 0
    gid: int = 0
    mtime: int = 0
    mtime_ns: int = 0
    size: int = 0
    rdev_major: int = 0
    rdev_minor: int = 0
    target: bytes = b""  # symlink target
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    inline: bytes | None = None  # small regular file kept whole in the meta image
    chunks: list[int] = field(default_factory=list)  # blob block address per chunk or HOLE
    children: dict[bytes, FsNode] | None = None  # directories only
    links: int = 0  # names that point at this node (set by the writer)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    @classmethod
    def directory(cls, mode: int = 0o755, uid: int = 0, gid: int = 0, mtime: int = 0,
                  mtime_ns: int = 0) -> FsNode:
        return cls(mode=stat.S_IFDIR | (mode & 0o7777), uid=uid, gid=gid, mtime=mtime,
                   mtime_ns=mtime_ns, children={})


class FileTree:
    """A directory tree addressed by ``/``-separated byte paths."""

    def __init__(self, root: FsNode | None = None) -> None:
        self.root = root or FsNode.directory()

    def parent_of(self, parts: list[bytes]) -> FsNode:
        """The directory that holds ``parts[-1]``; missing directories are made."""
        node = self.root
        for part in parts[:-1]:
            assert node.children is not None
            child = node.children.get(part)
            if child is None or not child.is_dir:
                child = FsNode.directory()
                node.children[part] = child
            node = child
        return node

    def lookup(self, parts: list[bytes]) -> FsNode | None:
        node: FsNode | None = self.root
        for part in parts:
            if node is None or node.children is None:
                return None
            node = node.children.get(part)
        return node

    def put(self, parts: list[bytes], node: FsNode) -> None:
        """Place ``node`` at ``parts``; an existing directory keeps its children."""
        if not parts:
            node.children = self.root.children if node.is_dir else None
            if not node.is_dir:
                raise ValueError("the root must be a directory")
            self.root = node
            return
        parent = self.parent_of(parts)
        assert parent.children is not None
        old = parent.children.get(parts[-1])
        if node.is_dir and old is not None and old.is_dir:
            node.children = old.children
        parent.children[parts[-1]] = node

    def remove(self, parts: list[bytes]) -> None:
        parent = self.lookup(parts[:-1])
        if parent is not None and parent.children is not None:
            parent.children.pop(parts[-1], None)
