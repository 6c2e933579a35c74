"""A sandbox's limits for real: ``up --memory/--cpus/--pids/--disk-quota``
recorded with it, written into its containers' cgroups by runc and crun and
enforced on real processes (a memory hog OOM-killed, a fork bomb stopped), and
its writable layer's quota enforced by the kernel on a ROOT on a real btrfs
(a loop-mounted image with quotas on: a qgroup) and on a real ext4 (a
loop-mounted image: an ext4 image per sandbox); a limit the node cannot
enforce is refused with exit 17."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import build, need_root, small_ext4
from support.nodes import NodeDaemon

from harness import daemonproc
from harness.daemonproc import LAYERFS
from harness.ociimages import busybox_rootfs
from layerfs.mounts import fs_type
from layerfs.node import Client
from layerfs.node.control import wait_ready
from layerfs.node.sandboxes import quota
from layerfs.node.sandboxes.manager import remove_sandbox_dir
from layerfs.store import open_store

RUNTIMES = ("runc", "crun")
APPLETS = ("sh", "cat", "echo", "dd", "ls", "rm", "sleep", "sync", "wc")
BTRFS_IOC_QUOTA_CTL = 0xC0109428  # _IOWR(0x94, 40, struct btrfs_ioctl_quota_ctl_args)
QUOTA_CTL_ENABLE_SIMPLE = 4
MiB = 1 << 20
# stops after 2^18 doublings of 1 KiB (256 MiB) if nothing kills it first
MEMORY_HOG = ("x=$(dd if=/dev/zero bs=1024 count=1 2>/dev/null | tr '\\0' a); i=0; "
              "while [ $i -lt 18 ]; do x=$x$x; i=$((i+1)); done; echo survived")
FORK_BOMB = "i=0; while [ $i -lt 100 ]; do sleep 60 & i=$((i+1)); echo $i; done"


def enable_simple_quotas(mount_point: Path) -> None:
    """``btrfs quota enable --simple`` (btrfs-progs before 6.7 lack ``--simple``)."""
    fd = os.open(mount_point, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, BTRFS_IOC_QUOTA_CTL, bytearray(struct.pack("2Q",
                                                                   QUOTA_CTL_ENABLE_SIMPLE, 0)))
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def btrfs_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A 1 GiB btrfs image, loop-mounted, with simple quotas enabled."""
    need_root()
    work = tmp_path_factory.mktemp("btrfs")
    image, point = work / "root.img", work / "mnt"
    with open(image, "wb") as f:
        f.truncate(1 << 30)
    subprocess.run(["mkfs.btrfs", "-q", str(image)], check=True, capture_output=True)
    point.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(point)], check=True)
    try:
        enable_simple_quotas(point)
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True)


def store_url(work: Path) -> str:
    """A file:// store with layer base@1: busybox with a world-writable /tmp."""
    url = "file://" + str(work / "store")
    rootfs = busybox_rootfs(work / "base", APPLETS + ("tr",))
    (rootfs / "tmp").chmod(0o1777)
    store = open_store(url, None)
    try:
        build(store, str(rootfs), name="base")
    finally:
        store.close()
    return url


@pytest.fixture(scope="module")
def node(starts_a_server,
         btrfs_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeDaemon]:
    """A daemon whose ROOT is on the btrfs image."""
    url = store_url(tmp_path_factory.mktemp("limits"))
    daemon = NodeDaemon(btrfs_root / "node", ["--store", url], cache_size="64M").start()
    try:
        yield daemon
    finally:
        left = daemon.cleanup()
        assert left == [], f"mounts left behind: {left}"


def up(node: NodeDaemon, sid: str, *limits: str) -> dict:
    proc = node.cli("up", "--layer", "base@1", "--id", sid, "--json", *limits)
    return json.loads(proc.stdout)


