"""``suspend`` / ``resume`` of a sandbox: its runc containers frozen by the
cgroup freezer while its upper commits into the store, the sandbox ended,
and brought up again on a second node root from the pushed env. Real
daemons, real runc, a real S3 store (SeaweedFS) between the two nodes."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support import build, need_root
from support.nodes import NodeDaemon, wait_for

from harness.daemonproc import LAYERFS
from layerfs.builder.env import create_env
from layerfs.errors import SandboxNotFound, SnapshotExists
from layerfs.node.client import Client
from layerfs.node.containers import freezer, runner
from layerfs.refstore import ENVS, LAYERS, RefStore
from layerfs.store import open_store

pytestmark = pytest.mark.end_to_end

APPLETS = ("sh", "echo", "cat", "dd", "sleep", "mv", "true")
# the workload: a file written and fsynced, then one more line each moment
WORKLOAD = ("echo acknowledged > /synced && dd if=/synced of=/synced.copy conv=fsync "
            "2>/dev/null && echo ready && i=0; while :; do i=$((i+1)); echo $i >> /ticks; "
            "sleep 0.01; done")


def make_rootfs(root: Path) -> Path:
    """A busybox rootfs."""
    for sub in ("bin", "etc", "proc", "dev", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc" / "os-release").write_text("NAME=suspend-base\n")
    return root


@pytest.fixture(scope="module")
def nodes(s3_server, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[NodeDaemon, NodeDaemon, RefStore]]:
    """Two daemons (own roots, own caches) on one S3 store holding layer base@1."""
    need_root()
    work = tmp_path_factory.mktemp("suspend")
    url = f"s3://layerfs-test/t/{uuid.uuid4().hex[:16]}"
    args = ["--store", url, "--s3-endpoint", s3_server.endpoint]
    store = open_store(url, s3_server.endpoint)
    build(store, str(make_rootfs(work / "base")), name="base")
    daemons = [NodeDaemon(work / name, args, cache_size="64M") for name in ("a", "b")]
    try:
        for daemon in daemons:
            daemon.start()
        yield daemons[0], daemons[1], RefStore(store)
    finally:
        for daemon in daemons:
            assert daemon.cleanup() == [], "mounts left behind"
        store.close()


@contextmanager
def working(node: NodeDaemon, sid: str) -> Iterator[subprocess.Popen]:
    """Sandbox ``sid`` up on ``node`` with :data:`WORKLOAD` running in it (in
    the background, once it said ready); the run and the sandbox gone after."""
    node.cli("up", "--layer", "base@1", "--id", sid)
    argv = [*LAYERFS, "run", "--root", str(node.root), sid, "--", "sh", "-c", WORKLOAD]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n", proc.stderr
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)
        node.cli("down", "--force", sid, check=False)


def ticks(node: NodeDaemon, sid: str) -> int:
    """How many lines the workload of sandbox ``sid`` wrote so far."""
    path = node.root / "sandboxes" / sid / "upper" / "ticks"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_frozen_container_writes_nothing_until_thawed(nodes) -> None:
    """The freezer stops every process of a runc container (the kernel says
    ``frozen`` of the container's own cgroup, cgroup2's where there is one;
    its file does not grow) and a thaw lets it go on."""
    a, _, _ = nodes
    with working(a, "fz"):
        (container,) = runner.running_containers(str(a.root), "fz")
        frozen = freezer.freeze_all([container])
        try:
            assert [c.container_id for c in frozen] == [container.container_id]
            assert freezer.is_frozen(frozen[0])
            points = freezer.freezer_points()  # cgroup2's cgroup.freeze where runc put it there
            if "cgroup2" in points:
                assert frozen[0].v2 and frozen[0].path.startswith(points["cgroup2"] + "/")
            assert container.container_id in frozen[0].path.split("/")
            before = ticks(a, "fz")
            time.sleep(0.3)
            assert ticks(a, "fz") == before
        finally:
            freezer.thaw_all(frozen)
        assert not freezer.is_frozen(frozen[0])
        wait_for(lambda: ticks(a, "fz") > before, "the thawed workload to write again")


def test_suspend_then_resume_on_another_node(nodes) -> None:
    """A sandbox whose process fsynced a file and keeps writing is suspended
    on node a (its container frozen, then killed; the sandbox gone); node b
    resumes it from the store with the files as they were at the freeze."""
    a, b, refstore = nodes
    with working(a, "s1") as run:
        answer = Client(a.root).suspend("s1", "snap", "1")
        assert run.wait(60) == 128 + 9  # the run's container was killed (SIGKILL)
    assert answer.ref == "snap@1" and len(answer.frozen) == 1 and answer.frozen_seconds > 0
    assert answer.commit.ref == "snap@1" and answer.commit.files >= 3
    assert Client(a.root).sandbox("s1") is None
    assert runner.running_containers(str(a.root), "s1") == []
    env = refstore.env(refstore.resolve(ENVS, "snap@1"))
    assert [layer.digest for layer in env.layers] == [
        answer.commit.digest, refstore.resolve(LAYERS, "base@1")]

    record = Client(b.root).resume("snap@1", "r1")
    try:
        rootfs = Path(record.rootfs)
        assert (rootfs / "synced").read_text() == "acknowledged\n"
        assert (rootfs / "synced.copy").read_text() == "acknowledged\n"
        lines = (rootfs / "ticks").read_text().splitlines()
        assert lines == [str(n) for n in range(1, len(lines) + 1)]  # whole lines, in order
        assert (rootfs / "etc" / "os-release").read_text() == "NAME=suspend-base\n"
        out = b.cli("run", "r1", "--", "cat", "/synced").stdout
        assert out == "acknowledged\n"
    finally:
        Client(b.root).down("r1")


def test_resume_command_prints_the_rootfs(nodes) -> None:
    """``layerfs suspend`` and ``layerfs resume`` (the CLI's form)."""
    a, b, _ = nodes
    a.cli("up", "--layer", "base@1", "--id", "s2")
    (a.root / "sandboxes" / "s2" / "rootfs" / "note").write_text("kept\n")
    out = a.cli("suspend", "s2", "--name", "snap", "--version", "2").stdout
    assert out.startswith("s2 suspended as snap@2 sha256:")
    rootfs = b.cli("resume", "snap@2", "--id", "r2").stdout.strip()
    try:
        assert (Path(rootfs) / "note").read_text() == "kept\n"
    finally:
        b.cli("down", "r2")


def test_refused_suspend_changes_nothing(nodes) -> None:
    """An unknown id, and a name@version that exists (as a layer, or as an
    env only), are one error line each with their exit code; the sandbox goes
    on running unfrozen and nothing is pushed."""
    a, _, refstore = nodes
    proc = a.cli("suspend", "nosuch", "--name", "snap", "--version", "3", check=False)
    assert (proc.returncode, proc.stderr) == (
        SandboxNotFound.exit_code, "layerfs: error: sandbox nosuch: no such sandbox\n")
    assert refstore.read_ref(LAYERS, "snap", "3") is None
    with working(a, "s3") as run:
        a.cli("suspend", "s3", "--name", "snap", "--version", "3")  # (its own)
    assert run.returncode == 128 + 9
    create_env(refstore, "envonly", "1", ["base@1"])
    pushed = (refstore.versions(LAYERS, "snap"), refstore.versions(ENVS, "snap"))
    with working(a, "s4") as run:
        for kind, ref in (("layer", "snap@3"), ("env", "envonly@1")):
            name, version = ref.split("@")
            proc = a.cli("suspend", "s4", "--name", name, "--version", version, check=False)
            assert proc.returncode == SnapshotExists.exit_code == 4
            assert proc.stderr == (f"layerfs: error: {kind} {ref} already exists: a suspend "
                                   "never writes over a ref (give another version)\n")
        with pytest.raises(SnapshotExists):
            Client(a.root).suspend("s4", "base", "1")
        assert run.poll() is None
        before = ticks(a, "s4")
        wait_for(lambda: ticks(a, "s4") > before, "the workload to go on")
        assert Client(a.root).sandbox("s4") is not None
    assert (refstore.versions(LAYERS, "snap"), refstore.versions(ENVS, "snap")) == pushed
    assert refstore.read_ref(LAYERS, "envonly", "1") is None
