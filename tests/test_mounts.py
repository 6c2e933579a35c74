"""The mount table: mount points with escaped and non-ASCII names read back as
the paths they are."""

from __future__ import annotations

from support import need_root

from layerfs.mounts import fs_type, mount, mount_table, mounts_under, umount


def test_mount_points_with_spaces_and_non_ascii_names(tmp_path):
    need_root()
    point = tmp_path / "a b\tnaïve"
    inner = point / "ünder"
    point.mkdir()
    mount("tmpfs", str(point), "tmpfs")
    try:
        inner.mkdir()
        mount("tmpfs", str(inner), "tmpfs")
        try:
            assert mounts_under(tmp_path) == [str(inner), str(point)]
            assert fs_type(inner / "x") == "tmpfs"
            assert [m.fstype for m in mount_table() if m.point == str(point)] == ["tmpfs"]
        finally:
            umount(str(inner))
    finally:
        umount(str(point))
    assert mounts_under(tmp_path) == []
