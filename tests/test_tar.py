"""Tar sources: compressions, GNU tar archives, stdin, whiteouts, unsafe entries."""

from __future__ import annotations

import gzip
import os
import re
import stat
import subprocess
import sys
import tarfile

import pytest
import zstandard
from support import build, mounted_layer, need_root
from support.gentree import make_tree, tar_tree
from support.tarcuts import (
    CUT_SHORT,
    ENDING_OF,
    ENDINGS,
    LAST_FILE,
    cut_after_last,
    gnu_long_name_then_end,
    pax_header_then_end,
    tar_of,
)
from support.treecmp import diff_trees

from layerfs.errors import SourceError, UnsafeTarEntry
from layerfs.mounts import mount, umount
from layerfs.refstore import LAYERS, RefStore
from layerfs.store.file import FileStore


@pytest.fixture
def fstore(tmp_path):
    return FileStore(str(tmp_path / "store"))


@pytest.fixture(scope="module")
def src_tree(tmp_path_factory):
    need_root()
    return make_tree(str(tmp_path_factory.mktemp("src") / "root"), seed=5, big_dir=200,
                     sockets=False)


@pytest.mark.parametrize("mode", ["w", "w:gz", "w:xz", "zstd"])
def test_tar_layer_matches_source(tmp_path, fstore, src_tree, mode):
    out = str(tmp_path / "src.tar")
    if mode == "zstd":
        tar_tree(src_tree, out)
        with open(out, "rb") as f:
            data = zstandard.ZstdCompressor(level=3).compress(f.read())
        out += ".zst"
        with open(out, "wb") as f:
            f.write(data)
    else:
        tar_tree(src_tree, out, mode)
    result = build(fstore, out, chunk_size=65536)
    with mounted_layer(fstore, result.digest, str(tmp_path / "w")) as mnt:
        assert diff_trees(src_tree, mnt) == []


def test_gnu_tar_archive(tmp_path, fstore, src_tree):
    """An archive written by GNU tar (posix format, xattrs, numeric owners)."""
    out = str(tmp_path / "gnu.tar")
    subprocess.run(["tar", "--format=posix", "--xattrs", "--xattrs-include=*",
                    "--numeric-owner", "-C", src_tree, "-cf", out, "."], check=True)
    result = build(fstore, out, chunk_size=65536)
    with mounted_layer(fstore, result.digest, str(tmp_path / "w")) as mnt:
        # GNU tar keeps directory mtimes only to the second in some headers
        assert diff_trees(src_tree, mnt, dir_mtime=False) == []


def test_stdin_gives_the_same_layer(tmp_path, src_tree):
    out = tar_tree(src_tree, str(tmp_path / "src.tar"), "w:gz")
    metas = []
    for i, src in enumerate([out, "-"]):
        store = tmp_path / f"s{i}"
        with open(out, "rb") as stdin:
            subprocess.run([sys.executable, "-m", "layerfs.cli.main", "build", src,
                            "--name", "t", "--version", "1", "--store", f"file://{store}"],
                           stdin=stdin, check=True, capture_output=True)
        refstore = RefStore(FileStore(str(store)))
        metas.append(refstore.layer(refstore.resolve(LAYERS, "t@1")).meta.digest)
    assert metas[0] == metas[1]


