"""Errors as a contract: one exit code per meaning, listed in README.md's
table, the same in every command and across the node's control socket; with
``--json`` also one JSON document on stdout; never a traceback; one time
format in JSON output."""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.basenode import node  # noqa: F401  (the fixture: a daemon with base@1)
from support.gentree import write_tree

import layerfs
from harness.daemonproc import LAYERFS
from layerfs import errors
from layerfs.errors import LayerfsError
from layerfs.node import Client, control
from layerfs.node.control import RemoteError

pytestmark = pytest.mark.end_to_end  # the CLI and outside tools, end to end

ROOT = Path(__file__).resolve().parent.parent
TABLE_ROW = re.compile(r"^\| (\d+)(?:-(\d+))? \| (.+) \|$")
NOT_A_CLASS = {1: "an operating-system error", 130: "interrupted"}  # codes no class carries
ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{6})?Z$")


def exit_table() -> dict[int, str]:
    """README.md's exit-code table: code → meaning."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Errors and exit codes"):]
    table: dict[int, str] = {}
    for line in section[section.index("| exit | meaning |"):].splitlines()[2:]:
        match = TABLE_ROW.match(line)
        if match is None:
            break
        first, last, meaning = match.groups()
        for code in range(int(first), int(last or first) + 1):
            table[code] = meaning
    return table


def every_error_class() -> dict[str, type[LayerfsError]]:
    """Every LayerfsError class in the package (each module imported), by kind."""
    for module in pkgutil.walk_packages(layerfs.__path__, "layerfs."):
        importlib.import_module(module.name)
    return control.error_classes()


# what a caller of layerfs.node.Client loads (its calls import the rest lazily)
API_MODULES = ("layerfs.node.client", "layerfs.node.control", "layerfs.node.protocol",
               "layerfs.node.containers.bundle", "layerfs.node.containers.imageuser",
               "layerfs.node.containers.runner",
               "layerfs.node.sandboxes.limits", "layerfs.node.sandboxes.rootspace", "layerfs.sizes",
               "layerfs.records", "layerfs.imageconfig", "layerfs.safeopen")


def test_every_error_the_python_api_raises_is_importable_from_layerfs_errors():
    from layerfs.errors import (  # noqa: F401  (the README's names, from the one place)
        BadMessage,
        BundleError,
        ControlSocketDenied,
        DaemonNotRunning,
        ImageFileError,
        ImageUserError,
        LimitUnsupported,
        NodeFull,
        RemoteError,
        SandboxBusy,
        SandboxNotFound,
        SandboxNotUp,
        UnsafeBundleDir,
    )

    for name in API_MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if isinstance(value, type) and issubclass(value, LayerfsError):
                assert getattr(errors, attr, None) is value, f"{name}.{attr} not in layerfs.errors"
    # the old homes name the same classes
    from layerfs.node import client, protocol
    from layerfs.node.containers import bundle, imageuser
    assert (control.DaemonNotRunning, control.RemoteError) == (DaemonNotRunning, RemoteError)
    assert (client.SandboxNotUp, protocol.BadMessage) == (SandboxNotUp, BadMessage)
    assert (bundle.BundleError, imageuser.ImageUserError) == (BundleError, ImageUserError)
    readme = (ROOT / "README.md").read_text()
    assert "from layerfs.errors import DaemonNotRunning, SandboxNotUp, SandboxBusy" in readme


def test_the_readme_table_lists_every_error_class_and_nothing_else():
    table = exit_table()
    assert table, "no exit-code table in README.md"
    classes = every_error_class()
    assert len(classes) > 40 and "SandboxNotFound" in classes  # found them all
    unlisted = {kind: cls.exit_code for kind, cls in classes.items()
                if cls.exit_code not in table}
    assert unlisted == {}, f"exit codes missing from README.md's table: {unlisted}"
    assert all(meaning.strip() for meaning in table.values())
    used = {cls.exit_code for cls in classes.values()}
    unused = set(table) - used - set(NOT_A_CLASS)
    assert unused == set(), f"README.md lists codes no error class has: {unused}"
    for code, words in NOT_A_CLASS.items():
        assert words in table[code]
    from layerfs.store.check import StoreNotSafe

    readme = (ROOT / "README.md").read_text()
    assert f"`NOT safe to share` with the counts (exit {StoreNotSafe.exit_code})" in readme
    # the kinds are the class names, one class each (what --json and the daemon carry)
    names = [c.__name__ for c in classes.values()]
    assert len(names) == len(set(names)) and all(k == c.kind for k, c in classes.items())


def test_not_found_exists_and_busy_are_three_codes():
    assert errors.SandboxNotFound.exit_code == 5 and errors.SandboxExists.exit_code == 9
    codes = {name: every_error_class()[name].exit_code for name in (
        "RefNotFound", "ObjectNotFound", "SandboxNotFound", "DiskNotFound", "VmNotFound",
        "SandboxExists", "DiskExists", "VmExists", "SandboxBusy", "SandboxInUse", "DiskBusy",
        "VersionExists")}
    assert codes == {"RefNotFound": 5, "ObjectNotFound": 5, "SandboxNotFound": 5,
                     "DiskNotFound": 5, "VmNotFound": 5, "SandboxExists": 9, "DiskExists": 9,
                     "VmExists": 9, "SandboxBusy": 15, "SandboxInUse": 15, "DiskBusy": 15,
                     "VersionExists": 4}


def layerfs_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*LAYERFS, *args], capture_output=True, text=True, timeout=120,
                          env=env)


def one_line(proc: subprocess.CompletedProcess, code: int) -> str:
    """The one error line of a command that failed with ``code``."""
    lines = proc.stderr.splitlines()
    assert (proc.returncode, len(lines)) == (code, 1), (proc.returncode, proc.stderr[-2000:])
    assert lines[0].startswith("layerfs: error: ") and "Traceback" not in proc.stderr
    return lines[0]


def json_error(proc: subprocess.CompletedProcess) -> dict:
    """The JSON error document on stdout; it agrees with the exit status and stderr."""
    doc = json.loads(proc.stdout)
    assert set(doc) == {"error", "exit", "kind"}, doc
    assert doc["exit"] == proc.returncode != 0, (doc, proc.returncode)
    assert proc.stderr.strip() == f"layerfs: error: {doc['error']}", proc.stderr
    return doc


@pytest.mark.parametrize("args", [
    ("ls", "--store", "s3://bucket/p", "--s3-endpoint", "127.0.0.1:18103"),
    ("ls", "--store", "s3://bucket/p", "--s3-endpoint", "http://127.0.0.1:9,127.0.0.1:18103"),
])
def test_an_s3_endpoint_without_a_scheme_is_one_line(args):
    line = one_line(layerfs_cli(*args), 2)
    assert line == ("layerfs: error: S3 endpoint '127.0.0.1:18103' needs a scheme: "
                    "http://127.0.0.1:18103 or https://127.0.0.1:18103")


def test_a_store_url_without_a_scheme_is_one_line(tmp_path):
    for args in (("ls", "--store", "layerfs/prod"), ("env", "ls", "--store", "layerfs/prod"),
                 ("store", "check", "layerfs/prod")):
        assert one_line(layerfs_cli(*args), 2) == (
            "layerfs: error: store URL 'layerfs/prod' needs a scheme: file:///path or "
            "s3://bucket/prefix")
    assert not Path("layerfs/prod").exists()
    assert "needs a scheme" in one_line(layerfs_cli("ls", "--store", "://x"), 2)


@pytest.mark.parametrize("endpoint", ["http://[::1", "http://h:notaport", "ftp://h", "http://"])
def test_a_malformed_s3_endpoint_is_one_line(endpoint):
    proc = layerfs_cli("ls", "--store", "s3://bucket/p", "--s3-endpoint", endpoint)
    assert one_line(proc, 2) == (f"layerfs: error: S3 endpoint {endpoint!r}: expected "
                                 "http://HOST[:PORT] or https://HOST[:PORT]")


def test_errors_under_json_are_one_json_document(tmp_path):
    (tmp_path / "store").mkdir()  # an empty store (a missing directory is unreachable, 8)
    store = ["--store", f"file://{tmp_path / 'store'}"]
    cases = [(("inspect", "nothere@1", *store), 5, "RefNotFound", "no such layer or env"),
             (("ls", "--store", "layerfs/prod"), 2, "UsageError", "needs a scheme"),
             (("build", str(tmp_path), "--name", "Bad", "--version", "1", *store), 2,
              "InvalidName", "invalid name"),
             (("ps", "--root", str(tmp_path / "nonode")), 10, "DaemonNotRunning",
              "no layerfs daemon answers")]
    for args, code, kind, words in cases:
        proc = layerfs_cli(*args, "--json")
        doc = json_error(proc)
        assert (doc["exit"], doc["kind"]) == (code, kind) and words in doc["error"], doc
    usage = layerfs_cli("build", "--json", str(tmp_path), *store)  # click's: --name missing
    assert usage.returncode == 2
    doc = json.loads(usage.stdout)
    assert doc["kind"] == "UsageError" and "--name" in doc["error"] and doc["exit"] == 2
    assert layerfs_cli("ls", "--store", "layerfs/prod").stdout == ""  # without --json: text


def test_build_json_uploaded_bytes_is_this_push(tmp_path):
    store = ["--store", f"file://{tmp_path / 'store'}"]
    write_tree(tmp_path / "a", 3, files=3)
    args = ("build", str(tmp_path / "a"), "--name", "u", "--version", "1", "--json", *store)
    first = json.loads(layerfs_cli(*args).stdout)
    again = json.loads(layerfs_cli(*args).stdout)
    assert first["published"] and first["stats"]["uploaded_bytes"] > 0
    assert not again["published"] and again["digest"] == first["digest"]
    assert (again["stats"]["uploaded_bytes"], again["stats"]["uploaded_packs"]) == (0, 0)
    listed = json.loads(layerfs_cli("ls", "--json", *store).stdout)
    assert ISO_UTC.match(listed[0]["created"]), listed


# -- the node: its errors cross the control socket with their kind --

def test_no_such_sandbox_is_5_and_a_taken_id_9_in_every_command(node):  # noqa: F811
    for args in (("run", "nosuch", "--", "true"), ("down", "nosuch"),
                 ("commit", "nosuch", "--name", "ws", "--version", "1")):
        assert one_line(node.cli(*args, check=False), 5) == (
            "layerfs: error: sandbox nosuch: no such sandbox"), args
    node.cli("up", "--layer", "base@1", "--id", "taken")
    try:
        taken = node.cli("up", "--layer", "base@1", "--id", "taken", check=False)
        assert one_line(taken, 9) == "layerfs: error: sandbox taken: already exists"
        doc = json_error(node.cli("up", "--layer", "base@1", "--id", "taken", "--json",
                                  check=False))
        assert (doc["exit"], doc["kind"]) == (9, "SandboxExists")
        assert [r.id for r in Client(node.root).ps()] == ["taken"]  # the first one, unharmed
    finally:
        node.cli("down", "taken")
    doc = json_error(node.cli("down", "nosuch", "--json", check=False))
    assert doc == {"error": "sandbox nosuch: no such sandbox", "exit": 5,
                   "kind": "SandboxNotFound"}
    doc = json_error(node.cli("up", "--layer", "nothere@1", "--id", "x", "--json",
                              check=False))
    assert (doc["exit"], doc["kind"]) == (5, "RefNotFound"), doc


def test_the_api_raises_the_daemons_error_class(node):  # noqa: F811
    client = Client(node.root)
    with pytest.raises(errors.SandboxNotFound) as missing:
        client.down("nosuch")
    assert isinstance(missing.value, RemoteError)  # what callers caught so far still works
    assert (missing.value.exit_code, missing.value.kind) == (5, "SandboxNotFound")
    assert str(missing.value) == "sandbox nosuch: no such sandbox"
    with pytest.raises(errors.SandboxNotFound):
        client.run("nosuch", ["true"])
    client.up("api", layers=["base@1"])
    try:
        with pytest.raises(errors.SandboxExists) as taken:
            client.up("api", layers=["base@1"])
        assert taken.value.exit_code == 9 and isinstance(taken.value, RemoteError)
    finally:
        client.down("api")


def test_created_is_iso_utc_in_every_json_output(node):  # noqa: F811
    up = json.loads(node.cli("up", "--layer", "base@1", "--id", "t", "--json").stdout)
    try:
        rows = json.loads(node.cli("ps", "--json").stdout)
    finally:
        down = json.loads(node.cli("down", "t", "--json").stdout)
    for doc in (up, rows[0], down):
        assert ISO_UTC.match(doc["created"]) and doc["created"].endswith("Z"), doc
    assert up["created"] == rows[0]["created"] == down["created"]
    assert Client(node.root).ps() == []


# the CLI as another user runs it: the system interpreter (the test's may be in a
# directory only root can enter) with this checkout's packages
AS_USER_CLI = ("import site, sys; site.addsitedir(sys.argv.pop(1)); "
               "from layerfs.cli.main import main; main()")


def test_a_non_root_caller_gets_one_line_saying_what_to_do(node, local_user):  # noqa: F811
    site_dir = next(p for p in sys.path if p.endswith("site-packages"))  # (the editable
    # install's finder is there)
    for args in (("ps",), ("up", "--layer", "base@1", "--id", "x"), ("down", "x")):
        proc = local_user.python(AS_USER_CLI, site_dir, *args, "--root", str(node.root))
        lines = proc.stderr.decode().splitlines()
        assert (proc.returncode, lines) == (2, [
            f"layerfs: error: permission denied on {node.root}/control.sock: only root "
            "drives the node daemon (run this as root)"]), (args, proc.stderr[-2000:])
    assert Client(node.root).ps() == []
