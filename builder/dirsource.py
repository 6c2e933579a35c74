"""A directory as a layer source: every entry with owners, modes, xattrs, links."""

from __future__ import annotations

import errno
import os
import stat

from layerfs.errors import SourceError
from layerfs.tree import FsNode

from .assembler import LayerAssembler


def read_xattrs(path: bytes) -> dict[bytes, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return {}
        raise
    out = {}
    for name in sorted(names):
        try:
            out[name.encode()] = os.getxattr(path, name, follow_symlinks=False)
        except OSError as exc:
            if exc.errno != errno.ENODATA:
                raise
    return out


def node_from_stat(st: os.stat_result, path: bytes) -> FsNode:
    node = FsNode(
        mode=st.st_mode,
        uid=st.st_uid,
        gid=st.st_gid,
        mtime=st.st_mtime_ns // 10**9,
        mtime_ns=st.st_mtime_ns % 10**9,
        xattrs=read_xattrs(path),
    )
    fmt = stat.S_IFMT(st.st_mode)
    if fmt == stat.S_IFREG:
        node.size = st.st_size
    elif fmt == stat.S_IFLNK:
        node.target = os.readlink(path)
    elif fmt in (stat.S_IFCHR, stat.S_IFBLK):
        node.rdev_major, node.rdev_minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    elif fmt == stat.S_IFDIR:
        node.children = {}
    return node


class DirectorySource:
    """Walks a directory depth first, names in byte order."""

    def __init__(self, path: str) -> None:
        self.path = os.fsencode(os.path.abspath(path))
        self.inodes: dict[tuple[int, int], list[bytes]] = {}

    def feed(self, asm: LayerAssembler) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            raise SourceError(os.fsdecode(self.path), "no such file or directory") from None
        except OSError as exc:
            raise SourceError(os.fsdecode(self.path), exc.strerror) from None
        if not stat.S_ISDIR(st.st_mode):
            raise SourceError(os.fsdecode(self.path), "not a directory or tar archive")
        try:
            asm.set_root(node_from_stat(st, self.path))
            self._walk(asm, self.path, [])
        except OSError as exc:
            where = os.fsdecode(exc.filename) if exc.filename else os.fsdecode(self.path)
            raise SourceError(where, exc.strerror or str(exc)) from None

    def _walk(self, asm: LayerAssembler, dirpath: bytes, parts: list[bytes]) -> None:
        with os.scandir(dirpath) as it:
            names = sorted(e.name for e in it)
        for name in names:
            path = os.path.join(dirpath, name)
            child = parts + [name]
            st = os.lstat(path)
            key = (st.st_dev, st.st_ino)
            if not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1 and key in self.inodes:
                asm.link(child, self.inodes[key])
                continue
            node = node_from_stat(st, path)
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb", buffering=0) as f:
                    asm.add(child, node, f)  # type: ignore[arg-type]
            else:
                asm.add(child, node)
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                self.inodes[key] = child
            if stat.S_ISDIR(st.st_mode):
                self._walk(asm, path, child)
