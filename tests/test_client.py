"""The node's client: the Python API (``layerfs.node.Client``) against a real
daemon, and what a node command imports (none of the daemon's, store's or
builder's heavy modules: the property that keeps its start fast)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from nodes import NodeDaemon
from support import build, need_root

from layerfs.errors import LayerfsError, UsageError
from layerfs.node import Client
from layerfs.node.client import SandboxNotUp
from layerfs.node.control import DaemonNotRunning, RemoteError
from layerfs.node.process import LAYERFS
from layerfs.node.protocol import SandboxRecord, SandboxStatus, StatsAnswer
from layerfs.store import open_store

# What only the daemon, the store clients and the builder need.
HEAVY = frozenset({"trio", "pyfuse3", "lmdb", "boto3", "botocore", "zstandard"})
HEAVY_OURS = frozenset({"layerfs.node.daemon", "layerfs.registry", "layerfs.store"})


def make_rootfs(root: Path) -> Path:
    for sub in ("bin", "etc", "proc", "dev", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    for applet in ("sh", "true", "cat"):
        (root / "bin" / applet).symlink_to("busybox")
    return root


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeDaemon]:
    """A daemon on a file:// store with layer base@1 (the client does not
    depend on the store backend, which test_node covers)."""
    need_root()
    work = tmp_path_factory.mktemp("client")
    url = "file://" + str(work / "store")
    store = open_store(url, None)
    try:
        build(store, str(make_rootfs(work / "base")), name="base")
    finally:
        store.close()
    daemon = NodeDaemon(work / "node", ["--store", url], cache_size="64M").start()
    try:
        yield daemon
    finally:
        left = daemon.cleanup()
        assert left == [], f"mounts left behind: {left}"


def imported_modules(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``layerfs ARGS`` under ``python -X importtime``; its result and the
    names of every module it imported."""
    argv = [sys.executable, "-X", "importtime", *LAYERFS[1:], *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    names = {line.rpartition("|")[2].strip() for line in proc.stderr.splitlines()
             if line.startswith("import time:")}
    names.discard("package")  # the header line
    return proc, names


def heavy_among(names: set[str]) -> set[str]:
    return ({n for n in names if n.split(".")[0] in HEAVY}
            | {n for n in names if any(n == h or n.startswith(h + ".") for h in HEAVY_OURS)})


def test_a_node_command_without_a_daemon_imports_nothing_heavy(tmp_path):
    proc, names = imported_modules("ps", "--root", str(tmp_path))
    assert proc.returncode == DaemonNotRunning.exit_code
    assert "layerfs.node.client" in names  # the path was taken (and measured)
    assert heavy_among(names) == set()


def test_the_node_commands_import_nothing_heavy(node):
    root = str(node.root)
    steps = [("up", "--layer", "base@1", "--id", "light", "--root", root),
             ("ps", "--root", root), ("stats", "--json", "--root", root),
             ("run", "--runtime", "runc", "--root", root, "light", "--", "true"),
             ("down", "light", "--root", root)]
    for args in steps:
        proc, names = imported_modules(*args)
        assert proc.returncode == 0, (args, proc.stderr[-2000:])
        assert "layerfs.node.client" in names
        assert heavy_among(names) == set(), args


def test_the_api_brings_up_lists_and_takes_down_a_sandbox(node):
    client = Client(node.root)
    assert client.ping().root == str(node.root)
    record = client.up("api", layers=["base@1"])
    try:
        assert isinstance(record, SandboxRecord)
        assert record.state == "up" and (Path(record.rootfs) / "bin" / "busybox").exists()
        rows = client.ps()
        assert [r.id for r in rows] == ["api"] and isinstance(rows[0], SandboxStatus)
        one = client.sandbox("api")
        assert one is not None and one.rootfs == record.rootfs
        assert client.sandbox("nope") is None
        stats = client.stats()
        assert isinstance(stats, StatsAnswer) and stats.sandboxes == 1
        assert client.run("api", ["sh", "-c", "exit 7"]) == 7
    finally:
        down = client.down("api")
    assert down.state == "down"
    with pytest.raises(SandboxNotUp, match="sandbox api is not up"):
        client.run("api", ["true"])


def test_ps_of_one_sandbox_answers_only_it(node):
    client = Client(node.root)
    for sid in ("one", "two"):
        client.up(sid, layers=["base@1"])
    try:
        rows = node.request("ps", id="two")["sandboxes"]
        assert [r["id"] for r in rows] == ["two"]
        assert node.request("ps", id="three")["sandboxes"] == []
    finally:
        for sid in ("one", "two"):
            client.down(sid)


def test_the_api_raises_the_layerfs_errors(node, tmp_path):
    with pytest.raises(DaemonNotRunning) as no_daemon:
        Client(tmp_path).ps()
    assert no_daemon.value.exit_code == 10
    client = Client(node.root)
    with pytest.raises(RemoteError) as refused:
        client.up("bad", layers=["no-such-layer@1"])
    assert isinstance(refused.value, LayerfsError) and refused.value.exit_code != 0
    with pytest.raises(UsageError, match="not both"):
        client.up("bad", env="e@1", layers=["base@1"])
    assert client.ps() == []


def test_loading_the_run_command_starts_no_process():
    """``layerfs run``'s modules find libc without running ``ldconfig -p``
    (what ``ctypes.util.find_library`` does), twice, on every start."""
    probe = ("import subprocess, sys\n"
             "started = []\n"
             "init = subprocess.Popen.__init__\n"
             "def record(self, args, *a, **kw):\n"
             "    started.append(args)\n"
             "    init(self, args, *a, **kw)\n"
             "subprocess.Popen.__init__ = record\n"
             "import layerfs.tools.run\n"
             "print(repr(started))\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=True)
    assert proc.stdout.strip() == "[]"
