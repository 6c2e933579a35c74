"""The node's client: the Python API (``layerfs.node.Client``) against a real
daemon, and what a node command imports (none of the daemon's, store's or
builder's heavy modules: the property that keeps its start fast)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from support.basenode import node  # noqa: F401  (the fixture: a daemon with base@1)

from harness.daemonproc import LAYERFS
from layerfs.errors import RefNotFound, SandboxNotFound, UsageError
from layerfs.node import Client
from layerfs.node.control import DaemonNotRunning, RemoteError, socket_path
from layerfs.node.protocol import SandboxRecord, SandboxStatus, StatsAnswer

pytestmark = pytest.mark.end_to_end  # the CLI and outside tools, end to end

# What only the daemon, the store clients and the builder need.
HEAVY = frozenset({"trio", "pyfuse3", "lmdb", "boto3", "botocore", "zstandard"})
HEAVY_OURS = frozenset({"layerfs.node.daemon.service", "layerfs.refstore", "layerfs.store"})


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
             ("run", "light", "--root", root, "--", "true"),
             ("down", "light", "--root", root)]
    for args in steps:
        proc, names = imported_modules(*args)
        assert proc.returncode == 0, (args, proc.stderr[-2000:])
        assert "layerfs.node.client" in names
        assert heavy_among(names) == set(), args
        assert "click" not in names, args  # parsed by layerfs.cli.fastpath


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
        assert client.run("api", ["sh", "-c", "exit 7"]).exit_code == 7
    finally:
        down = client.down("api")
    assert down.state == "down"
    with pytest.raises(SandboxNotFound, match="sandbox api: no such sandbox"):
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
    assert isinstance(refused.value, RefNotFound) and refused.value.exit_code == 5
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
             "import layerfs.cli.run\n"
             "print(repr(started))\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=True)
    assert proc.stdout.strip() == "[]"


def serve_one_answer(root: Path, answer: dict) -> threading.Thread:
    """A control socket at ``root`` that answers one request with ``answer``
    (as a daemon newer than this client would), in a thread."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path(root))
    listener.listen(1)

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn, conn.makefile("rwb") as f:
                f.readline()
                f.write(json.dumps({"ok": True, **answer}).encode() + b"\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_client_reads_the_answers_of_a_newer_daemon(tmp_path):
    """Answers may gain fields across versions (a live upgrade of the daemon
    must not break the clients of the old one): unknown ones are ignored, at
    the top and in nested records; requests stay strict (test_protocol)."""
    layer = {"users": 1, "bytes_read": 4096, "chunks_touched": 1, "chunks": 8,
             "blob_bytes": 1 << 20, "read_spans": [[0, 4096]]}
    answer = {"cache": {"size": 0}, "layers": {"sha256:ab": layer}, "sandboxes": 1,
              "store": {"get": 3}, "uptime": 12.5}
    thread = serve_one_answer(tmp_path, answer)
    stats = Client(tmp_path, timeout=30).stats()
    thread.join(30)
    assert stats.sandboxes == 1 and stats.store == {"get": 3}
    assert stats.layers["sha256:ab"].bytes_read == 4096
    assert not hasattr(stats, "uptime")


def test_the_cli_shows_the_answer_of_a_newer_daemon(tmp_path):
    row = {"id": "s1", "layers": ["sha256:ab"], "rootfs": "/r", "state": "up",
           "layer_refs": ["t@1"], "upper_bytes": 0, "layer_bytes_read": 0, "cpu_seconds": 1.0}
    thread = serve_one_answer(tmp_path, {"sandboxes": [row], "node": "n1"})
    proc = subprocess.run([*LAYERFS, "ps", "--root", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    thread.join(30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1].split()[:2] == ["s1", "up"]


FAST_ARGVS = [
    ["ps"], ["ps", "--root", "/r", "--json"], ["ps", "--root=/r"], ["stats", "--json"],
    ["up", "e@1", "--id", "s1"], ["up", "--layer", "a@1", "--layer=b@1", "--id", "s1",
                                  "--prefetch", "none", "--bundle", "/b", "--root", "/r"],
    ["up", "--id", "s1", "--json", "e@1"],
    ["up", "e@1", "--id", "s1", "--memory", "32M", "--cpus", "0.5", "--pids", "20",
     "--disk-quota=10M"],
    ["down", "s1"], ["down", "--keep-upper", "s1", "--json"],
    ["down", "--force", "s1"],
    ["run", "s1"], ["run", "--root", "/r", "s1", "--", "true"],
    ["run", "--runtime", "crun", "--network", "host", "--user", "0:0", "--entrypoint", "",
     "s1", "--", "sh", "-c", "exit 3"],
    ["run", "s1", "--root", "/r", "--", "sh", "-c", "true"],  # options after the ID
    ["run", "s1", "--runtime=crun", "--user", "0", "--"], ["run", "s1", "--root", "/r"],
    ["run", "--env", "A=1", "--env=B=2=3", "--cwd", "/tmp", "--timeout", "2.5", "s1", "--",
     "true"],
]
CLICK_ONLY_ARGVS = [  # help, errors and the edges of click's parse
    ["ps", "--help"], ["ps", "-h"], ["ps", "--json=1"], ["ps", "--bogus"], ["ps", "--root"],
    ["up", "--id"], ["up", "e@1"], ["up", "--id", "s1", "--prefetch", "bogus"],
    ["up", "--id", "s1", "--id", "s2", "e@1"], ["down"], ["down", "a", "b"],
    ["run", "s1", "ls", "-l"], ["run", "--", "s1"], ["run", "--runtime", "docker", "s1"],
    ["run", "s1", "ls", "--root", "/r"], ["run", "s1", "--bogus", "--", "true"],
    ["run", "s1", "--root"], ["run", "s1", "--timeout", "--", "true"],
    ["up", "--id", "-s1", "e@1"], ["--log-level", "debug", "ps"], ["commit", "s1"],
]


def click_params(argv: list[str]) -> dict:
    import click

    from layerfs.cli.group import cli

    with click.Context(cli) as ctx:
        command = cli.get_command(ctx, argv[0])
        assert command is not None
        return command.make_context(argv[0], argv[1:], parent=ctx).params


@pytest.mark.parametrize("argv", FAST_ARGVS, ids=" ".join)
def test_the_fast_path_parses_a_node_command_as_click_does(argv, monkeypatch):
    from layerfs.cli import fastpath

    for name in ("LAYERFS_ROOT", "LAYERFS_RUNTIME"):
        monkeypatch.delenv(name, raising=False)
    fast = fastpath.parse(fastpath.COMMANDS[argv[0]](), argv[1:])
    assert fast is not None and fast == click_params(argv)
    monkeypatch.setenv("LAYERFS_ROOT", "/from-env")
    fast = fastpath.parse(fastpath.COMMANDS[argv[0]](), argv[1:])
    assert fast is not None and fast == click_params(argv)


@pytest.mark.parametrize("argv", CLICK_ONLY_ARGVS, ids=" ".join)
def test_the_fast_path_leaves_the_rest_to_click(argv):
    from layerfs.cli import fastpath

    spec = fastpath.COMMANDS.get(argv[0])
    assert spec is None or fastpath.parse(spec(), argv[1:]) is None


def test_the_entry_point_sends_the_fast_path_its_commands_only(tmp_path):
    from layerfs.cli import fastpath, main

    assert set(main.NODE_CLIENT_COMMANDS) == set(fastpath.COMMANDS)
    proc, names = imported_modules("ls", "--store", f"file://{tmp_path}")
    assert proc.returncode == 0 and "layerfs.cli.fastpath" not in names


def test_a_node_command_does_not_import_click(tmp_path):
    proc, names = imported_modules("ps", "--root", str(tmp_path))
    assert proc.returncode == DaemonNotRunning.exit_code
    assert "layerfs.node.client" in names and "click" not in names
    proc, names = imported_modules("ps", "--help")
    assert proc.returncode == 0 and "click" in names  # help is click's


def test_a_node_command_whose_reader_leaves_ends_quietly(tmp_path):
    """``layerfs ps | head -1``: the rest of the output is dropped, no traceback,
    status 0 (as click's commands do)."""
    rows = [{"id": f"s{i}", "layers": [], "rootfs": "/r", "state": "up"} for i in range(20000)]
    thread = serve_one_answer(tmp_path, {"sandboxes": rows})
    script = f'{" ".join(LAYERFS)} ps --root {tmp_path} | head -1; exit "${{PIPESTATUS[0]}}"'
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    thread.join(30)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.split()[:2] == ["ID", "STATE"]
