"""A file store written by someone hostile (issue 39, point 2): a FIFO, a
symlink to a root-only file, a device node or a directory put at a ref,
manifest, meta image, chunk table or pack key. Root's commands and the node
daemon read each as hostile input: nothing hangs, nothing is followed, the
root-only file's bytes appear in no output and no log, each refusal is one
line, and the daemon still stops at once. The planting is done by an
unprivileged user who may write the store (a device node, which no such user
can make, by root)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import build, need_root
from support.nodes import NodeDaemon, serving
from support.users import LocalUser, local_user  # noqa: F401 - a fixture

from layerfs.errors import StoreError
from layerfs.refstore import RefStore, ref_key
from layerfs.store.base import blob_key
from layerfs.store.file import FileStore

pytestmark = pytest.mark.end_to_end  # root commands and a node on a hostile store

CHUNK = 65536
KEYS = ("ref", "manifest", "meta", "table", "pack")
KINDS = ("fifo", "symlink", "device", "directory")
SECRET = b"ROOT-ONLY-SECRET-7f3c1a"
LAYERFS = [sys.executable, "-m", "layerfs.cli.main"]
WHAT = {"fifo": "not a regular file (a FIFO)", "device": "a character device",
        "symlink": "a symlink", "directory": "not found"}  # a directory is no object


def expected(kind: str, name: str) -> str:
    """What the error line says of a ``kind`` at layer ``name``'s key."""
    if kind == "directory" and name == "ref":
        return "no such layer"
    return WHAT[kind]


@dataclass(frozen=True)
class Planted:
    """A store whose layer NAME@1 has a hostile object at the key NAME names."""

    dir: Path
    secret: Path  # a root-only file the symlinks point at
    keys: dict[str, str]  # layer name → the store key replaced

    @property
    def url(self) -> str:
        return f"file://{self.dir}"


def build_layers(store: FileStore, tmp_path: Path) -> dict[str, str]:
    """One layer per key kind, each of its own bytes; name → the key to replace."""
    keys = {}
    for name in KEYS:
        src = tmp_path / f"src-{name}"
        src.mkdir()
        (src / "data").write_bytes(os.urandom(3 * CHUNK))
        before = {o.key for o in store.list("blobs/")}
        result = build(store, str(src), name=name, chunk_size=CHUNK)
        manifest = RefStore(store).layer(result.digest)
        named = {"ref": ref_key("layers", name, "1"), "manifest": blob_key(result.digest),
                 "meta": blob_key(manifest.meta.digest),
                 "table": blob_key(manifest.chunk_table.digest)}
        packs = {o.key for o in store.list("blobs/")} - before - set(named.values())
        named["pack"] = packs.pop()
        keys[name] = named[name]
    return keys


