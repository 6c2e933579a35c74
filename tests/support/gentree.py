"""Seeded generator of source trees that exercise every EROFS feature layerfs
writes: deep paths, 255-byte names, empty files, files of exactly one chunk and
one byte more, big directories, sparse files, hard links, symlinks, devices,
fifos, sockets, xattrs (user, trusted, security incl. capabilities), large
uids, setuid/sticky modes, nanosecond mtimes and repeated content."""

from __future__ import annotations

import os
import random
import socket
import stat
import struct
import tarfile

from hypothesis import strategies as st

from layerfs.tree import FileTree, FsNode

CAP_NET_BIND = struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0)  # VFS_CAP_REVISION_2


def _touch(path: str, data: bytes, rng: random.Random, *, uid: int = 0, gid: int = 0,
           mode: int = 0o644) -> None:
    with open(path, "wb") as f:
        f.write(data)
    _attrs(path, rng, uid, gid, mode)


def _attrs(path: str, rng: random.Random, uid: int, gid: int, mode: int | None) -> None:
    os.lchown(path, uid, gid)
    if mode is not None:
        os.chmod(path, mode)
    ns = rng.randrange(0, 2_000_000_000) * 10**9 + rng.randrange(10**9)
    os.utime(path, ns=(ns, ns), follow_symlinks=False)


