"""Which pages of a file a process has mapped in (``layerfs/node/vms/residency.py``),
read from its page tables: a file mapped by a child process (another
process, as the VMM is to the daemon) that touches some pages, shared and
private, and an untouched region far from them; a file the process does not
map; a process that is gone. Also the VMM's process found as the peer of its
QMP socket (``snapshots.peer_pid``), and which chunks of a snapshot layer
a working set keeps (``drivesets.touched_chunk``). Unit tier: no mount, no guest; the
guests' working sets are tests/test_vm.py's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from layerfs.formats.chunktable import ChunkEntry
from layerfs.formats.lsmt import HT_SPACE
from layerfs.node.vms.drivesets import touched_chunk
from layerfs.node.vms.residency import PAGE, resident_runs, touches
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
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def mapper(tmp_path):
    """A child process that maps a 64 MiB file and touches three of its pages."""
    path = tmp_path / "ram"
    with open(path, "wb") as f:
        f.truncate(64 * MiB)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc, os.stat(path)
    finally:
        proc.kill()
        proc.wait()


def test_the_pages_it_touched(mapper):
    proc, st = mapper
    runs = resident_runs(proc.pid, st.st_dev, st.st_ino)
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
    assert resident_runs(proc.pid, st.st_dev, st.st_ino) == []


def test_a_process_that_is_gone(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    st = os.stat(tmp_path)
    with pytest.raises(OSError):
        resident_runs(proc.pid, st.st_dev, st.st_ino)


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
    assert not touched_chunk(chunk(MiB - (256 << 10)), ram, touched)
    assert not touched_chunk(chunk(2 * MiB), ram, touched)
    assert touched_chunk(chunk(ram), ram, touched)  # the state area
    assert touched_chunk(chunk(ram - PAGE), ram, [])  # across the RAM's end
