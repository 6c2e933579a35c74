"""layerfs/safeopen.py's strict walk where openat2(2) is missing (an older
kernel, or a seccomp filter that does not know the call, as systemd-nspawn's
in systemd 252): the same refusals as openat2 with ``RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS``, name by name.

Tier: unit (no root, no server).
"""

from __future__ import annotations

import errno
import os

import pytest

from layerfs import safeopen


@pytest.fixture(params=["openat2", "walk"])
def opener(request, monkeypatch):
    """``safeopen.openat2`` as the kernel does it, and with the call missing."""
    if request.param == "walk":
        monkeypatch.setattr(safeopen, "SYS_OPENAT2", {})
    return safeopen


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "f").write_bytes(b"data")
    (tmp_path / "outside").write_bytes(b"secret")
    (tmp_path / "d" / "link").symlink_to(tmp_path / "outside")
    (tmp_path / "d" / "dirlink").symlink_to(tmp_path / "d" / "e")
    os.mkfifo(tmp_path / "d" / "fifo")
    fd = os.open(tmp_path / "d", os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def test_a_regular_file_beneath_opens(opener, tree):
    fd = opener.open_regular(tree, "e/f")
    try:
        assert os.read(fd, 10) == b"data"
    finally:
        os.close(fd)


@pytest.mark.parametrize(("path", "errnos"), [
    ("link", {errno.EINVAL}), ("dirlink/f", {errno.ELOOP, errno.ENOTDIR}),
    ("../outside", {errno.EXDEV}), ("/etc/passwd", {errno.EXDEV})])
def test_symlinks_and_escapes_are_refused(opener, tree, path, errnos):
    """A symlink at the end is seen, not followed (not a regular file: EINVAL)."""
    with pytest.raises(OSError) as caught:
        os.close(opener.open_regular(tree, path))
    assert caught.value.errno in errnos


def test_a_read_open_of_a_symlink_fails(opener, tree):
    with pytest.raises(OSError) as caught:
        os.close(opener.openat2(tree, "link", safeopen.READ_FLAGS, safeopen.STRICT))
    assert caught.value.errno == errno.ELOOP


def test_a_fifo_is_refused_without_being_opened(opener, tree):
    with pytest.raises(safeopen.NotRegular):
        opener.open_regular(tree, "fifo")