def run(node: NodeDaemon, runtime: str, sid: str, script: str,
        *options: str) -> subprocess.CompletedProcess:
    argv = [*LAYERFS, "run", "--runtime", runtime, *options, "--root", str(node.root), sid,
            "--", "sh", "-c", script]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def node_is_fine(node: NodeDaemon, runtime: str, sid: str) -> None:
    """The daemon answers and a new container runs in the sandbox."""
    assert Client(node.root).sandbox(sid) is not None
    proc = run(node, runtime, sid, "echo fine")
    assert (proc.returncode, proc.stdout) == (0, "fine\n"), proc.stderr


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_memory_hog_is_oom_killed(node, runtime):
    sid = f"mem-{runtime}"
    record = up(node, sid, "--memory", "32M")
    assert record["limits"]["memory"] == 32 * MiB
    try:
        proc = run(node, runtime, sid, MEMORY_HOG)
        assert proc.returncode == 137, (proc.returncode, proc.stdout, proc.stderr)
        assert "survived" not in proc.stdout
        assert proc.stderr.endswith("layerfs: run killed: memory limit 32M reached "
                                    "(OOM kill)\n"), proc.stderr
        left = [d for p in Path("/sys/fs/cgroup").iterdir()
                for d in (p / "layerfs").glob(f"{sid}-*")]
        assert left == []  # the run's cgroups went with it, in every hierarchy
        # a SIGKILL that is no OOM kill says nothing
        killed = run(node, runtime, sid, "sh -c 'kill -9 $$'; exit $?")
        assert killed.returncode == 137 and "layerfs" not in killed.stderr, killed.stderr
        result = Client(node.root).run(sid, ["sh", "-c", MEMORY_HOG], runtime=runtime,
                                       capture=True)  # the API's captured stderr says it too
        assert result.exit_code == 137 and result.stderr is not None
        assert result.stderr.endswith(b"memory limit 32M reached (OOM kill)\n"), result.stderr
        node_is_fine(node, runtime, sid)
    finally:
        node.cli("down", sid)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_fork_bomb_stops_at_the_pids_limit(node, runtime):
    sid = f"pids-{runtime}"
    up(node, sid, "--pids", "20")
    try:
        proc = run(node, runtime, sid, FORK_BOMB)
        started = [int(n) for n in proc.stdout.split()]
        # sh itself and 19 sleeps are 20 processes: the 21st fork fails
        assert started[-1] == 19, (proc.stdout, proc.stderr)
        assert "fork" in proc.stderr and proc.returncode != 0
        node_is_fine(node, runtime, sid)  # the sleeps went with the container
    finally:
        node.cli("down", sid)


def cgroup_dirs(cgroup_lines: str) -> dict[str, Path]:
    """Controller → the host directory of a process's cgroup in it, from its
    /proc/self/cgroup (the v1 hierarchies, or cgroup2's ``0::`` line)."""
    unified = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
    found: dict[str, Path] = {}
    for line in cgroup_lines.splitlines():
        _, controllers, path = line.split(":", 2)
        if unified and controllers == "":
            return {c: Path("/sys/fs/cgroup" + path) for c in ("cpu", "memory", "pids")}
        for controller in controllers.split(","):
            if controller in ("cpu", "memory", "pids"):
                found[controller] = Path(f"/sys/fs/cgroup/{controller}{path}")
    return found


def read(path: Path) -> str:
    return path.read_text().strip()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_limits_are_the_containers_cgroup(node, runtime):
    sid = f"cg-{runtime}"
    record = Client(node.root).up(sid, layers=["base@1"], memory=64 * MiB, cpus=0.5, pids=30)
    assert (record.limits.memory, record.limits.cpus, record.limits.pids) == (64 * MiB, 0.5, 30)
    listed = node.cli("ps").stdout
    assert "limits: mem=64M cpus=0.5 pids=30" in listed, listed
    argv = [*LAYERFS, "run", "--runtime", runtime, "--root", str(node.root), sid, "--",
            "sh", "-c", "cat /proc/self/cgroup; echo end; read line"]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as p:
        try:
            assert p.stdout is not None and p.stdin is not None
            lines = "".join(iter(p.stdout.readline, "end\n"))
            dirs = cgroup_dirs(lines)
            if (dirs["cpu"] / "cpu.max").exists():  # cgroup v2
                assert read(dirs["cpu"] / "cpu.max") == "50000 100000"
                assert read(dirs["memory"] / "memory.max") == str(64 * MiB)
                assert read(dirs["memory"] / "memory.swap.max") == "0"
                assert read(dirs["pids"] / "pids.max") == "30"
            else:
                assert read(dirs["cpu"] / "cpu.cfs_quota_us") == "50000"
                assert read(dirs["cpu"] / "cpu.cfs_period_us") == "100000"
                assert read(dirs["memory"] / "memory.limit_in_bytes") == str(64 * MiB)
                assert read(dirs["memory"] / "memory.memsw.limit_in_bytes") == str(64 * MiB)
                assert read(dirs["pids"] / "pids.max") == "30"
            p.stdin.write("\n")
            p.stdin.close()
            assert p.wait(timeout=60) == 0
        finally:
            if p.poll() is None:
                p.kill()
    node.cli("down", sid)


