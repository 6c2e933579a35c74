"""The ``layerfs`` command line, run as a process, on both store backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from support import need_root
from support.cli import layerfs, one_line_error
from support.gentree import write_tree

from harness.daemonproc import LAYERFS
from layerfs.mounts import MS_RDONLY, mount, umount
from layerfs.store.base import blob_key

pytestmark = pytest.mark.end_to_end  # the CLI and outside tools, end to end

MS_BIND, MS_REMOUNT = 4096, 32


def test_build_env_inspect_verify_gc(tmp_path, store, store_args):
    for seed, name in enumerate(("base", "tool", "ws")):
        write_tree(tmp_path / name, seed, files=4)
    layerfs("build", str(tmp_path / "base"), "--name", "s/base", "--version", "1",
            "--chunk-size", "16K", *store_args)
    layerfs("build", str(tmp_path / "tool"), "--name", "s/tool", "--version", "1",
            "--role", "toolchain", *store_args)
    layerfs("build", str(tmp_path / "ws"), "--name", "s/ws", "--version", "1",
            "--role", "workspace", *store_args)
    env1 = json.loads(layerfs("env", "create", "s/env@1", "--layer", "s/ws@1", "--layer",
                              "s/tool@1", "--layer", "s/base@1", "--json", *store_args).stdout)
    (tmp_path / "tool" / "new-file").write_bytes(b"v2" * 1000)
    tool2 = json.loads(layerfs("build", str(tmp_path / "tool"), "--name", "s/tool",
                               "--version", "2", "--role", "toolchain", "--json",
                               *store_args).stdout)
    assert tool2["published"] and tool2["stats"]["reused_chunks"] > 0
    layerfs("env", "create", "s/env@2", "--layer", "s/ws@1", "--layer", "s/tool@2",
            "--layer", "s/base@1", *store_args)
    e1 = json.loads(layerfs("inspect", "s/env@1", "--json", *store_args).stdout)
    e2 = json.loads(layerfs("inspect", "s/env@2", "--json", *store_args).stdout)
    assert e1["digest"] == env1["digest"]
    # unchanged layers are the very same manifests: not rebuilt, not re-uploaded
    assert [x["digest"] for x in e1["layers"]][::2] == [x["digest"] for x in e2["layers"]][::2]
    assert e1["layers"][1]["digest"] != e2["layers"][1]["digest"]
    layer = json.loads(layerfs("inspect", "s/tool@2", "--json", *store_args).stdout)
    assert layer["shared_bytes"] > 0 and layer["stored_bytes"] > 0
    assert layer["dedup_sources"] == ["s/tool@1"]
    names = [r["ref"] for r in json.loads(layerfs("ls", "--json", *store_args).stdout)]
    assert names == ["s/base@1", "s/tool@1", "s/tool@2", "s/ws@1"]
    envs = json.loads(layerfs("env", "ls", "--json", *store_args).stdout)
    assert [e["ref"] for e in envs] == ["s/env@1", "s/env@2"]
    assert "ok" in layerfs("verify", "s/env@2", *store_args).stdout
    gc = json.loads(layerfs("gc", "--dry-run", "--json", *store_args).stdout)
    assert gc["unreachable"] == []
    text = layerfs("inspect", "s/tool@2", *store_args).stdout
    assert "shared with other layers" in text and "compression" in text


def test_verify_finds_a_corrupt_chunk(tmp_path, store, store_args):
    write_tree(tmp_path / "a", 9, files=3)
    out = json.loads(layerfs("build", str(tmp_path / "a"), "--name", "c", "--version", "1",
                             "--chunk-size", "16K", "--json", *store_args).stdout)
    from layerfs.refstore import RefStore
    refstore = RefStore(store)
    table = refstore.chunk_table(refstore.layer(out["digest"]))
    pack = table.entries[0].pack
    data = bytearray(store.get(blob_key(pack)))
    data[table.entries[0].pack_offset + 3] ^= 0xFF
    store.put(blob_key(pack), bytes(data))
    proc = layerfs("verify", "c@1", *store_args, check=False)
    assert "1 bad" in proc.stdout
    assert one_line_error(proc, 6).endswith("verify c@1: 1 bad objects (1 corrupt)")


@pytest.mark.parametrize("args,code,words", [
    (["build", "/does/not/exist", "--name", "a", "--version", "1"], 3, "no such file"),
    (["build", "SRC", "--name", "Upper", "--version", "1"], 2, "invalid name"),
    (["build", "SRC", "--name", "a", "--version", "bad version"], 2, "invalid version"),
    (["build", "SRC", "--name", "a", "--version", "1", "--chunk-size", "3000"], 2,
     "power of two"),
    (["inspect", "nothere@1"], 5, "no such layer or env"),
    (["env", "create", "e@1", "--layer", "missing@1"], 5, "no such layer"),
    (["daemon", "--store-fetches", "0"], 2, "--store-fetches 0: at least 1"),
])
def test_bad_input_is_one_line(tmp_path, args, code, words):
    write_tree(tmp_path / "src", 1, files=1)
    (tmp_path / "store").mkdir()  # an empty store (a missing one is unreachable to readers)
    args = [str(tmp_path / "src") if a == "SRC" else a for a in args]
    proc = layerfs(*args, "--store", f"file://{tmp_path / 'store'}", check=False)
    assert words in one_line_error(proc, code)


def test_version_exists_and_unsafe_tar(tmp_path):
    store = ["--store", f"file://{tmp_path / 'store'}"]
    write_tree(tmp_path / "a", 1, files=2)
    write_tree(tmp_path / "b", 2, files=2)
    layerfs("build", str(tmp_path / "a"), "--name", "x", "--version", "1", *store)
    proc = layerfs("build", str(tmp_path / "b"), "--name", "x", "--version", "1", *store,
                   check=False)
    assert "already exists with other content" in one_line_error(proc, 4)
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escape")
        tar.addfile(info, io.BytesIO(b""))
    (tmp_path / "bad.tar").write_bytes(buf.getvalue())
    proc = layerfs("build", str(tmp_path / "bad.tar"), "--name", "y", "--version", "1", *store,
                   check=False)
    assert "unsafe tar entry" in one_line_error(proc, 3)


def test_unreachable_s3_store(tmp_path):
    write_tree(tmp_path / "a", 1, files=1)
    env = dict(os.environ, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y",
               AWS_DEFAULT_REGION="us-east-1")
    start = time.monotonic()
    proc = layerfs("build", str(tmp_path / "a"), "--name", "a", "--version", "1",
                   "--store", "s3://bucket/p", "--s3-endpoint", "http://127.0.0.1:9",
                   check=False, env=env)
    assert "unreachable" in one_line_error(proc, 8)
    assert time.monotonic() - start < 60


def test_read_only_store(tmp_path):
    need_root()
    write_tree(tmp_path / "a", 1, files=2)
    ro = tmp_path / "ro"
    ro.mkdir()
    mount(str(ro), str(ro), "", MS_BIND)
    try:
        mount("", str(ro), "", MS_BIND | MS_REMOUNT | MS_RDONLY)
        proc = layerfs("build", str(tmp_path / "a"), "--name", "a", "--version", "1",
                       "--store", f"file://{ro}/store", check=False)
        assert "read-only" in one_line_error(proc, 12)
    finally:
        umount(str(ro))
    assert not (ro / "store" / "refs").exists()


def test_progress_line_on_a_terminal(tmp_path):
    """With stderr on a terminal, build draws files, bytes and throughput there."""
    import pty

    write_tree(tmp_path / "a", 5, files=30, size=200_000)
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "layerfs.cli.main", "build", str(tmp_path / "a"), "--name",
         "p", "--version", "1", "--store", f"file://{tmp_path / 'store'}"],
        stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    out, _ = proc.communicate(timeout=120)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert proc.returncode == 0
    assert b"build p@1: 30 files" in seen and b"/s" in seen
    assert b"p@1 sha256:" in out


@pytest.mark.parametrize("args, hint", [
    (("env", "create", "n@1", "--layer", "a@1", "b@1", "c@1"),
     "repeat --layer for each value: --layer a@1 --layer b@1 --layer c@1"),
    (("up", "--layer", "a@1", "b@1", "--id", "x"),
     "several layers: repeat --layer, --layer A --layer B"),
])
def test_values_after_a_repeated_option_get_the_hint_to_repeat_it(tmp_path, args, hint):
    """``--layer A B C`` (one option, several values) is a usage error that says
    how to give several: the option once per value."""
    store = ["--store", f"file://{tmp_path / 'store'}"] if args[0] == "env" else \
        ["--root", str(tmp_path / "root")]
    proc = subprocess.run([*LAYERFS, *args, *store], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and hint in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].count(hint) == 1