def test_whiteouts_become_overlayfs_whiteouts(tmp_path, fstore):
    need_root()
    lower = tmp_path / "lower"
    (lower / "dir").mkdir(parents=True)
    (lower / "gone").write_text("lower")
    (lower / "kept").write_text("lower")
    (lower / "dir" / "old").write_text("lower")
    upper_tar = tmp_path / "upper.tar"
    upper_tar.write_bytes(tar_of([
        ("dir", None, {"type": tarfile.DIRTYPE, "mode": 0o755}),
        ("dir/.wh..wh..opq", b"", {}),
        ("dir/new", b"upper", {}),
        (".wh.gone", b"", {}),
    ]))
    low = build(fstore, str(lower), name="low")
    up = build(fstore, str(upper_tar), name="up")
    with mounted_layer(fstore, up.digest, str(tmp_path / "u")) as up_mnt, \
            mounted_layer(fstore, low.digest, str(tmp_path / "l")) as low_mnt:
        st = os.lstat(os.path.join(up_mnt, "gone"))
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
        assert os.getxattr(os.path.join(up_mnt, "dir"), "trusted.overlay.opaque") == b"y"
        merged = tmp_path / "merged"
        merged.mkdir()
        mount("overlay", str(merged), "overlay", 1, f"lowerdir={up_mnt}:{low_mnt}")
        try:
            assert sorted(os.listdir(merged)) == ["dir", "kept"]
            assert os.listdir(merged / "dir") == ["new"]
            assert (merged / "dir" / "new").read_text() == "upper"
        finally:
            umount(str(merged))


@pytest.mark.parametrize("entries,why", [
    ([("../evil", b"x", {})], "'..' in path"),
    ([("/etc/passwd", b"x", {})], "absolute path"),
    ([("a/../../b", b"x", {})], "'..' in path"),
    ([("l", None, {"type": tarfile.LNKTYPE, "linkname": "../outside"})], "hard link target"),
    ([("d/l", None, {"type": tarfile.SYMTYPE, "linkname": "../../etc/shadow"})], "escapes"),
    ([("d", None, {"type": tarfile.DIRTYPE, "mode": 0o755}),
      ("s", None, {"type": tarfile.SYMTYPE, "linkname": "d"}), ("s/f", b"x", {})],
     "below 's', which an earlier entry made a symlink"),
    ([("s", None, {"type": tarfile.SYMTYPE, "linkname": "/etc"}), ("s/cron.d/f", b"x", {})],
     "below 's', which an earlier entry made a symlink"),
    ([("a", None, {"type": tarfile.DIRTYPE, "mode": 0o755}),
      ("a/s", None, {"type": tarfile.SYMTYPE, "linkname": "."}),
      ("f", b"x", {}), ("a/s/l", None, {"type": tarfile.LNKTYPE, "linkname": "f"})],
     "below 'a/s', which an earlier entry made a symlink"),
    ([("f", b"x", {}), ("f/g", b"y", {})], "below 'f', which an earlier entry made not a"),
])
def test_unsafe_entries_are_refused(tmp_path, fstore, entries, why):
    path = tmp_path / "bad.tar"
    path.write_bytes(tar_of(entries))
    with pytest.raises(UnsafeTarEntry, match=re.escape(why)):
        build(fstore, str(path))
    assert RefStore(fstore).list_refs(LAYERS) == []


