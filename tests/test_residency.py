"""Which pages of a file a process has mapped in (``layerfs/node/vms/residency.py``),
read from its page tables: a file mapped by a child process (another
process, as the VMM is to the daemon) that touches some pages, shared and
private, and an untouched region far from them; a file the process does not
map; a mapping read up to the file's size only; what cannot be known (a
process gone or another under its pid, a deadline passed, too many
mappings). Also the VMM's process found as the peer of its
QMP socket (``snapshots.peer_pid``), which chunks of a snapshot layer a
working set keeps (``drivesets.touched_chunk``), and the node falling back
to every chunk read where the VMM's pages are not known. Unit tier: no mount, no guest; the
guests' working sets are tests/test_vm.py's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import trio

from layerfs.formats.chunktable import ChunkEntry
from layerfs.formats.lsmt import HT_SPACE
from layerfs.node.protocol import VmRam
from layerfs.node.vms.drivesets import Vms, touched_chunk
from layerfs.node.vms.residency import (
    MAX_MAPPINGS,
    PAGE,
    NotKnown,
    Process,
    resident_runs,
    start_time,
    touches,
)
from layerfs.node.vms.snapshots import peer_pid

MiB = 1 << 20
CHILD = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
shared = mmap.mmap(fd, 64 << 20, mmap.MAP_SHARED)
private = mmap.mmap(fd, 16 << 20, mmap.MAP_PRIVATE, offset=32 << 20)
shared[5 << 20] = 1          # a write through the shared mapping
shared[9 << 20]              # a read
private[1 << 20]             # a read at 33 MiB of the file, through the private one
more = [mmap.mmap(fd, 1 << 20, mmap.MAP_SHARED) for _ in range(int(sys.argv[2]))]
print("ready", flush=True)
sys.stdin.readline()
"""
SIZE = 64 * MiB


def later() -> float:
    return time.monotonic() + 30


def start_mapper(path, more: int = 0) -> subprocess.Popen:
    """A child process that maps a 64 MiB file and touches three of its
    pages (and maps its first MiB ``more`` times more)."""
    with open(path, "wb") as f:
        f.truncate(SIZE)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(more)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


@pytest.fixture
def mapper(tmp_path):
    proc = start_mapper(tmp_path / "ram")
    try:
        yield Process(proc.pid, start_time(proc.pid)), os.stat(tmp_path / "ram")
    finally:
        proc.kill()
        proc.wait()


def test_the_pages_it_touched(mapper):
    proc, st = mapper
    runs = resident_runs(proc, st.st_dev, st.st_ino, SIZE, later())
    for touched in (5 * MiB, 9 * MiB, 33 * MiB):
        assert touches(runs, touched, PAGE), (touched, runs)
    assert not touches(runs, 48 * MiB, 16 * MiB)  # never touched
    assert not touches(runs, 20 * MiB, 8 * MiB)
    # each touch maps its page and, at most, cached neighbours (the kernel's fault-around)
    assert sum(length for _, length in runs) <= 3 * 2 * MiB
    assert runs == sorted(runs)
    # joined where they touch
    assert all(a + la < b for (a, la), (b, _) in zip(runs, runs[1:], strict=False))


def test_a_file_it_does_not_map(mapper, tmp_path):
    proc, _ = mapper
    other = tmp_path / "other"
    other.write_bytes(b"x" * PAGE)
    st = os.stat(other)
    assert resident_runs(proc, st.st_dev, st.st_ino, PAGE, later()) == []


def test_only_the_files_size_counts(mapper):
    """A mapping is read up to the file's end at most (a size given smaller
    than the file: what lies past it is not looked at)."""
    proc, st = mapper
    runs = resident_runs(proc, st.st_dev, st.st_ino, 8 * MiB, later())
    assert touches(runs, 5 * MiB, PAGE) and not touches(runs, 8 * MiB, 56 * MiB)