def free_bytes(path: Path) -> int:
    os.sync()
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_writer_stops_at_its_quota_and_the_others_go_on(node, runtime, local_user):
    writer, other = f"quota-{runtime}", f"other-{runtime}"
    record = up(node, writer, "--disk-quota", "10M")
    assert record["limits"]["disk_quota"] == 10 * MiB
    up(node, other, "--disk-quota", "10M")
    try:
        before = free_bytes(node.root)
        upper = node.root / "sandboxes" / writer / "upper"
        # an unprivileged user in the container, then root: the quota holds for both
        for user, path in ((str(local_user.uid), "/tmp/big"), ("0", "/big")):
            proc = run(node, runtime, writer, f"dd if=/dev/zero of={path} bs=1M count=30; "
                                              "sync", "--user", user)
            assert "Disk quota exceeded" in proc.stderr, proc.stderr
            written = (upper / path.lstrip("/")).stat().st_size
            assert 8 * MiB <= written <= 10 * MiB, written
            assert before - free_bytes(node.root) <= 12 * MiB  # the quota and some metadata
            proc = run(node, runtime, writer, f"rm {path}")  # and it is the writer's again
            assert proc.returncode == 0, proc.stderr
        proc = run(node, runtime, other, "dd if=/dev/zero of=/five bs=1M count=5; sync")
        assert proc.returncode == 0, proc.stderr
        assert (node.root / "sandboxes" / other / "upper" / "five").stat().st_size == 5 * MiB
    finally:
        node.cli("down", writer)
        node.cli("down", other)
    assert not (node.root / "sandboxes" / writer).exists()  # the subvolume went with it


@pytest.fixture
def hostile_node(starts_a_server,
                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NodeDaemon]:
    """A daemon in a mount namespace of its own without the cgroup pids
    hierarchy and with no loop devices (a plain file over /dev/loop-control):
    a node that cannot enforce --pids, nor --disk-quota on a ROOT on ext4."""
    need_root()
    url = store_url(tmp_path)
    (tmp_path / "no-loop-control").touch()
    hide = (f"umount /sys/fs/cgroup/pids && mount --bind {tmp_path / 'no-loop-control'} "
            '/dev/loop-control && exec "$0" "$@"')
    monkeypatch.setattr(daemonproc, "LAYERFS", ["unshare", "--mount", "--propagation", "private",
                                             "--", "sh", "-c", hide, *LAYERFS])
    daemon = NodeDaemon(tmp_path / "node", ["--store", url], cache_size="64M").start()
    monkeypatch.undo()
    try:
        yield daemon
    finally:
        daemon.cleanup()


@pytest.mark.parametrize("limit, reason", [
    (("--disk-quota", "10M"), "no loop devices (/dev/loop-control)"),
    (("--pids", "20"), "no cgroup pids controller"),
])
def test_a_limit_the_node_cannot_enforce_is_refused_with_exit_17(hostile_node, limit, reason):
    proc = hostile_node.cli("up", "--layer", "base@1", "--id", "s", *limit, check=False)
    assert proc.returncode == 17, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and limit[0] in lines[0] and reason in lines[0], lines
    assert Client(hostile_node.root).ps() == []
    assert not (hostile_node.root / "sandboxes" / "s").exists()
    # what it can enforce it does
    record = up(hostile_node, "m", "--memory", "64M")
    assert record["limits"]["memory"] == 64 * MiB