def test_a_reader_dependent_tree_is_one_error_line(tmp_path):
    """"symlink s -> d, then s/f": GNU tar writes d/f, a lazy mount would show
    a directory s; the build refuses it in one line, exit 3, nothing published."""
    path = tmp_path / "odd.tar"
    path.write_bytes(tar_of([("d", None, {"type": tarfile.DIRTYPE, "mode": 0o755}),
                             ("s", None, {"type": tarfile.SYMTYPE, "linkname": "d"}),
                             ("s/f", b"x", {})]))
    unpacked = tmp_path / "gnu"
    unpacked.mkdir()
    subprocess.run(["tar", "-xf", str(path), "-C", str(unpacked)], check=True)
    assert (unpacked / "d" / "f").read_bytes() == b"x"  # through the symlink
    url = f"file://{tmp_path}/store"
    proc = subprocess.run([sys.executable, "-m", "layerfs.cli.main", "build", str(path),
                           "--name", "odd", "--version", "1", "--store", url],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == UnsafeTarEntry.exit_code
    assert proc.stderr == ("layerfs: error: unsafe tar entry 's/f': below 's', which an "
                           "earlier entry made a symlink (readers would unpack it "
                           "differently)\n")
    assert RefStore(FileStore(str(tmp_path / "store"))).list_refs(LAYERS) == []


def test_a_whiteout_then_a_directory_at_its_name_is_taken(tmp_path, fstore):
    path = tmp_path / "replace.tar"
    path.write_bytes(tar_of([(".wh.s", b"", {}), ("s/f", b"x", {})]))
    result = build(fstore, str(path))
    assert result.manifest.stats.files == 1


def test_hard_link_to_missing_target(tmp_path, fstore):
    path = tmp_path / "bad.tar"
    path.write_bytes(tar_of([("l", None, {"type": tarfile.LNKTYPE, "linkname": "nothere"})]))
    with pytest.raises(SourceError, match="hard link to missing"):
        build(fstore, str(path))


def test_truncated_archive(tmp_path, fstore):
    data = tar_of([("big", os.urandom(200_000), {})])
    path = tmp_path / "cut.tar"
    path.write_bytes(data[:100_000])
    with pytest.raises(SourceError):
        build(fstore, str(path))
    assert RefStore(fstore).list_refs(LAYERS) == []



# --- where an archive may end: as Go's archive/tar (and so containerd) decides ------------


def _gzip(data: bytes) -> bytes:
    return gzip.compress(data)


def _layer_of(fstore, tmp_path, data: bytes, name: str) -> str:
    path = tmp_path / f"{name}.tar"
    path.write_bytes(data)
    return build(fstore, str(path), name=name).manifest.meta.digest


def test_archive_may_end_after_the_last_member_s_data(tmp_path, fstore):
    """No padding, part of it, no end blocks, one or two, a last member that is
    empty or whose data is skipped, gzip-compressed: the same layer as the
    whole archive (tarfile's output, padded to its 10 KiB record)."""
    endings = {**ENDINGS, "gzip, no padding": lambda: _gzip(cut_after_last(LAST_FILE))}
    got, want = {}, {}
    for i, (case, make) in enumerate(endings.items()):
        got[case] = _layer_of(fstore, tmp_path, make(), f"c{i}")
        want[case] = _layer_of(fstore, tmp_path, tar_of(ENDING_OF.get(case, LAST_FILE)),
                               f"w{i}")
    assert got == want


def test_archive_may_end_after_a_meta_header_as_go_reads_it(tmp_path, fstore):
    """Go's reader ends the archive where a GNU long name (or pax) header has no
    member after it; so does this one (the header is dropped)."""
    want = _layer_of(fstore, tmp_path, tar_of([("short", b"", {})]), "whole")
    got = [_layer_of(fstore, tmp_path, gnu_long_name_then_end(), "long"),
           _layer_of(fstore, tmp_path, pax_header_then_end(), "pax")]
    assert got == [want, want]


REFUSED = {
    "header cut short": "ends inside the header",
    "data short by one byte": "ends inside an entry's data",
    "unread data short by one byte": "ends inside an entry's data",
    "gzip, data short by one byte": "ends inside an entry's data",
    "end block cut short": "ends inside the header",
    "header after one zero block": "after a zero block",
    "GNU long name cut short": "ends inside an entry's data",
}


def test_member_cut_short_is_refused(tmp_path, fstore):
    """A header or an entry's data cut short is an error, and so is a zero block
    followed by a header or by part of a block; nothing is published."""
    cuts = {**CUT_SHORT, "gzip, data short by one byte":
            lambda: _gzip(cut_after_last(LAST_FILE, -1))}
    got = {}
    for i, (case, make) in enumerate(cuts.items()):
        path = tmp_path / f"bad{i}.tar"
        path.write_bytes(make())
        try:
            build(fstore, str(path), name=f"bad{i}")
            got[case] = "accepted"
        except SourceError as exc:
            got[case] = next((m for m in REFUSED.values() if m in str(exc)), str(exc))
    assert got == REFUSED
    assert RefStore(fstore).list_refs(LAYERS) == []
