"""`layerfs commit`: a sandbox's overlay upper directory becomes a layer that,
with `env create --on`, recreates the sandbox's file system on another node.
Real daemons, kernel EROFS and overlayfs mounts, both store backends."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
from support import build, mounted_layer, need_root
from support.nodes import NodeDaemon, serving
from support.treecmp import diff_trees

from harness.daemonproc import LAYERFS
from layerfs.builder.dirsource import UpperSource
from layerfs.builder.env import create_env
from layerfs.builder.layer import BuildOptions, build_layer
from layerfs.errors import SourceError
from layerfs.manifest import ImageConfig
from layerfs.node.control import RemoteError
from layerfs.refstore import ENVS, LAYERS, RefStore
from layerfs.store import open_store

CHUNK = 65536
BIG_CHUNKS = 40


def make_base(root: Path) -> Path:
    """The lower tree the sandbox changes."""
    for sub in ("etc", "data", "keep", "emptied", "replaced/sub", "moved/inner", "attrs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "etc" / "conf").write_text("setting=1\n")
    (root / "data" / "big").write_bytes(os.urandom(BIG_CHUNKS * CHUNK))
    (root / "gone").write_text("deleted in the sandbox")
    (root / "old-name").write_text("renamed in the sandbox")
    (root / "keep" / "x").write_text("linked in the sandbox")
    for name in ("a", "b"):
        (root / "emptied" / name).write_text(name)
    (root / "replaced" / "sub" / "deep").write_text("deep")
    (root / "replaced" / "top").write_text("top")
    (root / "moved" / "inner" / "f").write_text("moved dir")
    (root / "attrs" / "perms").write_text("chmod and chown")
    (root / "attrs" / "xa").write_text("xattrs")
    os.setxattr(root / "attrs" / "xa", "user.old", b"lower value")
    return root


@pytest.fixture
def base_env(tmp_path, store, store_location):
    """Layer base@1 and env e@1 (with an image config) in a fresh store."""
    need_root()
    build(store, str(make_base(tmp_path / "base")), name="base", chunk_size=CHUNK)
    config = ImageConfig(env=["PATH=/bin", "LANG=C"], cmd=["/bin/sh"], working_dir="/data")
    create_env(RefStore(store), "e", "1", ["base@1"], config=config)
    return store_location


@pytest.fixture
def node(starts_a_server, tmp_path, base_env):
    yield from serving(NodeDaemon(tmp_path / "node", base_env.cli_args(), cache_size="64M"))


def layerfs(*args: str) -> str:
    """A store command of the CLI; its stdout."""
    proc = subprocess.run([*LAYERFS, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def up(node: NodeDaemon, env: str, sid: str) -> Path:
    return Path(node.cli("up", env, "--id", sid).stdout.strip())


def overlay_marks(top: str) -> tuple[set[tuple[str, str, bytes]], set[str]]:
    """A layer's trusted.overlay.* xattrs and its whiteouts (0:0 character devices)."""
    xattrs, whiteouts = set(), set()
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, top)
            st = os.lstat(path)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                whiteouts.add(rel)
            for key in os.listxattr(path, follow_symlinks=False):
                if key.startswith("trusted.overlay."):
                    xattrs.add((rel, key, os.getxattr(path, key, follow_symlinks=False)))
    return xattrs, whiteouts


def change_everything(r: Path) -> None:
    """Adds, changes, deletions, renames, an emptied and refilled directory, a
    replaced one, new directories, symlinks, hard links, modes, owners, xattrs."""
    (r / "etc" / "conf").write_text("setting=2\n")
    (r / "gone").unlink()
    os.rename(r / "old-name", r / "new-name")  # copy-up + whiteout
    for name in ("a", "b"):
        (r / "emptied" / name).unlink()
    (r / "emptied" / "c").write_text("refilled")  # whiteouts beside a new file
    subprocess.run(["rm", "-rf", str(r / "replaced")], check=True)
    (r / "replaced").mkdir()  # an opaque directory
    (r / "replaced" / "top").write_text("new top")
    subprocess.run(["mv", str(r / "moved"), str(r / "moved-to")], check=True)  # EXDEV: copied
    (r / "newdir" / "sub").mkdir(parents=True)
    (r / "newdir" / "sub" / "file").write_bytes(os.urandom(3 * CHUNK + 17))
    (r / "we\nird name").write_text("a newline in the name")
    os.symlink("/etc/shadow", r / "abs-link")  # stored as a link, never followed
    os.symlink("../keep/x", r / "newdir" / "rel-link")
    (r / "hl1").write_text("two names")
    os.link(r / "hl1", r / "hl2")
    os.link(r / "keep" / "x", r / "keep" / "x-link")  # a lower file hard-linked
    os.chmod(r / "attrs" / "perms", 0o640)
    os.chown(r / "attrs" / "perms", 1234, 5678)
    os.setxattr(r / "attrs" / "xa", "user.new", b"upper value")
    os.removexattr(r / "attrs" / "xa", "user.old")
    os.setxattr(r / "newdir", "user.dir", b"on a directory")
    os.mkfifo(r / "fifo")