def make_tree(root: str, seed: int = 0, chunk_size: int = 65536, big_dir: int = 10_000,
              sockets: bool = True, long_names: bool = True) -> str:
    """Fill ``root`` (created) and return it. Needs root (owners, devices, trusted.*)."""
    rng = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    j = os.path.join
    shared = rng.randbytes(3 * chunk_size // 2)
    # regular files: sizes around the interesting edges
    os.mkdir(j(root, "files"))
    sizes = [0, 1, 100, 4095, 4096, 4097, chunk_size - 1, chunk_size, chunk_size + 1,
             3 * chunk_size + 17]
    for i, size in enumerate(sizes):
        _touch(j(root, "files", f"f{i:02d}_{size}"), rng.randbytes(size), rng,
               uid=rng.choice([0, 1000, 70000]), gid=rng.choice([0, 100, 80000]))
    for i in range(4):  # repeated content inside the layer
        _touch(j(root, "files", f"dup{i}"), shared, rng)
    _touch(j(root, "files", "text"), b"hello layerfs\n" * 5000, rng)
    # sparse: a data block, a long hole, a data block
    sparse = j(root, "files", "sparse")
    with open(sparse, "wb") as f:
        f.write(rng.randbytes(5000))
        f.seek(8 * chunk_size + 123)
        f.write(b"tail")
    _attrs(sparse, rng, 0, 0, 0o600)
    # modes
    _touch(j(root, "files", "suid"), b"#!/bin/sh\n", rng, mode=0o4755)
    os.mkdir(j(root, "sticky"))
    _attrs(j(root, "sticky"), rng, 0, 0, 0o1777)
    # hard links
    os.mkdir(j(root, "links"))
    _touch(j(root, "links", "a"), rng.randbytes(chunk_size + 5), rng)
    os.link(j(root, "links", "a"), j(root, "links", "b"))
    os.link(j(root, "links", "a"), j(root, "files", "c-link"))
    _touch(j(root, "links", "small"), b"tiny", rng)
    os.link(j(root, "links", "small"), j(root, "links", "small2"))
    # symlinks
    os.symlink("a", j(root, "links", "sym-rel"))
    os.symlink("/usr/bin/python3", j(root, "links", "sym-abs"))
    os.symlink("x" * 4000, j(root, "links", "sym-long"))
    os.symlink("../files/f00_0", j(root, "links", "sym-up"))
    for name in ("sym-rel", "sym-abs", "sym-long", "sym-up"):
        _attrs(j(root, "links", name), rng, rng.choice([0, 1000]), 0, None)
    # special files
    os.mkdir(j(root, "dev"))
    os.mknod(j(root, "dev", "null"), 0o20666, os.makedev(1, 3))
    os.mknod(j(root, "dev", "sda"), 0o60660, os.makedev(8, 0))
    os.mknod(j(root, "dev", "bigminor"), 0o20600, os.makedev(200, 300000))
    os.mknod(j(root, "dev", "whiteout"), 0o20000, os.makedev(0, 0))
    os.mkfifo(j(root, "dev", "fifo"), 0o644)
    if sockets:
        sock = socket.socket(socket.AF_UNIX)
        cwd = os.getcwd()
        os.chdir(j(root, "dev"))
        try:
            sock.bind("sock")
        finally:
            os.chdir(cwd)
            sock.close()
    for name in sorted(os.listdir(j(root, "dev"))):
        _attrs(j(root, "dev", name), rng, 0, rng.choice([0, 5]), None)
    # xattrs: inline, shared (same pair on several inodes), security and trusted
    os.mkdir(j(root, "x"))
    for i in range(5):
        p = j(root, "x", f"x{i}")
        _touch(p, rng.randbytes(rng.randrange(0, 9000)), rng)
        os.setxattr(p, "user.common", b"shared-value")
        os.setxattr(p, f"user.own{i}", rng.randbytes(rng.randrange(1, 200)))
    os.setxattr(j(root, "x", "x0"), "security.capability", CAP_NET_BIND)
    os.setxattr(j(root, "x", "x1"), "trusted.overlay.opaque", b"y")
    os.setxattr(j(root, "x"), "trusted.overlay.opaque", b"y")
    os.setxattr(j(root, "x", "x2"), "user.big", rng.randbytes(3000))
    # deep path and long names
    deep = root
    for i in range(40):
        deep = j(deep, f"d{i}")
        os.mkdir(deep)
    _touch(j(deep, "leaf"), b"deep", rng)
    os.mkdir(j(root, "long"))
    for ch in "abc" if long_names else "":
        _touch(j(root, "long", ch * 255), rng.randbytes(rng.randrange(0, 6000)), rng)
    # a big directory
    big = j(root, "big")
    os.mkdir(big)
    for i in range(big_dir):
        path = j(big, f"entry-{i:05d}-{rng.randrange(10**6)}")
        with open(path, "wb") as f:
            f.write(b"%d" % i)
        os.utime(path, ns=(1_600_000_000 * 10**9, 1_600_000_000 * 10**9))  # compact inodes
    # directory attributes last (creating entries changes mtimes)
    for dirpath, dirnames, _ in os.walk(root, topdown=False):
        for d in dirnames:
            if d != "sticky":
                _attrs(j(dirpath, d), rng, rng.choice([0, 1000]), 0, 0o755)
    _attrs(root, rng, 0, 0, 0o755)
    return root


def tar_tree(root: str, out: str, mode: str = "w") -> str:
    """Archive ``root`` as a PAX tar (numeric owners, devices, xattrs)."""

    def add_xattrs(info: tarfile.TarInfo) -> tarfile.TarInfo:
        path = os.path.join(root, info.name)
        for name in os.listxattr(path, follow_symlinks=False):
            value = os.getxattr(path, name, follow_symlinks=False)
            info.pax_headers["SCHILY.xattr." + name] = value.decode("utf-8", "surrogateescape")
        st = os.lstat(path)
        info.pax_headers["mtime"] = f"{st.st_mtime_ns // 10**9}.{st.st_mtime_ns % 10**9:09d}"
        info.uname = info.gname = ""
        return info

    with tarfile.open(out, mode, format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            if dirpath == root:
                tar.add(root, arcname=".", recursive=False, filter=add_xattrs)
            for name in sorted(dirnames) + sorted(filenames):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    continue  # tar cannot hold sockets
                tar.add(path, arcname=rel, recursive=False, filter=add_xattrs)
    return out


def write_tree(root, seed: int, files: int = 40, size: int = 40_000) -> None:
    rng = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    for i in range(files):
        with open(os.path.join(root, f"f{i:03d}"), "wb") as f:
            f.write(rng.randbytes(rng.randrange(size // 2, size * 2)))


names = st.binary(min_size=1, max_size=255).filter(
    lambda n: b"/" not in n and b"\0" not in n and n not in (b".", b".."))


@st.composite
def trees(draw):
    tree = FileTree(FsNode.directory(0o755, mtime=draw(st.integers(0, 2**33))))
    dirs = [[]]
    for _ in range(draw(st.integers(0, 40))):
        parent = draw(st.sampled_from(dirs))
        name = draw(names)
        kind = draw(st.sampled_from(["dir", "file", "link", "fifo", "chr"]))
        meta = dict(uid=draw(st.integers(0, 2**20)), gid=draw(st.integers(0, 2**20)),
                    mtime=draw(st.sampled_from([0, 1700000000, 2**32 + 5])),
                    mtime_ns=draw(st.sampled_from([0, 1, 999_999_999])))
        xattrs = draw(st.dictionaries(
            st.sampled_from([b"user.a", b"user.bb", b"trusted.t", b"security.s"]),
            st.binary(min_size=0, max_size=300), max_size=3))
        if kind == "dir":
            node = FsNode.directory(draw(st.integers(0, 0o7777)), **meta)
            dirs.append(parent + [name])
        elif kind == "file":
            data = draw(st.binary(max_size=3000))
            node = FsNode(mode=stat.S_IFREG | draw(st.integers(0, 0o7777)), size=len(data),
                          inline=data, **meta)
        elif kind == "link":
            node = FsNode(mode=stat.S_IFLNK | 0o777, target=draw(st.binary(min_size=1,
                          max_size=200).filter(lambda t: b"\0" not in t)), **meta)
        elif kind == "fifo":
            node = FsNode(mode=stat.S_IFIFO | 0o644, **meta)
        else:
            node = FsNode(mode=stat.S_IFCHR | 0o600, rdev_major=draw(st.integers(0, 4095)),
                          rdev_minor=draw(st.integers(0, 2**20 - 1)), **meta)
        if kind not in ("dir", "file"):  # Linux allows user.* only there
            xattrs = {k: v for k, v in xattrs.items() if not k.startswith(b"user.")}
        node.xattrs = dict(xattrs)
        target = tree.lookup(parent)
        if target is not None and target.is_dir and name not in (target.children or {}):
            tree.put(parent + [name], node)
    return tree
