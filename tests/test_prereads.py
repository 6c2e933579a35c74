"""The kernel mechanism for serving a partly fetched layer without FUSE, shown
on this kernel before the node builds on it (docs/dev/node.md, Local blob files):
a file-backed EROFS mount (``directio``) over a sparse local blob file marked
with a fanotify pre-content mark (``FAN_PRE_ACCESS``, Linux 6.14+). Each read
EROFS makes of the blob file stops in a permission event that carries its
range; the listener writes those bytes through the event's own descriptor
(which raises no event) and allows the read, which then returns them; a
denial with an errno fails the read with it. And why such a listener needs a
keeper: when the group's last descriptor closes, the kernel allows the
events still pending, and the reader gets the file's holes, zeros.

Tier: node (root, kernel EROFS mounts).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support import build, need_root

from layerfs.chunks import fetch_chunks
from layerfs.mounts import mount_erofs, umount
from layerfs.refstore import RefStore
from layerfs.store import open_store

FAN_CLOEXEC = 0x1
FAN_CLASS_PRE_CONTENT = 0x8
FAN_MARK_ADD = 0x1
FAN_PRE_ACCESS = 0x00100000
FAN_ALLOW, FAN_DENY = 0x1, 0x2
FAN_EVENT_INFO_TYPE_RANGE = 6
AT_FDCWD = -100
EVENT = struct.Struct("IBBHQii")  # fanotify_event_metadata
RESPONSE = struct.Struct("iI")  # fanotify_response

libc = ctypes.CDLL(None, use_errno=True)
libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int,
                               ctypes.c_char_p]


def deny(err: int) -> int:
    """FAN_DENY with the errno the reader gets (FAN_DENY_ERRNO)."""
    return FAN_DENY | (err & 0xFF) << 24


def pre_content_group(path: Path) -> int:
    """A pre-content group with a FAN_PRE_ACCESS mark on ``path``; its event
    descriptors open read-write (the listener fills the file through them)."""
    need_root()
    fd = libc.fanotify_init(FAN_CLASS_PRE_CONTENT | FAN_CLOEXEC, os.O_RDWR | os.O_LARGEFILE)
    if fd < 0:
        pytest.skip(f"no pre-content fanotify here: {os.strerror(ctypes.get_errno())}")
    if libc.fanotify_mark(fd, FAN_MARK_ADD, FAN_PRE_ACCESS, AT_FDCWD, bytes(path)) < 0:
        err = ctypes.get_errno()
        os.close(fd)
        pytest.skip(f"FAN_PRE_ACCESS refused on {path}: {os.strerror(err)}")
    return fd


Answer = Callable[[int, int, int], int]  # (event fd, offset, count) → response


def listen(group: int, answer: Answer, seen: list[tuple[int, int]]) -> None:
    """Thread: answer each event until the group is closed."""
    while True:
        try:
            buf = os.read(group, 8192)
        except OSError:
            return
        pos = 0
        while pos < len(buf):
            length, _, _, meta_len, _, efd, _ = EVENT.unpack_from(buf, pos)
            offset = count = -1
            info = pos + meta_len
            while info < pos + length:
                kind, _, info_len = struct.unpack_from("BBH", buf, info)
                if kind == FAN_EVENT_INFO_TYPE_RANGE:
                    offset, count = struct.unpack_from("QQ", buf, info + 8)
                info += info_len
            seen.append((offset, count))
            response = answer(efd, offset, count)
            os.close(efd)
            try:
                os.write(group, RESPONSE.pack(efd, response))
            except OSError:  # the group closed under it (a listener that died)
                return
            pos += length


@pytest.fixture
def layer(tmp_path):
    """A layer of 200 small files and one of 3 MiB: its meta image, its blob
    (whole, as a reference) and an empty sparse copy of the blob."""
    need_root()
    src = tmp_path / "src"
    for i in range(200):
        (src / f"d{i % 7}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 7}" / f"f{i}").write_bytes(os.urandom(500 + 37 * i))
    (src / "big").write_bytes(os.urandom(3 << 20))
    (tmp_path / "store").mkdir()
    store = open_store(f"file://{tmp_path / 'store'}")
    refstore = RefStore(store)
    manifest = refstore.layer(build(store, str(src)).digest)
    table = refstore.chunk_table(manifest)
    meta = tmp_path / "meta.img"
    meta.write_bytes(refstore.meta_image(manifest))
    whole = bytearray(table.blob_size)
    for entry, data in fetch_chunks(store, table.entries):
        whole[entry.blob_offset:entry.blob_offset + len(data)] = data
    sparse = tmp_path / "blob"
    with open(sparse, "wb") as f:
        f.truncate(table.blob_size)
    return src, meta, bytes(whole), sparse


@contextmanager
def mounted(meta: Path, blob: Path, target: Path) -> Iterator[Path]:
    target.mkdir(exist_ok=True)
    mount_erofs(str(meta), str(blob), str(target), directio=True)
    try:
        yield target
    finally:
        umount(str(target))


def files(top: Path) -> list[Path]:
    return sorted(p.relative_to(top) for p in top.rglob("*") if p.is_file())


def test_reads_of_an_erofs_backing_file_stop_in_events_that_the_listener_fills(layer,
                                                                              tmp_path):
    src, meta, whole, sparse = layer
    group = pre_content_group(sparse)
    seen: list[tuple[int, int]] = []

    def fill(efd: int, offset: int, count: int) -> int:
        os.pwrite(efd, whole[offset:offset + count], offset)  # no event: the event's fd
        return FAN_ALLOW

    threading.Thread(target=listen, args=(group, fill, seen), daemon=True).start()
    try:
        with mounted(meta, sparse, tmp_path / "mnt") as mnt:
            names = files(mnt)
            assert names == files(src)
            for name in names:
                assert (mnt / name).read_bytes() == (src / name).read_bytes()
    finally:
        os.close(group)
    assert seen and all(offset >= 0 and count > 0 for offset, count in seen)
    assert sparse.read_bytes() == whole  # the listener filled every byte the reads needed


def test_a_denied_read_fails_with_the_listener_s_errno(layer, tmp_path):
    src, meta, _, sparse = layer
    group = pre_content_group(sparse)
    threading.Thread(target=listen, args=(group, lambda *_: deny(errno.EIO), []),
                     daemon=True).start()
    try:
        with mounted(meta, sparse, tmp_path / "mnt") as mnt:
            with pytest.raises(OSError) as caught:
                (mnt / "big").read_bytes()
            assert caught.value.errno == errno.EIO
    finally:
        os.close(group)


def test_a_closed_group_allows_its_pending_events_and_the_reader_gets_holes(layer,
                                                                           tmp_path):
    """The hazard a node must design around: a listener that dies (its group's
    last descriptor closed) with an event pending lets the read through to
    the holes. So a daemon serving such files must leave its group with a
    keeper that outlives it, as its FUSE connection does."""
    src, meta, _, sparse = layer
    group = pre_content_group(sparse)
    taken = threading.Event()

    def die(efd: int, offset: int, count: int) -> int:
        taken.set()
        os.close(group)  # the listener is gone before it answers
        return FAN_ALLOW

    threading.Thread(target=listen, args=(group, die, []), daemon=True).start()
    with mounted(meta, sparse, tmp_path / "mnt") as mnt:
        got = (mnt / "big").read_bytes()
    assert taken.is_set()
    assert got == bytes(len(got)) != (src / "big").read_bytes()


def test_a_mapping_of_a_marked_file_raises_one_event_for_all_it_maps_and_none_on_faults(
        tmp_path):
    """Why a resumed guest's RAM is not a partial file the kernel fills on
    demand (docs/dev/node.md, Partial blob files): on this kernel ``mmap`` of
    a marked file raises one event for the whole mapped range before it
    returns, and the page faults after it raise none, so the listener must
    fill everything the VMM maps at once. A lazily served RAM stays a FUSE
    file, whose faults each reach the daemon."""
    size = 8 << 20
    ram = tmp_path / "ram"
    with open(ram, "wb") as f:
        f.truncate(size)
    group = pre_content_group(ram)
    seen: list[tuple[int, int]] = []
    threading.Thread(target=listen, args=(group, lambda *_: FAN_ALLOW, seen),
                     daemon=True).start()
    mapper = (f"import mmap, os\n"  # its own process: Python's mmap holds the GIL in mmap(2)
              f"fd = os.open({str(ram)!r}, os.O_RDWR)\n"
              f"m = mmap.mmap(fd, {size}, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)\n"
              f"print(len(open('/proc/self/maps').read()) > 0, flush=True)\n"
              f"input()\n"
              f"print(sum(m[at] for at in range(0, {size}, 4096)), flush=True)\n")
    child = subprocess.Popen([sys.executable, "-c", mapper], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "True"  # mapped
        mapped = list(seen)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "0"  # every page faulted in
        assert child.wait(10) == 0
    finally:
        child.kill()
        os.close(group)
    assert mapped == [(0, size)]  # the open raised none; the mmap one, for all of it
    assert seen == mapped  # the faults none