def test_commit_recreates_the_sandbox_on_another_node(node, base_env, store, tmp_path):
    rootfs = up(node, "e@1", "s1")
    change_everything(rootfs)
    res = node.request("commit", id="s1", name="ws", version="1")
    assert res["published"] and res["vanished"] == [] and res["changed"] == []
    with mounted_layer(store, res["digest"], str(tmp_path / "layer")) as layer:
        overlay_xattrs, whiteouts = overlay_marks(layer)
    assert overlay_xattrs == {("replaced", "trusted.overlay.opaque", b"y")}
    assert whiteouts == {"gone", "old-name", "emptied/a", "emptied/b", "moved"}
    made = layerfs("env", "create", "new@1", "--layer", "ws@1", "--on", "e@1",
                   *base_env.cli_args())
    assert made.startswith("new@1 sha256:")
    refstore = RefStore(store)
    env = refstore.env(refstore.resolve(ENVS, "new@1"))
    assert [layer.ref for layer in env.layers] == ["ws@1", "base@1"]
    kept = refstore.env(refstore.resolve(ENVS, "e@1")).config
    assert env.config == kept  # the image config is kept
    other = NodeDaemon(tmp_path / "other", base_env.cli_args(), cache_size="64M").start()
    try:
        copy = up(other, "new@1", "s2")
        # the root directory of an overlay is its own upper directory's: not the layers'
        problems = [p for p in diff_trees(str(rootfs), str(copy))
                    if not p.startswith(".:")]
        assert problems == []
        assert os.readlink(copy / "abs-link") == "/etc/shadow"
        assert not (copy / "gone").exists() and not (copy / "old-name").exists()
        assert sorted(os.listdir(copy / "emptied")) == ["c"]
        assert sorted(os.listdir(copy / "replaced")) == ["top"]
        assert not (copy / "moved").exists()
        assert os.listxattr(copy / "attrs" / "xa") == ["user.new"]
        other.cli("down", "s2")
    finally:
        assert other.cleanup() == []
    node.cli("down", "s1")


def test_commit_of_one_changed_byte_uploads_one_chunk(node):
    rootfs = up(node, "e@1", "s1")
    with open(rootfs / "data" / "big", "r+b") as f:  # copy-up of the whole file
        f.seek(17 * CHUNK + 5)
        old = f.read(1)
        f.seek(17 * CHUNK + 5)  # the byte read, not the one after it
        f.write(b"\xff" if old != b"\xff" else b"\x00")
    res = node.request("commit", id="s1", name="ws", version="1")
    assert res["file_bytes"] == BIG_CHUNKS * CHUNK and res["chunk_size"] == CHUNK
    assert res["unique_chunks"] - res["reused_chunks"] == 1
    assert res["uploaded_bytes"] < 2 * CHUNK  # one chunk, the chunk table and the meta image
    node.cli("down", "s1")


def test_commit_expire_is_removed_by_gc_and_freed_a_commit_without_kept(node, base_env,
                                                                       store):
    rootfs = up(node, "e@1", "s1")
    (rootfs / "scratch").write_bytes(os.urandom(5 * CHUNK))
    out = node.cli("commit", "s1", "--name", "tmp", "--version", "1", "--expire", "1s").stdout
    assert "(expires 20" in out
    (rootfs / "scratch").write_bytes(os.urandom(5 * CHUNK))
    node.cli("commit", "s1", "--name", "ws", "--version", "1")
    bad = node.cli("commit", "s1", "--name", "x", "--version", "1", "--expire", "soon",
                   check=False)
    assert bad.returncode == 2 and "invalid duration 'soon'" in bad.stderr
    time.sleep(1.2)
    before = sum(i.size for i in store.list("blobs/"))
    text = layerfs("gc", "--grace", "0", *base_env.cli_args())
    freed = before - sum(i.size for i in store.list("blobs/"))
    assert "removed expired layer tmp@1" in text and f"({freed} bytes)" in text
    assert freed > 5 * CHUNK * 0.9  # the scratch file's chunks (random: stored as they are)
    refs = layerfs("ls", *base_env.cli_args())
    assert "tmp@1" not in refs and "ws@1" in refs and "x@1" not in refs
    node.cli("down", "s1")


@pytest.mark.daemon_log(r"commit of s1: /log changed while it was read")
def test_commit_while_a_process_appends(node, tmp_path):
    """A running sandbox: the files no one writes are exact, a file appended to
    during the commit is committed as a prefix of what it became."""
    rootfs = up(node, "e@1", "s1")
    (rootfs / "stable").write_bytes(os.urandom(20 * CHUNK))
    log = rootfs / "log"
    writer = subprocess.Popen(["python3", "-c", (
        "import os, sys\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND)\n"
        "i = 0\n"
        "while True:\n"
        "    os.write(fd, b'%08d\\n' % i * 512)\n"
        "    i += 1\n"), str(log)])
    try:
        while not log.exists() or log.stat().st_size < 4 * CHUNK:
            time.sleep(0.01)
        res = node.request("commit", id="s1", name="ws", version="1")
        assert res["published"]
    finally:
        writer.kill()
        writer.wait()
    final = log.read_bytes()
    layerfs("env", "create", "new@1", "--layer", "ws@1", "--on", "e@1", *node.store_args)
    copy = up(node, "new@1", "s2")
    committed = (copy / "log").read_bytes()
    assert len(committed) >= 4 * CHUNK and final.startswith(committed)
    assert (copy / "stable").read_bytes() == (rootfs / "stable").read_bytes()
    node.cli("down", "s2")
    node.cli("down", "s1")


