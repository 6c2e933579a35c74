"""The mount table: mount points with escaped and non-ASCII names read back as
the paths they are. Overlays of more lowers than one page of options names,
up to overlayfs's limit, and its refusal beyond in the kernel's words. A kernel
without ``lowerdir+`` (forced) gets mount(2) while the options fit a page."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
from support import need_root

from layerfs import mounts
from layerfs.mounts import (
    MAX_LOWER_LAYERS,
    Overlay,
    fs_type,
    mount,
    mount_overlay,
    mount_table,
    mounts_under,
    umount,
)


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


def lower_dirs(base: Path, count: int) -> list[str]:
    """``count`` lower directories with 64-character names (as ROOT/layers/<hex>),
    top first: each holds ``n<k>`` and its own ``top``."""
    lowers = []
    for k in range(count):
        lower = base / f"{k:064d}"
        lower.mkdir(parents=True)
        (lower / f"n{k}").write_text(str(k))
        (lower / "top").write_text(str(k))
        lowers.append(str(lower))
    return lowers


def test_an_overlay_of_500_lowers_mounts_nosuid_nodev_and_501_is_the_kernels_refusal(tmp_path):
    need_root()
    lowers = lower_dirs(tmp_path / "layers", MAX_LOWER_LAYERS + 1)
    assert len(",".join(lowers)) > 8 * os.sysconf("SC_PAGE_SIZE")
    for sub in ("upper", "work", "merged"):
        (tmp_path / sub).mkdir()
    merged = str(tmp_path / "merged")
    overlay = Overlay(lowers[:MAX_LOWER_LAYERS], str(tmp_path / "upper"), str(tmp_path / "work"),
                      (("redirect_dir", "nofollow"), ("metacopy", "off")))
    mount_overlay(overlay, merged)
    try:
        assert len(os.listdir(merged)) == MAX_LOWER_LAYERS + 1
        assert (tmp_path / "merged" / "top").read_text() == "0"  # the first lower is the top
        with open("/proc/self/mountinfo") as f:
            fields = [line.split() for line in f if line.split()[4] == merged]
        assert len(fields) == 1 and {"nosuid", "nodev"} <= set(fields[0][5].split(","))
        assert fields[0][fields[0].index("-") + 1:][:2] == ["overlay", "overlay"]
    finally:
        umount(merged)
    with pytest.raises(OSError) as refused:
        mount_overlay(Overlay(lowers), merged)
    assert refused.value.errno == errno.EINVAL
    assert "too many lower directories, limit is 500" in str(refused.value)
    assert mounts_under(tmp_path) == []


def without_lowerdir_plus(real):
    """The syscall function of a kernel whose overlayfs lacks ``lowerdir+``
    (Linux 6.5 to 6.7): its fsconfig of one is EINVAL."""
    import ctypes

    def syscall(number, *args):
        if number == mounts.SYS_FSCONFIG and len(args) > 2 and args[2] == b"lowerdir+":
            ctypes.set_errno(errno.EINVAL)
            return -1
        return real(number, *args)

    return syscall


def test_a_kernel_without_lowerdir_plus_gets_mount2_while_the_options_fit_a_page(
        tmp_path, monkeypatch):
    need_root()
    monkeypatch.setattr(mounts, "_syscall", without_lowerdir_plus(mounts._syscall))
    lowers = lower_dirs(tmp_path / "layers", 3)
    for sub in ("upper", "work", "merged"):
        (tmp_path / sub).mkdir()
    merged = str(tmp_path / "merged")
    mount_overlay(Overlay(lowers, str(tmp_path / "upper"), str(tmp_path / "work")), merged)
    try:
        assert sorted(os.listdir(merged)) == ["n0", "n1", "n2", "top"]
        assert (tmp_path / "merged" / "top").read_text() == "0"
        with open("/proc/self/mountinfo") as f:
            fields = [line.split() for line in f if line.split()[4] == merged]
        assert len(fields) == 1 and {"nosuid", "nodev"} <= set(fields[0][5].split(","))
    finally:
        umount(merged)
    many = lower_dirs(tmp_path / "many", 80)  # 80 names of 64+ characters: over a page
    assert len(Overlay(many).option_string()) >= mounts.PAGE_SIZE
    with pytest.raises(OSError, match="no lowerdir\\+ in overlayfs, and the options of its 80"):
        mount_overlay(Overlay(many), merged)
    assert mounts_under(tmp_path) == []


def test_the_kernels_own_refusals_of_lowerdir_plus_are_not_taken_for_an_old_kernel(tmp_path):
    need_root()
    (tmp_path / "merged").mkdir()
    with pytest.raises(OSError) as refused:
        mount_overlay(Overlay([str(tmp_path / "missing")]), str(tmp_path / "merged"))
    assert refused.value.errno == errno.ENOENT and "lowerdir+" in str(refused.value)


@pytest.mark.daemon_log(r"WARNING layerfs\.mounts: cannot set the readahead window")
def test_a_readahead_window_that_cannot_be_written_is_one_warning(tmp_path, monkeypatch, caplog):
    """A read-only /sys (a container's) keeps the kernel's window: the mount
    goes on, and one warning says so however many mounts follow."""
    import layerfs.mounts as mounts

    for name in ("erofs-1", "erofs-2"):
        (tmp_path / name / "read_ahead_kb").mkdir(parents=True)  # open(..., "w") fails
    monkeypatch.setattr(mounts, "BDI", str(tmp_path))
    monkeypatch.setattr(mounts, "_readahead_warned", False)
    with caplog.at_level(logging.WARNING, logger="layerfs.mounts"):
        mounts._write_readahead("erofs-1", 1 << 20)
        mounts._write_readahead("erofs-2", 1 << 20)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "kernel's default is used" in warned[0]


def test_an_erofs_entry_gone_before_its_window_is_written_is_no_warning(tmp_path, monkeypatch,
                                                                        caplog):
    """The new ``erofs-N`` entries seen around a mount may include another
    process's mount, unmounted since: its entry is gone, and that is no warning."""
    import layerfs.mounts as mounts

    monkeypatch.setattr(mounts, "BDI", str(tmp_path))
    monkeypatch.setattr(mounts, "_readahead_warned", False)
    (tmp_path / "erofs-2").mkdir()
    with caplog.at_level(logging.WARNING, logger="layerfs.mounts"):
        mounts._write_readahead("erofs-1", 1 << 20)  # gone
        mounts._write_readahead("erofs-2", 1 << 20)  # there
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert (tmp_path / "erofs-2" / "read_ahead_kb").read_text() == "1024"


def test_an_erofs_entry_going_as_its_window_is_written_is_no_warning(monkeypatch, caplog):
    """The entry of a mount another process unmounts right then: the write
    finds its device unregistered (ENODEV). Not ours, and no warning."""
    import io

    import layerfs.mounts as mounts

    class Going(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(mounts, "open", lambda path, mode: Going(), raising=False)
    monkeypatch.setattr(mounts, "_readahead_warned", False)
    with caplog.at_level(logging.WARNING, logger="layerfs.mounts"):
        mounts._write_readahead("erofs-3", 1 << 20)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