@pytest.mark.parametrize("args, message", [
    (("--memory", "lots"), "--memory: not a valid value"),
    (("--cpus", "nan"), "--cpus: not a valid value"),
    (("--cpus", "0"), "--cpus 0.0: from 0.01 to"),
    (("--pids", "0"), "--pids 0: at least 1"),
    (("--memory", "1K"), "--memory 1024: at least 4 MiB"),
    (("--pids", str(2**64)), f"--pids {2**64}: at most {2**63 - 1}"),
    (("--disk-quota", str(2**64)), f"--disk-quota {2**64}: at most {2**63 - 1}"),
])
def test_a_bad_limit_is_one_usage_error(node, args, message):
    proc = node.cli("up", "--layer", "base@1", "--id", "bad", *args, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr
    assert Client(node.root).sandbox("bad") is None


def test_the_limits_outlive_a_restart_and_go_into_the_bundle(node):
    up(node, "kept", "--disk-quota", "10M", "--pids", "20", "--memory", "64M")
    _, config = Client(node.root).prepare_run("kept", ["true"])  # what `run` writes
    resources = config["linux"]["resources"]
    assert resources["memory"] == {"limit": 64 * MiB, "swap": 64 * MiB}
    assert resources["pids"] == {"limit": 20} and "cpu" not in resources
    try:
        assert node.stop() == 0
        node.start()
        record = Client(node.root).sandbox("kept")
        assert record is not None and record.state == "up"
        assert (record.limits.disk_quota, record.limits.pids) == (10 * MiB, 20)
        proc = run(node, "runc", "kept", "dd if=/dev/zero of=/big bs=1M count=30")
        assert "Disk quota exceeded" in proc.stderr, proc.stderr
        proc = run(node, "crun", "kept", FORK_BOMB)
        assert [int(n) for n in proc.stdout.split()][-1] == 19, proc.stdout
    finally:
        node.cli("down", "kept")


@pytest.fixture(scope="module")
def ext4_node(starts_a_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeDaemon]:
    """A daemon whose ROOT is on a 256 MiB ext4 image, loop-mounted: a quota
    there is an ext4 image of its own per sandbox."""
    need_root()
    url = store_url(tmp_path_factory.mktemp("ext4limits"))
    with small_ext4(tmp_path_factory.mktemp("ext4"), 256 * MiB) as point:
        daemon = NodeDaemon(point / "node", ["--store", url], cache_size="32M").start()
        try:
            yield daemon
        finally:
            left = daemon.cleanup()
            assert left == [], f"mounts left behind: {left}"


def loops_of(path: Path) -> list[str]:
    """The loop devices whose backing file lies under ``path``."""
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        if backing.read_text().strip().startswith(str(path) + "/"):
            found.append(backing.parent.parent.name)
    return found


def loops_released(path: Path) -> bool:
    """Whether no loop device is left on a file under ``path`` (the kernel frees
    an autoclear loop device in a work item after its last close: waited for)."""
    deadline = time.monotonic() + 10
    while loops_of(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return loops_of(path) == []


def mounts_at(path: Path) -> int:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return sum(1 for line in f if line.split()[4] == str(path))


def test_a_writer_stops_at_its_quota_on_ext4_and_the_others_go_on(ext4_node, local_user):
    """ROOT on ext4: a writer (unprivileged, then root) stops at its quota with
    ENOSPC, taking ROOT's space up to it at most; another sandbox writes on,
    the node brings sandboxes up and runs them; down --keep-upper keeps the image."""
    node = ext4_node
    writer, other = "quota", "other"
    assert up(node, writer, "--disk-quota", "10M")["limits"]["disk_quota"] == 10 * MiB
    up(node, other, "--disk-quota", "10M")
    sdir = node.root / "sandboxes" / writer
    try:
        assert mounts_at(sdir) == 1 and len(loops_of(sdir)) == 1
        before = free_bytes(node.root)
        # an unprivileged user in the container, then root: the quota holds for both
        for user, path in ((str(local_user.uid), "/tmp/big"), ("0", "/big")):
            proc = run(node, "runc", writer, f"dd if=/dev/zero of={path} bs=1M count=30; "
                                             "sync", "--user", user)
            assert "No space left on device" in proc.stderr, proc.stderr
            written = (sdir / "upper" / path.lstrip("/")).stat().st_size
            assert 6 * MiB <= written <= 10 * MiB, written
            assert before - free_bytes(node.root) <= 10 * MiB  # the image's, at most
            proc = run(node, "runc", writer, f"rm {path}")  # and it is the writer's again
            assert proc.returncode == 0, proc.stderr
        proc = run(node, "crun", other, "dd if=/dev/zero of=/five bs=1M count=5; sync")
        assert proc.returncode == 0, proc.stderr
        assert (node.root / "sandboxes" / other / "upper" / "five").stat().st_size == 5 * MiB
        up(node, "after")  # the node goes on: ups and runs, with no quota too
        node_is_fine(node, "runc", "after")
        node.cli("down", "after")
        kept = node.root / "sandboxes" / other
        node.cli("down", other, "--keep-upper")  # its image stays, the upper inside, unmounted
        assert (kept / "quota.img").is_file() and mounts_at(kept) == 0 and loops_released(kept)
        shutil.rmtree(kept)
    finally:
        node.cli("down", writer)
        node.cli("down", other, check=False)
    assert not sdir.exists() and mounts_at(sdir) == 0 and loops_released(sdir)


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.daemon\.service: unmounted stale ")
def test_an_ext4_quota_outlives_stops_and_kills_and_commit_reads_it(ext4_node):
    """The image is mounted once after a stop and start, a kill -9 (the keeper
    keeps it), a --takeover and a kill -9 of the daemon and its keeper; its
    file and its quota are still there; commit reads the upper in it; down
    frees its mount and loop device."""
    node = ext4_node
    sdir = node.root / "sandboxes" / "kept"
    up(node, "kept", "--disk-quota", "10M")
    try:
        proc = run(node, "runc", "kept", "echo kept > /note; sync")
        assert proc.returncode == 0, proc.stderr
        for restart in (restart_after_stop, restart_after_kill, restart_by_takeover,
                        restart_without_keeper):
            restart(node)
            record = Client(node.root).sandbox("kept")
            assert record is not None and record.state == "up", (restart, record)
            assert mounts_at(sdir) == 1 and len(loops_of(sdir)) == 1, restart
            proc = run(node, "runc", "kept", "cat /note; dd if=/dev/zero of=/big bs=1M count=30")
            assert proc.stdout == "kept\n" and "No space left" in proc.stderr, (restart, proc)
            run(node, "runc", "kept", "rm /big")
        answer = json.loads(node.cli("commit", "kept", "--name", "kept", "--version", "1",
                                     "--json").stdout)
        assert answer["files"] == 1 and answer["file_bytes"] == len("kept\n"), answer
    finally:
        node.cli("down", "kept")
    assert not sdir.exists() and mounts_at(sdir) == 0 and loops_released(sdir)


def restart_after_stop(node: NodeDaemon) -> None:
    """A stop unmounts the image; the start mounts it again."""
    assert node.stop() == 0
    assert mounts_at(node.root / "sandboxes" / "kept") == 0
    node.start()


def restart_after_kill(node: NodeDaemon) -> None:
    """kill -9: the keeper keeps every mount, the next daemon takes them over."""
    node.kill()
    node.start()


def restart_by_takeover(node: NodeDaemon) -> None:
    """``daemon --takeover``: the old daemon exits, leaving every mount to the new one."""
    old = node.proc
    assert old is not None
    node.extra_args = ["--takeover"]
    node.start()  # returns once a daemon answers: maybe still the old one
    assert old.wait(60) == 0
    proc = node.proc
    assert wait_ready(node.root, lambda: proc.poll() is None, 60), node.log()[-4000:]
    node.extra_args = []


def restart_without_keeper(node: NodeDaemon) -> None:
    """kill -9 of the daemon and its FUSE keeper: the next daemon detaches
    what is left and mounts it again."""
    keepers = re.findall(r"the FUSE connection is kept by pid (\d+)", node.log())
    node.kill()
    os.kill(int(keepers[-1]), signal.SIGKILL)
    node.start()


def test_btrfs_with_quotas_off_gets_an_ext4_image(tmp_path):
    """ROOT on btrfs whose quotas are off: a quota is an image too, not a refusal."""
    need_root()
    image, point = tmp_path / "off.img", tmp_path / "off"
    with open(image, "wb") as f:
        f.truncate(256 * MiB)
    subprocess.run(["mkfs.btrfs", "-q", str(image)], check=True, capture_output=True)
    point.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(point)], check=True)
    try:
        sdir = point / "sandboxes" / "s"
        sdir.parent.mkdir()
        quota.make_quota_dir(sdir, 8 * MiB)
        assert fs_type(sdir) == "ext4" and mounts_at(sdir) == 1
        with pytest.raises(OSError) as full, open(sdir / "big", "wb") as f:
            for _ in range(16):
                f.write(b"\0" * MiB)
                os.fsync(f.fileno())
        assert full.value.errno == errno.ENOSPC
        remove_sandbox_dir(sdir, keep_upper=False)
        assert not sdir.exists() and mounts_at(sdir) == 0
    finally:
        subprocess.run(["umount", "-R", str(point)], check=True)
