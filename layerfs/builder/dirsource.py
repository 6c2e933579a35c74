"""A directory as a layer source: every entry with owners, modes, xattrs, links."""

from __future__ import annotations

import errno
import os
import stat

from layerfs.errors import SourceError
from layerfs.tree import FsNode

from .assembler import LayerAssembler, display


def read_xattrs(path: bytes) -> dict[bytes, bytes]:
    """The xattrs of ``path`` itself, a symlink not followed (names in byte order)."""
    return _xattrs(path, follow_symlinks=False)


def read_fd_xattrs(fd: int) -> dict[bytes, bytes]:
    """The xattrs of an open file (names in byte order)."""
    return _xattrs(fd, follow_symlinks=True)


def _xattrs(target: bytes | int, follow_symlinks: bool) -> dict[bytes, bytes]:
    try:
        names = os.listxattr(target, follow_symlinks=follow_symlinks)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return {}
        raise
    out = {}
    for name in sorted(names):
        try:
            out[name.encode()] = os.getxattr(target, name, follow_symlinks=follow_symlinks)
        except OSError as exc:
            if exc.errno != errno.ENODATA:
                raise
    return out


def node_from_stat(st: os.stat_result, path: bytes,
                   xattrs: dict[bytes, bytes] | None = None) -> FsNode:
    node = FsNode(
        mode=st.st_mode,
        uid=st.st_uid,
        gid=st.st_gid,
        mtime=st.st_mtime_ns // 10**9,
        mtime_ns=st.st_mtime_ns % 10**9,
        xattrs=read_xattrs(path) if xattrs is None else xattrs,
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


OVERLAY_PREFIX = b"trusted.overlay."
KEPT_OVERLAY_XATTRS = {b"trusted.overlay.opaque": b"y"}  # name → the one value kept
REFUSED_OVERLAY_XATTRS = (b"trusted.overlay.redirect", b"trusted.overlay.metacopy")


def upper_xattrs(xattrs: dict[bytes, bytes], where: str) -> dict[bytes, bytes]:
    """The xattrs of an overlay upper entry that belong in a layer: every xattr
    but the kernel's own ``trusted.overlay.*`` bookkeeping (origin, impure,
    nlink, uuid, protattr, ...), of which only ``opaque=y`` is kept. A redirect
    or metacopy entry has its data or its name in a lower layer, which a layer
    cannot say: it is refused."""
    out = {}
    for name, value in xattrs.items():
        if name in REFUSED_OVERLAY_XATTRS:
            raise SourceError(where, f"overlay {name[len(OVERLAY_PREFIX):].decode()} "
                              "entries cannot be committed")
        if not name.startswith(OVERLAY_PREFIX) or KEPT_OVERLAY_XATTRS.get(name) == value:
            out[name] = value
    return out


class UpperSource:
    """An overlay upper directory written by a sandbox: hostile content, walked
    through directory descriptors (``O_NOFOLLOW``, names relative to their
    parent's descriptor), so a symlink is stored as a symlink and a directory
    swapped for a symlink during the walk is never followed out of the tree.
    Whiteouts (0:0 character devices) and opaque directories stay what they
    are. An entry that vanishes during the walk is skipped and named in
    :attr:`vanished`; a regular file whose size or mtime changed while it was
    read is named in :attr:`changed` (its bytes are those read: see
    docs/dev/node.md, Commit)."""

    def __init__(self, path: str) -> None:
        self.path = os.fsencode(os.path.abspath(path))
        self.inodes: dict[tuple[int, int], list[bytes]] = {}
        self.vanished: list[str] = []
        self.changed: list[str] = []

    def feed(self, asm: LayerAssembler) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            raise SourceError(os.fsdecode(self.path), exc.strerror) from None
        try:
            st = os.fstat(fd)
            root = node_from_stat(st, self.path, upper_xattrs(read_fd_xattrs(fd), "/"))
            asm.set_root(root)
            self._walk(asm, fd, [])
        except OSError as exc:
            where = os.fsdecode(exc.filename) if exc.filename else os.fsdecode(self.path)
            raise SourceError(where, exc.strerror or str(exc)) from None
        finally:
            os.close(fd)

    def _walk(self, asm: LayerAssembler, dirfd: int, parts: list[bytes]) -> None:
        names = sorted(os.fsencode(n) for n in os.listdir(dirfd))
        for name in names:
            try:
                self._entry(asm, dirfd, parts + [name])
            except FileNotFoundError:
                self.vanished.append(display(parts + [name]))

    def _entry(self, asm: LayerAssembler, dirfd: int, child: list[bytes]) -> None:
        name = child[-1]
        st = os.lstat(name, dir_fd=dirfd)
        key = (st.st_dev, st.st_ino)
        fmt = stat.S_IFMT(st.st_mode)
        if fmt != stat.S_IFDIR and st.st_nlink > 1 and key in self.inodes:
            asm.link(child, self.inodes[key])
            return
        if fmt in (stat.S_IFREG, stat.S_IFDIR):
            self._opened(asm, dirfd, child, fmt)
        else:  # symlinks, devices, fifos, sockets: never opened
            path = b"/proc/self/fd/%d/%s" % (dirfd, name)
            node = node_from_stat(st, path)
            node.xattrs = upper_xattrs(node.xattrs, display(child))
            asm.add(child, node)
        if st.st_nlink > 1 and fmt != stat.S_IFDIR:
            self.inodes[key] = child

    def _opened(self, asm: LayerAssembler, dirfd: int, child: list[bytes], fmt: int) -> None:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        if fmt == stat.S_IFDIR:
            flags |= os.O_DIRECTORY
        try:
            fd = os.open(child[-1], flags, dir_fd=dirfd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # replaced during the walk
                raise SourceError(display(child), "changed type during the commit") from None
            raise
        try:
            before = os.fstat(fd)
            if stat.S_IFMT(before.st_mode) != fmt:
                raise SourceError(display(child), "changed type during the commit")
            node = node_from_stat(before, child[-1],
                                  upper_xattrs(read_fd_xattrs(fd), display(child)))
            if fmt == stat.S_IFDIR:
                asm.add(child, node)
                self._walk(asm, fd, child)
                return
            with open(fd, "rb", buffering=0, closefd=False) as f:
                asm.add(child, node, f)  # type: ignore[arg-type]
            after = os.fstat(fd)
            if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
                self.changed.append(display(child))
        finally:
            os.close(fd)
