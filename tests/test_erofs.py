"""The EROFS writer against its oracles: the kernel, fsck.erofs and mkfs.erofs."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from support import build, mounted_layer, need_root
from support.gentree import make_tree, trees
from support.treecmp import diff_trees

from layerfs.formats.chunktable import HEADER
from layerfs.formats.erofs import write_meta_image
from layerfs.mounts import mount_erofs, umount
from layerfs.refstore import RefStore
from layerfs.store.file import FileStore
from layerfs.tree import FileTree, FsNode


@pytest.fixture
def fstore(tmp_path):
    return FileStore(str(tmp_path / "store"))


@pytest.mark.parametrize("chunk_size,big_dir", [(4096, 300), (65536, 10_000), (1 << 20, 300)])
def test_kernel_mount_matches_source(tmp_path, fstore, chunk_size, big_dir):
    need_root()
    src = make_tree(str(tmp_path / "src"), seed=chunk_size, chunk_size=chunk_size,
                    big_dir=big_dir)
    result = build(fstore, src, chunk_size=chunk_size)
    assert result.manifest.stats.holes > 0  # the sparse file's hole was not stored
    with mounted_layer(fstore, result.digest, str(tmp_path / "w")) as mnt:
        assert diff_trees(src, mnt) == []


def test_output_is_deterministic(tmp_path):
    need_root()
    src = make_tree(str(tmp_path / "src"), seed=7, big_dir=50)
    metas, tables = [], []
    for i in range(2):
        store = FileStore(str(tmp_path / f"store{i}"))
        res = build(store, src, chunk_size=65536)
        metas.append(RefStore(store).meta_image(res.manifest))
        tables.append(store.get_blob(res.manifest.chunk_table.digest))
    assert metas[0] == metas[1]
    assert len(tables[0]) > HEADER.size
    assert tables[0] == tables[1]


def test_mkfs_erofs_builds_the_same_tree(tmp_path, fstore):
    """mkfs.erofs 1.5 with --chunksize --blobdev and ours mount to identical trees."""
    need_root()
    if not shutil.which("mkfs.erofs"):
        pytest.fail("mkfs.erofs (erofs-utils) is required")
    # mkfs.erofs 1.5 fails on 255-byte names ("Could not format the device")
    src = make_tree(str(tmp_path / "src"), seed=3, chunk_size=65536, big_dir=500,
                    long_names=False)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "blob").write_bytes(b"")  # mkfs.erofs 1.5 wants the blob device to exist
    subprocess.run(["mkfs.erofs", "--quiet", "--preserve-mtime", "--chunksize=65536",
                    f"--blobdev={theirs / 'blob'}", str(theirs / "meta"), src], check=True)
    (theirs / "mnt").mkdir()
    mount_erofs(str(theirs / "meta"), str(theirs / "blob"), str(theirs / "mnt"))
    try:
        result = build(fstore, src, chunk_size=65536)
        with mounted_layer(fstore, result.digest, str(tmp_path / "ours")) as mnt:
            assert diff_trees(str(theirs / "mnt"), mnt) == []
    finally:
        umount(str(theirs / "mnt"))


# -- small random trees written straight to an image (no store), many shapes --


def _expected(tree: FileTree, root: str) -> None:
    """Materialise ``tree`` on disk so the comparison uses the same code path."""
    def make(node: FsNode, path: str) -> None:
        fmt = stat.S_IFMT(node.mode)
        if fmt == stat.S_IFDIR:
            if path != root:
                os.mkdir(path)
            for name, child in sorted((node.children or {}).items()):
                make(child, os.path.join(path, os.fsdecode(name)))
        elif fmt == stat.S_IFREG:
            with open(path, "wb") as f:
                f.write(node.inline or b"")
        elif fmt == stat.S_IFLNK:
            os.symlink(node.target, path)
        else:
            os.mknod(path, node.mode, os.makedev(node.rdev_major, node.rdev_minor))
        for k, v in node.xattrs.items():
            os.setxattr(path, k, v, follow_symlinks=False)
        os.lchown(path, node.uid, node.gid)
        if fmt != stat.S_IFLNK:
            os.chmod(path, node.mode & 0o7777)
    make(tree.root, root)

    def stamp(node: FsNode, path: str) -> None:  # mtimes last: children change them
        for name, child in (node.children or {}).items():
            stamp(child, os.path.join(path, os.fsdecode(name)))
        t = node.mtime * 10**9 + node.mtime_ns
        os.utime(path, ns=(t, t), follow_symlinks=False)
    stamp(tree.root, root)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(tree=trees())
def test_random_trees_mount_as_built(tree, tmp_path_factory):
    need_root()
    work = tmp_path_factory.mktemp("h")
    expect = work / "expect"
    expect.mkdir()
    _expected(tree, str(expect))
    meta = work / "meta"
    meta.write_bytes(write_meta_image(tree, 0, 16))
    blob = work / "blob"
    blob.write_bytes(b"")
    fsck = subprocess.run(["fsck.erofs", f"--device={blob}", str(meta)], capture_output=True)
    assert fsck.returncode == 0, fsck.stderr
    mnt = work / "mnt"
    mnt.mkdir()
    mount_erofs(str(meta), str(blob), str(mnt))
    try:
        assert diff_trees(str(expect), str(mnt)) == []
    finally:
        umount(str(mnt))
    shutil.rmtree(work)


def test_seeded_generator_is_reproducible(tmp_path):
    need_root()
    a = make_tree(str(tmp_path / "a"), seed=11, big_dir=20, sockets=False)
    b = make_tree(str(tmp_path / "b"), seed=11, big_dir=20, sockets=False)
    assert diff_trees(a, b) == []
