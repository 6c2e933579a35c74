"""Partial blob files under stress and attack: readers streaming a larger
layer through a ``--takeover`` and through a daemon killed again and again
get every byte right (never an EIO, never a hole); a dead keeper's reads
fail with EIO or end right, never as the next keeper's; many reads leave the
daemon and the keeper with no more descriptors than before; a local
unprivileged user can neither read nor write the partial files, nor plant a
file or a link among them.

Tier: node (a real daemon, kernel EROFS and overlay mounts, fanotify; root).
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import build, need_root
from support.nodes import NodeDaemon, serving, take_over, wait_for
from support.nodes import up_lazy as up

from layerfs import fanotify
from layerfs.builder.env import create_env
from layerfs.refstore import RefStore

KEEPER = re.compile(r"the FUSE connection is kept by pid (\d+)")
BIG = ("big0", "big1", "big2")

# reads each file ROUNDS times, its cached pages dropped before each read (so
# that every read reaches the partial file: events); exits 1 at a wrong sum
STREAM = """
import hashlib, os, sys
top, rounds, sums = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
for r in range(rounds):
    for name, want in zip(("big0", "big1", "big2"), sums):
        fd = os.open(os.path.join(top, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            h = hashlib.sha256()
            while chunk := os.read(fd, 256 << 10):
                h.update(chunk)
        finally:
            os.close(fd)
        if h.hexdigest() != want:
            sys.exit(f"round {r}: {name} has wrong bytes")
print("ok")
"""


@pytest.fixture
def published(tmp_path, store) -> dict[str, str]:
    """Env e@1: a layer of three large files (larger than
    --fetch-whole-below) over a busybox base; their sums."""
    need_root()
    base = tmp_path / "base"
    for sub in ("bin", "proc", "dev", "tmp"):
        (base / sub).mkdir(parents=True)
    shutil.copy("/bin/busybox", base / "bin" / "busybox")
    rng = random.Random(35)
    sums = {}
    for name, size in zip(BIG, (6 << 20 | 99, 4 << 20, 3 << 20 | 5), strict=True):
        data = rng.randbytes(size)
        path = tmp_path / "dsrc" / "data" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        sums[name] = hashlib.sha256(data).hexdigest()
    build(store, str(base), name="base")
    build(store, str(tmp_path / "dsrc"), name="data")
    create_env(RefStore(store), "e", "1", ["data@1", "base@1"])
    return sums


def new_node(root: Path, store_location, read_timeout: float = 4.0) -> NodeDaemon:
    node = NodeDaemon(root, store_location.cli_args(), cache_size="256M",
                      read_timeout=read_timeout,
                      whole_below="1M", kernel_reads=True)
    node.extra_args = ["--restart-grace", "60"]
    return node


@pytest.fixture
def node(tmp_path, store_location, published) -> Iterator[NodeDaemon]:
    yield from serving(new_node(tmp_path / "node", store_location))


def data_hex(store) -> str:
    return RefStore(store).resolve("layers", "data@1").removeprefix("sha256:")


def stream(top: Path, sums: dict[str, str], rounds: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", STREAM, str(top), str(rounds),
                             *(sums[n] for n in BIG)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(readers: list[subprocess.Popen[str]]) -> None:
    for reader in readers:
        out, err = reader.communicate(timeout=120)
        assert reader.returncode == 0 and out.strip() == "ok", err


def test_readers_streaming_through_a_takeover_get_every_byte(node, published):
    """A live upgrade under reads: the old daemon leaves the events it has
    in hand to the keeper (for the next daemon), it does not deny them."""
    rootfs = up(node, "s1")
    readers = [stream(rootfs / "data", published, rounds=40) for _ in range(2)]
    try:
        wait_for(lambda: (node.root / "blobs" / "partial").exists(), "a partial file")
        for _ in range(2):
            take_over(node)
    finally:
        finished(readers)
    node.cli("down", "s1")


READ_ONE = """
import hashlib, sys
print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())
"""


def test_a_read_in_a_fill_at_a_takeover_is_answered_by_the_next_daemon(
        tmp_path, store_location, published, request):
    """The old daemon's fill of a read is cut short by the handover (its
    store does not answer): the read is left to the keeper, and the next
    daemon fills it; it is not denied (EIO). (The page cache retries a
    denied readahead once, which hid the denial from this reader; the
    test holds the path end to end: the read ends with the right bytes.)"""
    if store_location.endpoint is None:
        pytest.skip("needs a store server to pause")
    weed = request.getfixturevalue("s3_server").process
    node = new_node(tmp_path / "node", store_location, read_timeout=60).start()
    try:
        rootfs = up(node, "s1")
        old = node.proc
        weed.send_signal(signal.SIGSTOP)
        try:
            reader = subprocess.Popen([sys.executable, "-c", READ_ONE,
                                       str(rootfs / "data" / "big1")],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            wait_for(lambda: in_pre_content_wait(reader.pid), "the read to wait on its event")
            time.sleep(0.5)  # (the daemon has it, and waits on the store)
            node.extra_args = ["--takeover", "--restart-grace", "60"]
            node.start()
            assert old.wait(60) == 0
        finally:
            weed.send_signal(signal.SIGCONT)
        out, err = reader.communicate(timeout=120)
        assert reader.returncode == 0, err
        assert out.strip() == published["big1"]
        node.cli("down", "s1")
    finally:
        assert node.cleanup() == []


def in_pre_content_wait(pid: int) -> bool:
    """Whether process ``pid`` waits on a fanotify permission event."""
    return "fanotify" in Path(f"/proc/{pid}/stack").read_text()


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.daemon\.service: unmounted stale ")
def test_readers_streaming_while_the_daemon_is_killed_again_and_again(node, published):
    rootfs = up(node, "s1")
    readers = [stream(rootfs / "data", published, rounds=40) for _ in range(2)]
    try:
        for _ in range(4):
            node.kill()
            node.start()
    finally:
        finished(readers)
    assert len(set(KEEPER.findall(node.log()))) == 1  # one keeper throughout
    node.cli("down", "s1")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_many_reads_leave_no_descriptor_behind(node, published):
    rootfs = up(node, "s1")
    finished([stream(rootfs / "data", published, rounds=1)])  # every chunk present
    daemon, keeper = node.proc.pid, int(KEEPER.findall(node.log())[-1])
    before = open_fds(daemon), open_fds(keeper)
    finished([stream(rootfs / "data", published, rounds=30)])  # ~1500 events
    wait_for(lambda: (open_fds(daemon), open_fds(keeper)) <= before,
             f"the descriptors to be closed again ({before} before)", timeout=30)
    node.cli("down", "s1")


ATTEMPT = """
import os, sys
where, how = sys.argv[1], sys.argv[2]
try:
    if how == "read":
        os.close(os.open(where, os.O_RDONLY))
    elif how == "write":
        os.close(os.open(where, os.O_WRONLY))
    elif how == "link":
        os.symlink("/etc/passwd", where)
    elif how == "plant":
        os.close(os.open(where, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    elif how == "list":
        os.listdir(where)
    print("done")
except OSError as exc:
    print(os.strerror(exc.errno))
"""


@pytest.fixture
def open_parent(starts_a_server) -> Iterator[Path]:
    """Where ROOT lives: a directory everyone may traverse, like /var/lib."""
    parent = Path(tempfile.mkdtemp(prefix="review-node-"))
    os.chmod(parent, 0o711)
    try:
        yield parent
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_a_local_user_cannot_touch_the_partial_files(open_parent, store_location, published,
                                                     store, local_user):
    """Even with ROOT opened to traversal by mistake, the partial files (the
    bytes of every layer's 0600 files, and what the kernel serves once a
    chunk counts present) stay root's alone."""
    node = new_node(open_parent / "node", store_location).start()
    try:
        rootfs = up(node, "s1")
        finished([stream(rootfs / "data", published, rounds=1)])
        partial_dir = node.root / "blobs" / "partial"
        partial = partial_dir / data_hex(store)
        os.chmod(node.root, 0o711)
        os.chmod(node.root / "blobs", 0o711)
        tries = {"read": partial, "write": partial, "link": partial_dir / ("0" * 64),
                 "plant": partial_dir / ("1" * 64), "list": partial_dir}
        got = {how: local_user.python(ATTEMPT, str(where), how).stdout.decode().strip()
               for how, where in tries.items()}
        assert got == dict.fromkeys(tries, "Permission denied")
        st = partial.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600)
        assert partial_dir.stat().st_mode & 0o777 == 0o700
        assert sums_of_big(rootfs / "data") == published
        node.cli("down", "s1")
    finally:
        assert node.cleanup() == []


def sums_of_big(top: Path) -> dict[str, str]:
    return {n: hashlib.sha256((top / n).read_bytes()).hexdigest() for n in BIG}


# many readers at once, each of one page of its own (no readahead): one event each
SCATTERED = """
import os, sys, threading
path, source, count, step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
want = open(source, "rb").read()
results = [None] * count
def read(i):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        got = os.pread(fd, 4096, i * step)
        results[i] = "ok" if got == want[i * step:i * step + 4096] else "wrong bytes"
    except OSError as exc:
        results[i] = os.strerror(exc.errno)
    finally:
        os.close(fd)
threads = [threading.Thread(target=read, args=(i,)) for i in range(count)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("|".join(sorted(set(map(str, results)))))
"""


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.fuse\.keeper: ")
def test_a_keeper_out_of_descriptors_fails_reads_and_lives(node, published, tmp_path):
    """More pending reads than the keeper may hold descriptors: the kernel
    denies the ones it cannot hand over (the reader gets EIO), the keeper lives on, and
    the daemon answers the others with the right bytes."""
    rootfs = up(node, "s1")
    keeper = int(KEEPER.findall(node.log())[-1])
    limit = max(map(int, os.listdir(f"/proc/{keeper}/fd"))) + 6
    subprocess.run(["prlimit", f"--pid={keeper}", f"--nofile={limit}:{limit}"], check=True)
    os.kill(node.proc.pid, signal.SIGSTOP)  # events pile up with the keeper
    try:
        reader = subprocess.Popen([sys.executable, "-c", SCATTERED,
                                   str(rootfs / "data" / "big0"),
                                   str(tmp_path / "dsrc" / "data" / "big0"), "40", str(128 << 10)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: open_fds(keeper) >= limit - 2, "the keeper's descriptors to run out")
        time.sleep(0.5)  # (and the kernel to deny reads it cannot hand over)
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)
    out, err = reader.communicate(timeout=60)
    assert reader.returncode == 0, err
    assert set(out.strip().split("|")) <= {"ok", "Input/output error"}
    os.kill(keeper, 0)  # alive
    assert "the FUSE keeper exited" not in node.log()
    assert sums_of_big(rootfs / "data") == published
    node.cli("down", "s1")


# opens the file, says so, waits for a line on stdin, then reads 64 KiB at OFFSET
HELD_READ = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
print("open", flush=True)
sys.stdin.readline()
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
try:
    data = os.pread(fd, 65536, int(sys.argv[2]))
    print("zeros" if data.count(0) == len(data) else "data")
except OSError as exc:
    print(os.strerror(exc.errno))
"""


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.daemon\.service: unmounted stale ",
                        r"WARNING layerfs\.node\.fuse\.keeper: no daemon took the FUSE",
                        r"WARNING layerfs\.node\.fuse\.keeper: the keeper keeps the pre",
                        r"WARNING layerfs\.node\.reads\.partialblobs: a read of a file that "
                        r"is no partial blob")
def test_a_lingering_group_taken_with_kernel_reads_off_still_answers(tmp_path, store_location,
                                                                     published):
    """A daemon that starts with --no-kernel-reads and finds a keeper lingering
    with marked files (a detached mount a process still reads) takes the
    group: its events must still be answered (EIO), never left waiting, nor
    the group held unread (its end would let the holes through)."""
    node = new_node(tmp_path / "node", store_location)
    node.extra_args = ["--restart-grace", "1"]
    node.start()
    holder = None
    try:
        rootfs = up(node, "s1")
        holder = subprocess.Popen([sys.executable, "-c", HELD_READ,
                                   str(rootfs / "data" / "big2"), "65536"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "open"
        node.kill()  # no daemon within the grace: the keeper lets FUSE go and lingers
        wait_for(lambda: "the keeper keeps the pre" in node.log(), "the keeper to linger")
        node.fixed_args = ["--fetch-whole-below", "1M", "--no-kernel-reads"]
        node.start()  # takes the group alone; detaches the old mounts (the holder's stays)
        holder.stdin.write("\n")
        holder.stdin.flush()
        out, _ = holder.communicate(timeout=30)
        assert out.strip() == "Input/output error"
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
        assert node.cleanup() == []


# a keeper's stand-in: reads one event of the group it inherits, prints its
# number, and allows it when told to (a line "allow" on stdin)
ONE_EVENT_READER = """
import os, select, sys
from layerfs import fanotify
group = int(sys.argv[1])
while not (events := fanotify.read_events(group)):
    select.select([group], [], [])
print(events[0].fd, flush=True)
if sys.stdin.readline().strip() == "allow":
    fanotify.respond(group, events[0].fd, 0)
    print("allowed", flush=True)
sys.stdin.readline()
"""

# reads 4 KiB at OFFSET of a file: "data", or the error
READ_AT = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
try:
    os.pread(fd, 4096, int(sys.argv[2]))
    print("data")
except OSError as exc:
    print(os.strerror(exc.errno))
"""


def test_a_dead_readers_events_fail_and_none_is_let_through_as_the_nexts(tmp_path):
    """The kernel matches an answer to the oldest event of its number, and a
    new reader of the group is given the numbers a dead one had: answering
    the new reader's event would let the dead one's read through to the
    file's holes. fanotify.deny_all (the daemon's step before a new keeper)
    fails the dead reader's events first, so the number then means the new
    event alone."""
    need_root()
    path = tmp_path / "partial"
    with open(path, "wb") as f:
        f.truncate(4 << 20)  # holes only: a read let through gets zeros
    group = fanotify.new_group()
    writer = os.open(path, os.O_RDWR)
    procs: list[subprocess.Popen[str]] = []

    def start(*argv: str) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": str(Path(fanotify.__file__).parents[1])}
        procs.append(subprocess.Popen([sys.executable, "-c", *argv], pass_fds=[group], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True))
        return procs[-1]

    try:
        fanotify.mark(group, writer)
        first_keeper = start(ONE_EVENT_READER, str(group))
        first_read = start(READ_AT, str(path), "0")
        assert first_keeper.stdout is not None
        number = int(first_keeper.stdout.readline())
        first_keeper.kill()
        first_keeper.wait(10)
        wait_for(lambda: in_pre_content_wait(first_read.pid), "the read to wait on its event")

        assert fanotify.deny_all(group, fanotify.numbers_below()) == 1
        assert first_read.communicate(timeout=10)[0].strip() == "Input/output error"

        next_keeper = start(ONE_EVENT_READER, str(group))
        next_read = start(READ_AT, str(path), str(1 << 20))
        assert next_keeper.stdout is not None and next_keeper.stdin is not None
        assert int(next_keeper.stdout.readline()) == number  # the same number, given again
        next_keeper.stdin.write("allow\n")
        next_keeper.stdin.flush()
        assert next_keeper.stdout.readline() == "allowed\n"
        assert next_read.communicate(timeout=10)[0].strip() == "data"
        assert fanotify.deny_all(group, fanotify.numbers_below()) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        os.close(writer)
        os.close(group)


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.daemon\.service: the FUSE keeper exited; "
                        r"starting another")
def test_reads_a_killed_keeper_had_handed_on_are_answered_and_the_next_keeper_serves(
        node, published, tmp_path):
    """The keeper is killed while the daemon has 40 of its events in hand
    (the daemon stopped: they wait in the lease): each read ends with the
    right bytes or EIO, none waits for ever, none gets holes; the next
    keeper's reads are answered as before."""
    rootfs = up(node, "s1")
    keeper = int(KEEPER.findall(node.log())[-1])
    os.kill(node.proc.pid, signal.SIGSTOP)
    try:
        reader = subprocess.Popen([sys.executable, "-c", SCATTERED,
                                   str(rootfs / "data" / "big0"),
                                   str(tmp_path / "dsrc" / "data" / "big0"), "40", str(128 << 10)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: open_fds(keeper) >= 40, "the keeper to hold the reads' events")
        os.kill(keeper, signal.SIGKILL)
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)
    out, err = reader.communicate(timeout=60)
    assert reader.returncode == 0, err
    assert set(out.strip().split("|")) <= {"ok", "Input/output error"}
    wait_for(lambda: len(set(KEEPER.findall(node.log()))) == 2, "the next keeper")
    assert sums_of_big(rootfs / "data") == published
    node.cli("down", "s1")