def plant(user: LocalUser, kind: str, path: Path, secret: Path) -> None:
    """Replace the object at ``path`` with a ``kind``, as the store's hostile writer."""
    assert user.run("rm", "-f", str(path)).returncode == 0
    if kind == "device":  # root's: no writer without privileges can make one
        os.mknod(path, stat.S_IFCHR | 0o644, os.makedev(1, 3))
        return
    argv = {"fifo": ["mkfifo", str(path)], "symlink": ["ln", "-s", str(secret), str(path)],
            "directory": ["mkdir", str(path)]}[kind]
    proc = user.run(*argv)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def reachable(tmp_path) -> Iterator[Path]:
    """A directory every user may reach (pytest's own are root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="layerfs-hostile-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


@pytest.fixture(params=KINDS)
def planted(request, tmp_path, reachable, local_user) -> Planted:  # noqa: F811 - the fixture
    need_root()
    store_dir = reachable / "store"
    keys = build_layers(FileStore(store_dir), tmp_path)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    secret = private / "key"
    secret.write_bytes(SECRET + b"\n")
    secret.chmod(0o600)
    for dirpath, _, files in os.walk(store_dir):  # the store's writer is that user
        for name in [".", *files]:
            os.chown(os.path.join(dirpath, name), local_user.uid, local_user.gid)
    for key in keys.values():
        plant(local_user, request.param, store_dir / key, secret)
    return Planted(store_dir, secret, keys)


def layerfs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*LAYERFS, *args], capture_output=True, text=True, timeout=60)


def one_line(proc: subprocess.CompletedProcess, *expected: str) -> str:
    """The single ``layerfs:`` error line of a failed command, which quotes no secret."""
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("layerfs: "), proc.stderr
    assert SECRET.decode() not in proc.stderr + proc.stdout
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def kind_of(planted: Planted) -> str:
    mode = os.lstat(planted.dir / planted.keys["ref"]).st_mode
    return next(k for k, test in (("fifo", stat.S_ISFIFO), ("symlink", stat.S_ISLNK),
                                  ("device", stat.S_ISCHR), ("directory", stat.S_ISDIR))
                if test(mode))


def test_root_commands_refuse_a_hostile_object_in_one_line(planted):
    kind = kind_of(planted)
    for name in ("ref", "manifest", "meta", "table"):
        one_line(layerfs("inspect", f"{name}@1", "--store", planted.url), expected(kind, name))
    verify = layerfs("verify", "pack@1", "--store", planted.url)
    one_line(verify, "1 bad objects")
    (bad,) = [line for line in verify.stdout.splitlines() if "pack sha256:" in line]
    assert ("missing" if kind == "directory" else WHAT[kind]) in bad, bad
    listing = layerfs("ls", "--store", planted.url)
    assert SECRET.decode() not in listing.stdout + listing.stderr
    assert all(line.startswith("layerfs: ") for line in listing.stderr.splitlines())
    dry = layerfs("gc", "--dry-run", "--store", planted.url)
    assert SECRET.decode() not in dry.stdout + dry.stderr
    assert all(line.startswith("layerfs: ") for line in dry.stderr.splitlines())
    assert planted.secret.read_bytes() == SECRET + b"\n"


@pytest.fixture
def node(starts_a_server, tmp_path, planted) -> Iterator[NodeDaemon]:
    yield from serving(NodeDaemon(tmp_path / "node", ["--store", planted.url],
                                  cache_size="64M", read_timeout=2.0))


@pytest.mark.daemon_log(r"(chunk|chunks of pack) \S+.*: (integrity check failed for \S+: not a"
                        r" regular file \(a [a-zA-Z ]+\)|object not found in store: \S+)$",
                        # a directory at the pack's key is no pack: the sandbox's data is lost
                        r"ERROR layerfs\.node\.sandboxes\.dataloss: sandbox p: the data of its "
                        r"layer ")
def test_a_node_refuses_a_hostile_object_and_still_stops_at_once(node, planted):
    kind = kind_of(planted)
    for i, name in enumerate(("ref", "manifest", "meta", "table")):
        proc = node.cli("up", "--layer", f"{name}@1", "--id", f"s{i}", check=False)
        one_line(proc, expected(kind, name))
    rootfs = Path(node.cli("up", "--layer", "pack@1", "--id", "p").stdout.strip())
    read = subprocess.run(["cat", str(rootfs / "data")], capture_output=True, timeout=60)
    assert read.returncode != 0 and b"Input/output error" in read.stderr
    node.cli("down", "p")
    assert node.stop(timeout=30) == 0  # no thread left hanging in an open()
    assert SECRET.decode() not in node.log()


def test_a_symlinked_folder_below_the_store_root_is_not_followed(tmp_path):
    need_root()
    store_dir = tmp_path / "store"
    build_layers(FileStore(store_dir), tmp_path)
    elsewhere = tmp_path / "private" / "evil"
    elsewhere.mkdir(parents=True)
    (elsewhere / "1").write_bytes(SECRET + b"\n")
    (tmp_path / "private").chmod(0o700)
    os.symlink(elsewhere, store_dir / "refs" / "layers" / "evil")
    url = f"file://{store_dir}"
    one_line(layerfs("inspect", "evil@1", "--store", url), "a symlink")
    listing = layerfs("ls", "--store", url)
    assert SECRET.decode() not in listing.stdout + listing.stderr


def test_a_writer_follows_no_planted_symlink(tmp_path):
    """A root writer (push, gc) neither writes through a symlinked folder nor
    touches a symlinked object's target: the folder is refused in one error,
    the object is no object (a put replaces the link itself)."""
    store_dir = tmp_path / "store"
    store = FileStore(store_dir)
    store.put("refs/layers/x/1", b"sha256:" + b"0" * 64 + b"\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (store_dir / "blobs").symlink_to(outside)
    with pytest.raises(StoreError, match=r"blobs/sha256/\w+: a symlink or a path leaving"):
        store.put_blob(b"data")
    assert os.listdir(outside) == []
    target = tmp_path / "target"
    target.write_bytes(SECRET)
    os.utime(target, (1, 1))
    (store_dir / "refs" / "layers" / "x" / "2").symlink_to(target)
    assert store.head("refs/layers/x/2") is None
    assert store.refresh("refs/layers/x/2") is False and target.stat().st_mtime == 1
    assert [o.key for o in store.list("refs/")] == ["refs/layers/x/1"]
    store.put("refs/layers/x/2", b"new")
    assert not (store_dir / "refs" / "layers" / "x" / "2").is_symlink()
    assert target.read_bytes() == SECRET and store.get("refs/layers/x/2") == b"new"
