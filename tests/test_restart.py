"""Live restart for real: the FUSE connection, and every EROFS, overlay and
loop mount above it, outlives a `kill -9` of the daemon and a `--takeover`.

The load of the two switch tests: 8 readers streaming large files through
two sandboxes (each pass drops the page cache first, so every pass asks the
daemon again), a process holding files open in a sandbox, and ext4 on a loop
device over a writable disk being written and fsynced. Each of those takes
about 20 s on either store; the others, on files of two chunks each, 5-15 s.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import build, need_root
from support.nodes import NodeDaemon, take_over, wait_for
from support.storeaway import GatedRelay

from harness.daemonproc import LAYERFS
from layerfs.builder.env import create_env
from layerfs.node.daemon.service import mounts_under
from layerfs.refstore import RefStore

MiB = 1 << 20
FILES = 4  # per sandbox
FILE_SIZE = 12 * MiB  # under load: a reader's pass lasts long enough to span a switch
SMALL_FILE_SIZE = 2 * MiB  # two chunks: enough for the tests without the load
KEEPER = re.compile(r"the FUSE connection is kept by pid (\d+)")

# a reader: passes over one file (page cache dropped first) until STOP exists,
# then one more; each pass's sha256 must be the file's; any error exits 1
READER = textwrap.dedent("""
    import hashlib, os, sys, time
    path, want, stop, progress = sys.argv[1:]
    passes = 0
    def one_pass():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            h = hashlib.sha256()
            while chunk := os.read(fd, 256 * 1024):
                h.update(chunk)
        finally:
            os.close(fd)
        if h.hexdigest() != want:
            sys.exit(f"pass {passes}: sha256 {h.hexdigest()}, want {want}")
    while not os.path.exists(stop):
        one_pass()
        passes += 1
        with open(progress, "w") as f:
            f.write(str(passes))
    one_pass()
    print(passes + 1)