def test_not_known(mapper, tmp_path):
    """A process gone, another process under the pid (its start time not
    the one given), a deadline passed, too many mappings: not known."""
    proc, st = mapper
    with pytest.raises(NotKnown):
        resident_runs(Process(proc.pid, proc.start + 1), st.st_dev, st.st_ino, SIZE, later())
    with pytest.raises(NotKnown):
        resident_runs(proc, st.st_dev, st.st_ino, SIZE, time.monotonic() - 1)
    many = start_mapper(tmp_path / "many", more=MAX_MAPPINGS)
    try:
        st_many = os.stat(tmp_path / "many")
        with pytest.raises(NotKnown):
            resident_runs(Process(many.pid, start_time(many.pid)), st_many.st_dev,
                          st_many.st_ino, SIZE, later())
    finally:
        many.kill()
        many.wait()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(OSError):
        resident_runs(Process(gone.pid, 0), st.st_dev, st.st_ino, SIZE, later())
    assert Process.of(gone.pid) is None and Process.of(0) is None


def test_touches():
    runs = [(0, PAGE), (10 * PAGE, 2 * PAGE)]
    assert touches(runs, 0, 1)
    assert not touches(runs, PAGE, 9 * PAGE)  # the gap between them
    assert touches(runs, PAGE, 9 * PAGE + 1)
    assert touches(runs, 11 * PAGE, PAGE)
    assert not touches(runs, 12 * PAGE, MiB)
    assert not touches([], 0, MiB)


def test_the_peer_of_a_socket(tmp_path):
    """The VMM's process is the peer of its QMP socket: the one that listens."""
    path = str(tmp_path / "qmp")
    server = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen()\n"
        "print('up', flush=True); c, _ = s.accept(); c.recv(1)\n"), path],
        stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "up\n"
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(path)
            assert peer_pid(sock) == server.pid
    finally:
        server.kill()
        server.wait()


def test_a_snapshot_chunk_touched():
    """A snapshot layer's chunk (its RAM at the blob's offsets less the
    header space) counts when it meets a touched page; one past the RAM
    (the device state's, the header's) always does."""
    ram = 8 * MiB

    def chunk(ram_offset: int) -> ChunkEntry:
        return ChunkEntry(HT_SPACE + ram_offset, 256 << 10, b"\0" * 32, "sha256:" + "0" * 64,
                          0, 256 << 10, 0)

    touched = [(MiB + 8 * PAGE, PAGE)]
    assert touched_chunk(chunk(MiB), ram, touched)
    # a real layer's chunks: at blob offsets k * 256 KiB, RAM (k * 256 KiB - HT_SPACE)
    real = ChunkEntry(256 << 10, 256 << 10, b"\0" * 32, "sha256:" + "0" * 64, 0, 256 << 10, 0)
    assert touched_chunk(real, ram, [((256 << 10) - HT_SPACE, PAGE)])
    assert not touched_chunk(real, ram, [((512 << 10) - HT_SPACE, PAGE)])
    assert not touched_chunk(chunk(MiB - (256 << 10)), ram, touched)
    assert not touched_chunk(chunk(2 * MiB), ram, touched)
    assert touched_chunk(chunk(ram), ram, touched)  # the state area
    assert touched_chunk(chunk(ram - PAGE), ram, [])  # across the RAM's end


def test_the_node_falls_back_to_every_chunk_read(mapper, tmp_path, caplog):
    """``Vms._touched_ram`` (on a stand-in for the rest of ``Vms``): the
    VMM's pages where they can be read; not known (None, one info line)
    where the VMM is not, where another read holds the node's one slot, or
    where the process maps none of the file."""
    proc, st = mapper
    ram = VmRam(path=str(tmp_path / "ram"), size=SIZE, share=True, qmp=str(tmp_path / "qmp"))
    node = SimpleNamespace(_page_tables=trio.CapacityLimiter(1))

    async def touched(vmm, ram=ram):
        return await Vms._touched_ram(node, "v1", ram, vmm)  # type: ignore[arg-type]

    runs = trio.run(touched, proc)
    assert runs and touches(runs, 9 * MiB, PAGE)
    caplog.set_level("INFO")
    assert trio.run(touched, None) is None

    async def busy():
        async with node._page_tables:
            return await touched(proc)

    assert trio.run(busy) is None
    other = tmp_path / "other"
    other.write_bytes(b"x" * PAGE)
    assert trio.run(touched, proc, VmRam(path=str(other), size=PAGE, share=True, qmp="")) is None
    lines = [r.getMessage() for r in caplog.records if "are not known" in r.getMessage()]
    assert len(lines) == 3, lines
    assert "peer is not known" in lines[0] and "another vm's" in lines[1]
    assert "maps none of it" in lines[2]