def test_commit_bad_input(node):
    missing = node.cli("commit", "nope", "--name", "ws", "--version", "1", check=False)
    assert missing.returncode == 5
    assert missing.stderr.strip().splitlines() == ["layerfs: error: sandbox nope: no such sandbox"]
    rootfs = up(node, "e@1", "s1")
    with pytest.raises(RemoteError) as err:  # an erofs layer cannot claim the disk role
        node.request("commit", id="s1", name="ws", version="1", role="disk")
    assert err.value.exit_code == 2
    (rootfs / "file").write_text("first")
    first = node.cli("commit", "s1", "--name", "ws", "--version", "1", "--json")
    assert '"published": true' in first.stdout
    again = node.cli("commit", "s1", "--name", "ws", "--version", "1")
    assert "unchanged: already published" in again.stdout
    (rootfs / "file").write_text("second")
    clash = node.cli("commit", "s1", "--name", "ws", "--version", "1", check=False)
    assert clash.returncode == 4
    assert clash.stderr.strip().splitlines() == [
        "layerfs: error: ws@1 already exists with other content; versions are immutable"]
    node.cli("down", "s1")
    on_nothing = subprocess.run([*LAYERFS, "env", "create", "x@1", "--layer", "ws@1", "--on",
                                 "nope@1", *node.store_args], capture_output=True, text=True)
    assert on_nothing.returncode == 5
    assert on_nothing.stderr.strip().splitlines() == ["layerfs: error: no such env: nope@1"]


class SwappingSource(UpperSource):
    """An upper directory whose writer acts at the worst moment: just before the
    walk opens ``victim`` (already seen as a directory), it becomes a symlink to
    a directory outside; just before ``doomed`` is looked at, it is deleted."""

    def __init__(self, path: str, outside: Path) -> None:
        super().__init__(path)
        self.outside = outside

    def _opened(self, asm, dirfd, child, fmt):
        if child[-1] == b"victim":
            os.rename(b"victim", b"victim.old", src_dir_fd=dirfd, dst_dir_fd=dirfd)
            os.symlink(self.outside, b"victim", dir_fd=dirfd)
        return super()._opened(asm, dirfd, child, fmt)

    def _entry(self, asm, dirfd, child):
        if child[-1] == b"doomed":
            os.unlink(b"doomed", dir_fd=dirfd)
        return super()._entry(asm, dirfd, child)


def upper_with(tmp_path: Path, *names: str) -> Path:
    upper = tmp_path / "upper"
    (upper / "victim").mkdir(parents=True)
    (upper / "victim" / "inside").write_text("mine")
    for name in names:
        (upper / name).write_text(name)
    return upper


def test_commit_never_follows_a_directory_swapped_for_a_symlink(tmp_path):
    store = open_store("file://" + str(tmp_path / "store"))
    outside = tmp_path / "host-secrets"
    outside.mkdir()
    (outside / "shadow").write_text("host secret")
    source = SwappingSource(str(upper_with(tmp_path)), outside)
    with pytest.raises(SourceError) as err:
        build_layer(RefStore(store), "sandbox s1", BuildOptions("ws", "1"), source=source)
    assert str(err.value) == "source /victim: changed type during the commit"
    assert RefStore(store).read_ref(LAYERS, "ws", "1") is None


def test_commit_skips_what_vanishes_during_the_walk(tmp_path):
    store = open_store("file://" + str(tmp_path / "store"))
    upper = upper_with(tmp_path, "doomed", "kept")
    source = SwappingSource(str(upper), tmp_path)
    os.rename(upper / "victim", upper / "plain")  # no swap this time
    result = build_layer(RefStore(store), "sandbox s1", BuildOptions("ws", "1"), source=source)
    assert result.published and source.vanished == ["/doomed"]
    assert result.manifest.stats.files == 2  # kept, plain/inside


def test_commit_of_a_huge_sparse_file_stores_no_holes(tmp_path):
    store = open_store("file://" + str(tmp_path / "store"))
    upper = tmp_path / "upper"
    upper.mkdir()
    with open(upper / "sparse", "wb") as f:
        f.truncate(1 << 30)
        f.seek((1 << 30) - 1)
        f.write(b"x")
    result = build_layer(RefStore(store), "sandbox s1", BuildOptions("ws", "1"),
                         source=UpperSource(str(upper)))
    stats = result.manifest.stats
    assert stats.file_bytes == 1 << 30 and stats.unique_chunks == 1
    assert stats.uploaded_bytes < 1 << 20