""")

# a process with files open in a sandbox: reads half of a file, then, on a
# line on stdin, the rest through the same descriptor, and appends to an upper file
HOLDER = textwrap.dedent("""
    import hashlib, os, sys
    data, note = sys.argv[1:]
    f = open(data, "rb")
    out = open(note, "a")
    h = hashlib.sha256(f.read(os.path.getsize(data) // 2))
    print("ready", flush=True)
    sys.stdin.readline()
    h.update(f.read())
    out.write("after the switch\\n")
    out.flush()
    os.fsync(out.fileno())
    print(h.hexdigest(), flush=True)
""")

# a writer on the ext4 mount: writes and fsyncs numbered files until STOP
WRITER = textwrap.dedent("""
    import os, sys
    mnt, stop = sys.argv[1:]
    n = 0
    while not os.path.exists(stop) or n < 40:
        data = bytes([n % 251]) * (256 * 1024 + n)
        with open(os.path.join(mnt, f"w{n}"), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        n += 1
    print(n)
""")


@dataclass
class Load:
    """The processes running on the node while its daemon is switched."""

    readers: list[subprocess.Popen]
    holder: subprocess.Popen
    writer: subprocess.Popen
    stop: Path
    progress: list[Path]
    data_sha: str
    mnt: Path


def live_node(tmp_path: Path, store, store_location, file_size: int,
              kernel_reads: bool = False):
    """Layer big@1 (8 files of ``file_size``), env e@1, and a daemon with
    sandboxes s1 and s2 up and a writable disk w (a fixture's life); with
    ``kernel_reads``, the layer is over its partial blob file (fanotify, the
    keeper holding the group), else over its FUSE blob file."""
    need_root()
    src = tmp_path / "big"
    (src / "data").mkdir(parents=True)
    for i in range(2 * FILES):
        (src / "data" / f"f{i}").write_bytes(os.urandom(file_size))
    build(store, str(src), name="big", chunk_size=MiB)
    create_env(RefStore(store), "e", "1", ["big@1"])
    node = NodeDaemon(tmp_path / "node", store_location.cli_args(), cache_size="1G",
                      kernel_reads=kernel_reads).start()
    node.src = src
    try:
        for sid in ("s1", "s2"):
            node.cli("up", "e@1", "--id", sid)
        node.cli("disk", "create", "w", "--size", "64M")
        layers = node.request("stats")["layers"].values()
        assert [layer["partial"] for layer in layers] == [kernel_reads]
        yield node
    finally:
        left = node.cleanup()
        assert not left, f"left mounted: {left}"


@pytest.fixture
def live(starts_a_server, tmp_path, store, store_location):
    """The node of :func:`live_node` on files of two chunks each."""
    yield from live_node(tmp_path, store, store_location, SMALL_FILE_SIZE)


@pytest.fixture(params=["fuse", "partial"])
def loaded(request, starts_a_server, tmp_path, store, store_location):
    """The node of :func:`live_node` on files of 12 MiB, for the switches under
    load: the layer over its FUSE blob file, or over its partial blob file."""
    yield from live_node(tmp_path, store, store_location, FILE_SIZE,
                         kernel_reads=request.param == "partial")


def sandbox(node: NodeDaemon, sid: str) -> Path:
    return node.root / "sandboxes" / sid / "rootfs"


def mount_ids(root: Path) -> dict[str, str]:
    """Mount point → mount id of every mount under ``root``."""
    with open("/proc/self/mountinfo") as f:
        lines = [line.split() for line in f]
    base = str(root.resolve())
    return {fields[4]: fields[0] for fields in lines
            if fields[4] == base or fields[4].startswith(base + "/")}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextmanager
def ext4_on_disk(node: NodeDaemon, tmp_path: Path):
    """ext4 on a loop device over disk w, mounted; unmounted, checked, detached after."""
    disk = node.root / "fuse" / "disks" / "w"
    dev = subprocess.run(["losetup", "-f", "--show", str(disk)], check=True,
                         capture_output=True, text=True).stdout.strip()
    mnt = tmp_path / "ext4"
    mnt.mkdir()
    try:
        subprocess.run(["mkfs.ext4", "-q", dev], check=True)
        subprocess.run(["mount", dev, str(mnt)], check=True)
        try:
            yield dev, mnt
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
        fsck = subprocess.run(["e2fsck", "-fn", dev], capture_output=True, text=True)
        assert fsck.returncode == 0, f"e2fsck: {fsck.stdout}{fsck.stderr}"
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


def start_load(node: NodeDaemon, tmp_path: Path, mnt: Path) -> Load:
    stop, readers, progress = tmp_path / "stop", [], []
    for i in range(2 * FILES):
        path = sandbox(node, "s1" if i < FILES else "s2") / "data" / f"f{i}"
        progress.append(tmp_path / f"progress{i}")
        readers.append(subprocess.Popen(
            [sys.executable, "-c", READER, str(path), sha(node.src / "data" / f"f{i}"),
             str(stop), str(progress[-1])], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(sandbox(node, "s1") / "data" / "f0"),
         str(sandbox(node, "s1") / "note")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(mnt), str(stop)],
                              stdout=subprocess.PIPE, text=True)
    wait_for(lambda: all(p.exists() for p in progress), "every reader's first pass")
    return Load(readers, holder, writer, stop, progress,
                sha(node.src / "data" / "f0"), mnt)


def passes(load: Load) -> list[int]:
    return [int(p.read_text() or 0) for p in load.progress]


def finish_load(load: Load) -> None:
    """Let every reader make a pass after the switch, stop them all, and check
    each one's result: no error, the right sha256, no one stuck."""
    before = passes(load)
    wait_for(lambda: all(a > b for a, b in zip(passes(load), before, strict=True)),
             "a pass after the switch")
    assert state(load.holder.pid) == "S"  # idle on its stdin, not stuck on a sandbox file
    load.stop.touch()  # every reader and the writer must end by themselves: none stays in D
    for reader in load.readers:
        out, err = reader.communicate(timeout=120)
        assert reader.returncode == 0, f"reader failed: {err}"
        assert int(out) >= 2
    out, _ = load.writer.communicate(timeout=120)
    assert load.writer.returncode == 0
    for n in range(int(out)):
        data = (load.mnt / f"w{n}").read_bytes()
        assert data == bytes([n % 251]) * (256 * 1024 + n), f"ext4 file w{n} differs"
    out, _ = load.holder.communicate("go\n", timeout=60)
    assert load.holder.returncode == 0 and out.strip() == load.data_sha


def state(pid: int) -> str:
    """The process state letter of ``pid`` (R, S, D, ...; '' once it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


def keeper_pid(node: NodeDaemon) -> int:
    found = KEEPER.findall(node.log())
    assert found, "no keeper started"
    return int(found[-1])


def kill_load(load: Load) -> None:
    for proc in (*load.readers, load.writer, load.holder):
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def switch_under_load(node: NodeDaemon, tmp_path: Path, switch) -> None:
    """Start the load, record the mounts, ``switch(node)``, then check that the
    mounts are the same ones and the load finished without an error."""
    with ext4_on_disk(node, tmp_path) as (_, mnt), ExitStack() as stack:
        load = start_load(node, tmp_path, mnt)
        stack.callback(kill_load, load)
        ids, rootfs_ino = mount_ids(node.root), os.stat(sandbox(node, "s1")).st_ino
        switch(node)
        assert mount_ids(node.root) == ids  # no mount detached, none made again
        assert os.stat(sandbox(node, "s1")).st_ino == rootfs_ino
        finish_load(load)
    ps = {r["id"]: r for r in node.request("ps")["sandboxes"]}
    assert ps["s1"]["state"] == ps["s2"]["state"] == "up"
    assert (sandbox(node, "s1") / "note").read_text() == "after the switch\n"


def kill_and_restart(node: NodeDaemon) -> None:
    node.kill()
    node.start()


def node_argv(node: NodeDaemon) -> list[str]:
    return [*LAYERFS, "daemon", "--root", str(node.root), *node.store_args,
            "--cache-size", node.cache_size, "--read-timeout", str(node.read_timeout),
            "--log-level", "info", *node.fixed_args, *node.extra_args]


def test_kill_9_keeps_every_sandbox_and_read(loaded, tmp_path):
    switch_under_load(loaded, tmp_path, kill_and_restart)


def test_takeover_under_load_fails_no_read(loaded, tmp_path):
    switch_under_load(loaded, tmp_path, take_over)
    assert "handing the FUSE connection over" in loaded.log()


def test_second_daemon_without_takeover_is_refused(live):
    proc = subprocess.run(node_argv(live), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"layerfs: error: a layerfs daemon (pid {live.proc.pid}) already serves "
        f"{live.root}: stop it first, or replace it with `layerfs daemon --takeover`")
    assert live.request("ping")["pid"] == live.proc.pid


def test_keeper_killed_too_falls_back_to_remounting(live):
    data = sandbox(live, "s1") / "data" / "f1"
    points = mount_ids(live.root).keys()
    held = os.open(data, os.O_RDONLY)  # opened before, read after: on the dead connection
    try:
        keeper = keeper_pid(live)
        live.kill()  # the daemon first: it would start another keeper
        os.kill(keeper, signal.SIGKILL)
        live.start()
        with pytest.raises(OSError):
            os.pread(held, 4096, 0)
    finally:
        os.close(held)
    assert "unmounted stale" in live.log()
    assert mount_ids(live.root).keys() == points  # every mount made again
    ps = {r["id"]: r for r in live.request("ps")["sandboxes"]}
    assert ps["s1"]["state"] == ps["s2"]["state"] == "up"
    assert sha(data) == sha(live.src / "data" / "f1")


@pytest.mark.parametrize("store_location", ["s3"], indirect=True)
def test_kill_9_answers_the_read_the_dead_daemon_had_taken(live, tmp_path, store_location):
    """A read the daemon had taken from the kernel and not answered when it
    died is answered by the next daemon (FUSE_NOTIFY_RESEND): the daemon
    reaches the store through a relay that holds the store's answers back
    while the read is taken, so its fetch blocks for sure."""
    relay = GatedRelay(store_location.endpoint)
    try:
        live.kill()  # a daemon of the same node through the relay
        live.store_args = ["--store", store_location.url, "--s3-endpoint", relay.endpoint]
        live.start()
        path = sandbox(live, "s1") / "data" / "f3"
        want = hashlib.sha256((live.src / "data" / "f3").read_bytes()[:MiB]).hexdigest()
        relay.gate.clear()
        reader = subprocess.Popen(
            [sys.executable, "-c", "import hashlib, sys; "
             "print(hashlib.sha256(open(sys.argv[1], 'rb').read(1 << 20)).hexdigest())",
             str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert relay.held.wait(30), "the fetch never reached the store"
            live.kill()  # the read is taken and unanswered now
            live.store_args = store_location.cli_args()
            live.start()
            relay.gate.set()
            out, err = reader.communicate(timeout=60)
        finally:
            if reader.poll() is None:
                reader.kill()
        assert reader.returncode == 0, err
        assert out.strip() == want
    finally:
        relay.gate.set()
        relay.close()


# a process that opens a file now and reads it on a line on stdin: prints
# "read" or "error ERRNO"
READ_LATER = textwrap.dedent("""
    import os, sys
    fd = os.open(sys.argv[1], os.O_RDONLY)
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        os.pread(fd, 4096, 0)
        print("read")
    except OSError as exc:
        print("error", exc.errno)
""")


def open_for_later(path: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", READ_LATER, str(path)], cwd=path.parent,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def read_later(proc: subprocess.Popen) -> str:
    """What the reader got; it must answer within 30 s (no read waits for ever)."""
    try:
        out, _ = proc.communicate("go\n", timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    return out.strip()


def connection_waiting(root: Path) -> Path:
    """The fusectl ``waiting`` file of ROOT/fuse's connection."""
    return Path(f"/sys/fs/fuse/connections/{os.minor(os.stat(root / 'fuse').st_dev)}/waiting")


def gone(pid: int) -> bool:
    return state(pid) in ("", "Z")


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.sandboxes\.layermounts: stopping: .* is busy")
def test_stop_with_a_busy_sandbox_lets_the_connection_go(live):
    """A stop for good (SIGTERM) ends the keeper too: a sandbox a process
    keeps busy is detached, nothing stays mounted under ROOT, and the
    process's reads fail (the connection is aborted)."""
    keeper, waiting = keeper_pid(live), connection_waiting(live.root)
    f7 = sandbox(live, "s1") / "data" / "f7"  # never read: a read must ask the daemon
    reader = open_for_later(f7)
    assert live.stop() == 0
    wait_for(lambda: gone(keeper), "the keeper to exit", 10)
    assert read_later(reader).split()[0] == "error"
    assert not waiting.exists() or waiting.read_text().strip() == "0"
    assert mounts_under(live.root) == []
    live.start()
    assert sha(f7) == sha(live.src / "data" / "f7")


def test_a_daemon_gone_for_good_is_given_up_after_the_grace(live):
    """With no daemon to take the connection, the keeper lets it go after
    --restart-grace: reads waiting on the node fail instead of waiting for ever."""
    live.kill()
    live.extra_args = ["--restart-grace", "1"]
    live.start()  # took the connection over, with a grace of 1 s from now on
    assert "took over the FUSE connection" in live.log()
    keeper = keeper_pid(live)
    f7 = sandbox(live, "s1") / "data" / "f7"
    reader = open_for_later(f7)
    live.kill()
    live.expect_log(r"WARNING layerfs\.node\.fuse\.keeper: no daemon took the FUSE connection "
                    r"within 1 s: letting it go")
    wait_for(lambda: gone(keeper), "the keeper to let go", 15)
    assert read_later(reader).split()[0] == "error"
    live.extra_args = []
    live.start()  # today's recovery: every mount detached and made again
    assert "unmounted stale" in live.log()
    ps = {r["id"]: r for r in live.request("ps")["sandboxes"]}
    assert ps["s1"]["state"] == ps["s2"]["state"] == "up"
    assert sha(f7) == sha(live.src / "data" / "f7")


@pytest.mark.parametrize("store_location", ["file"], indirect=True)
def test_a_successor_that_fails_to_start_leaves_the_keeper(live):
    """A daemon that takes over and then fails (its control socket cannot be
    bound) leaves the connection to the keeper, as a crash would: the next
    daemon takes it over with every sandbox as it was."""
    keeper = keeper_pid(live)
    live.kill()
    blocker = live.root / "control.sock"
    blocker.unlink(missing_ok=True)
    (blocker / "x").mkdir(parents=True)  # a directory where the socket goes: bind fails
    try:
        proc = subprocess.run(node_argv(live), capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(blocker)
    assert proc.returncode != 0
    assert "took over the FUSE connection" in proc.stderr, proc.stderr[-3000:]
    time.sleep(1)
    assert not gone(keeper), "the failing successor ended the keeper"
    ids = mount_ids(live.root)
    live.start()
    assert "took over the FUSE connection" in live.log().rsplit("layerfs daemon ready", 2)[-2]
    assert mount_ids(live.root) == ids  # nothing detached or made again
    f7 = sandbox(live, "s1") / "data" / "f7"
    assert sha(f7) == sha(live.src / "data" / "f7")


def test_a_keeper_that_dies_is_replaced(live):
    """The daemon starts another keeper when its keeper dies, with the same
    open file: a crash after that is survived as before."""
    old = keeper_pid(live)
    live.expect_log(r"WARNING layerfs\.node\.daemon\.service: the FUSE keeper exited; starting "
                    r"another")
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: keeper_pid(live) != old, "another keeper", 15)
    ids = mount_ids(live.root)
    kill_and_restart(live)
    assert "took over the FUSE connection" in live.log().rsplit("layerfs daemon ready", 2)[-2]
    assert mount_ids(live.root) == ids
    f7 = sandbox(live, "s1") / "data" / "f7"
    assert sha(f7) == sha(live.src / "data" / "f7")


@pytest.mark.parametrize("store_location", ["file"], indirect=True)
def test_a_keeper_that_dies_again_at_once_is_left_dead(live):
    """A replacement keeper that dies within 10 s is not replaced again (the
    connection itself may be gone): one error line, and a crash after that
    falls back to remounting."""
    first = keeper_pid(live)
    live.expect_log(r"WARNING layerfs\.node\.daemon\.service: the FUSE keeper exited; starting "
                    r"another",
                    r"ERROR layerfs\.node\.daemon\.service: the FUSE keeper exited again: live "
                    r"restart "
                    r"is unavailable until this daemon restarts")
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: keeper_pid(live) != first, "another keeper", 15)
    second = keeper_pid(live)
    os.kill(second, signal.SIGKILL)
    wait_for(lambda: "the FUSE keeper exited again" in live.log(), "the error line", 15)
    assert keeper_pid(live) == second  # no third one
    kill_and_restart(live)
    assert "unmounted stale" in live.log()
    ps = {r["id"]: r for r in live.request("ps")["sandboxes"]}
    assert ps["s1"]["state"] == ps["s2"]["state"] == "up"

