"""``layerfs store init``: it creates a store's bucket (S3) or directory
(file://), checks credentials, conditional puts and read-after-write, and
gives one verdict; and the node daemon runs the same quick checks at start,
saying on one line what is wrong while it serves what it has."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from support import need_root
from support.baseenv import publish_base_env
from support.nodes import NodeDaemon, wait_for_log
from support.users import LocalUser, local_user  # noqa: F401 - a fixture

from layerfs.errors import AccessDenied, StoreError
from layerfs.refstore import ENVS, RefStore
from layerfs.store.check import StoreNotSafe, quick_check
from layerfs.store.file import FileStore
from layerfs.store.s3 import S3Store

USABLE = re.compile(r"^(\S+): usable \((created; )?credentials, conditional put,"
                    r" read-after-write ok\)$")


def layerfs(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layerfs.cli.main", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def usable(proc: subprocess.CompletedProcess) -> tuple[str, bool]:
    """The verdict's URL and whether the store was created."""
    assert proc.returncode == 0, proc.stderr
    found = USABLE.match(proc.stdout.strip())
    assert found, proc.stdout
    return found[1], found[2] is not None


def one_error_line(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    line, = proc.stderr.strip().splitlines()
    assert line.startswith("layerfs: error: ")
    return line


def test_init_creates_the_directory_and_again_is_idempotent(tmp_path):
    root = tmp_path / "new" / "store"
    url = "file://" + str(root)
    first = layerfs("store", "init", url)
    assert usable(first) == (url, True) and first.stderr == ""  # no warning
    assert root.is_dir() and not (root / "check").exists()  # its probe keys are gone
    assert usable(layerfs("store", "init", url)) == (url, False)
    doc = json.loads(layerfs("store", "init", url, "--json").stdout)
    assert (doc["usable"], doc["created"], doc["failed"]) == (True, False, None)
    assert doc["passed"] == ["credentials", "conditional put", "read-after-write"]


def test_init_creates_a_missing_bucket_and_again_is_idempotent(s3_server):
    bucket = f"layerfs-init-{uuid.uuid4().hex[:12]}"
    url = f"s3://{bucket}/some/prefix"
    probe = S3Store(bucket, endpoint=s3_server.endpoint)
    try:
        assert not probe.bucket_exists()
        first = layerfs("store", "init", url, "--s3-endpoint", s3_server.endpoint)
        assert usable(first)[1] is True
        assert probe.bucket_exists()
        assert probe.list("") == []  # the checks' keys are deleted
        assert usable(layerfs("store", "init", url, "--s3-endpoint", s3_server.endpoint))[1] \
            is False
    finally:
        probe.close()


def test_init_with_bad_credentials_is_access_denied(s3_server):
    url = f"s3://layerfs-init-{uuid.uuid4().hex[:12]}/p"
    proc = layerfs("store", "init", url, "--s3-endpoint", s3_server.endpoint,
                   env={"AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    line = one_error_line(proc, AccessDenied.exit_code)
    assert "access denied by store" in line and "check the credentials" in line, line
    as_json = layerfs("store", "init", url, "--s3-endpoint", s3_server.endpoint, "--json",
                      env={"AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    doc = json.loads(as_json.stdout)
    assert (doc["usable"], doc["exit"], doc["kind"]) == (False, 12, "AccessDenied")


def test_init_under_a_read_only_directory_is_one_line_exit_12(tmp_path):
    need_root()  # root writes through a mode 0555 directory: a read-only mount it is
    parent = tmp_path / "ro"
    parent.mkdir()
    subprocess.run(["mount", "--bind", str(parent), str(parent)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(parent)], check=True)
        proc = layerfs("store", "init", f"file://{parent}/store")
        line = one_error_line(proc, AccessDenied.exit_code)
        assert "read-only file system" in line and "writable" in line, line
    finally:
        subprocess.run(["umount", str(parent)], check=True)


@pytest.mark.parametrize("how", ["owned", "world-writable", "group-writable folder"])
def test_init_warns_of_a_directory_another_user_can_change(tmp_path, local_user, how):  # noqa: F811
    """Root's `store init` on a directory a local user owns, or others may
    write (the store's, or a folder of it): usable, and one warning line."""
    root = tmp_path / "store"
    url = "file://" + str(root)
    assert usable(layerfs("store", "init", url)) == (url, True)
    changed = root / "blobs" if how == "group-writable folder" else root
    changed.mkdir(exist_ok=True)
    if how == "owned":
        os.chown(root, local_user.uid, local_user.gid)
        expected = f"{root} belongs to uid {local_user.uid}, not root: that user can plant"
    else:
        changed.chmod(0o777 if how == "world-writable" else 0o775)
        mode = "0777" if how == "world-writable" else "0775"
        whom = "others" if how == "world-writable" else "its group"
        expected = f"{changed} is writable by {whom} (mode {mode}): they can plant"
    proc = layerfs("store", "init", url)
    assert usable(proc) == (url, False)
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"layerfs: warning: {expected}"), line
    doc = json.loads(layerfs("store", "init", url, "--json").stdout)
    assert doc["usable"] and len(doc["warnings"]) == 1 and expected in doc["warnings"][0]


def test_a_put_if_absent_that_does_not_refuse_a_second_create_is_not_usable(tmp_path):
    class Overwrites(FileStore):
        def _put_if_absent(self, key: str, data: bytes) -> bool:
            self._put(key, data)
            return True

    result = quick_check(Overwrites(tmp_path))
    assert (result.usable, result.failed, result.passed) == (False, "conditional put",
                                                             ("credentials",))
    refusal = result.refusal()
    assert isinstance(refusal, StoreNotSafe) and refusal.exit_code == 13
    assert "was not refused" in str(refusal)


MISSING = (r"WARNING layerfs\.node\.replica\.storehealth: store s3://layerfs-gone-\w+/: not usable:"
           r" credentials: store error: bucket 'layerfs-gone-\w+' does not exist at \S+;"
           r" create it with `layerfs store init s3://layerfs-gone-\w+/`; serving what")


@pytest.mark.daemon_log(MISSING)
def test_a_daemon_on_a_missing_bucket_says_so_and_serves_what_it_has(tmp_path, s3_server):
    store = S3Store("layerfs-test", f"t/{uuid.uuid4().hex[:16]}", s3_server.endpoint)
    publish_base_env(tmp_path, store)
    digest = RefStore(store).resolve(ENVS, "e@1")
    node = NodeDaemon(tmp_path / "node", ["--store", store.url, "--s3-endpoint",
                                          s3_server.endpoint], cache_size="64M").start()
    try:
        rootfs = Path(node.cli("up", "e@1", "--id", "s1").stdout.strip())
        want = (rootfs / "data" / "file0").read_bytes()
        node.kill()
        node.store_args = ["--store", f"s3://layerfs-gone-{uuid.uuid4().hex[:12]}/",
                           "--s3-endpoint", s3_server.endpoint]
        node.start()
        wait_for_log(node, MISSING)
        assert (rootfs / "data" / "file0").read_bytes() == want
        again = Path(node.cli("up", digest, "--id", "s2").stdout.strip())
        assert (again / "data" / "file0").read_bytes() == want
        for sid in ("s1", "s2"):
            node.cli("down", sid)
    finally:
        left = node.cleanup()
        store.close()
        assert left == [], f"mounts left behind: {left}"


def test_quick_check_error_keeps_its_class_and_exit_code():
    class Fails(FileStore):
        def _list(self, prefix):
            raise StoreError("something odd")

    result = quick_check(Fails("/nonexistent-store"))
    assert type(result.refusal()) is StoreError and "see the error above" in result.verdict()


def test_store_check_on_a_missing_bucket_says_so_in_one_line(s3_server):
    bucket = f"layerfs-init-{uuid.uuid4().hex[:12]}"
    proc = layerfs("store", "check", f"s3://{bucket}/p", "--s3-endpoint", s3_server.endpoint,
                   "--rounds", "1", "--writers", "2")
    line = one_error_line(proc, StoreError.exit_code)
    assert f"bucket '{bucket}' does not exist" in line, line
    assert f"create it with `layerfs store init s3://{bucket}/p/`" in line, line
