"""`layerfs export`: an env out as an OCI image layout or archive, checked with
umoci and skopeo (Debian) against the env's rootfs on a real node daemon, on
both store backends; the meta image reader against the writer."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from support import build, need_root
from support.baseenv import make_base, upper_tar
from support.cli import layerfs, one_line_error
from support.gentree import make_tree, trees
from support.nodes import NodeDaemon
from support.treecmp import snapshot

from harness.ociimages import (
    LayerChange,
    busybox_rootfs,
    make_image,
    manifest_of,
    to_docker_archive,
)
from harness.ociimages import blob as ociblob
from harness.registryserver import find_registry, push, start_registry
from layerfs.builder.env import create_env
from layerfs.builder.oci import tarsplit
from layerfs.builder.oci.destfiles import locked, remove_stale_temps
from layerfs.builder.oci.export import export_env, host_architecture, parse_destination
from layerfs.builder.oci.image import OCI_CONFIG as OCI_CONFIG_TYPE
from layerfs.builder.oci.image import OCI_MANIFEST as OCI_MANIFEST_TYPE
from layerfs.builder.oci.importer import ImportOptions, import_image
from layerfs.builder.oci.layertar import pax_time
from layerfs.builder.oci.sources import open_source as open_oci_source
from layerfs.errors import IntegrityError
from layerfs.formats.erofs import write_meta_image
from layerfs.formats.erofsread import read_meta_image
from layerfs.manifest import (
    MAX_TAR_SPLIT,
    BlobRef,
    ImageConfig,
    LayerManifest,
    MetaRef,
    TarSplitRef,
)
from layerfs.refstore import RefStore
from layerfs.store import open_store
from layerfs.store.base import blob_key
from layerfs.store.file import FileStore
from layerfs.tree import FileTree, FsNode

pytestmark = pytest.mark.end_to_end  # the CLI and outside tools, end to end

CHUNK = 65536
CONFIG = ImageConfig(env=["PATH=/bin", "GREETING=hello from the image"],
                     entrypoint=["/bin/sh", "-c"], cmd=["echo $GREETING"], working_dir="/etc",
                     user="0:0", labels={"org.example.layer": "export"},
                     exposed_ports=["8080/tcp"], stop_signal="SIGTERM")


def top_tar(path: Path) -> Path:
    """A layer that deletes a directory of the base, turns a symlink into a
    directory, changes a file and holds a hard link."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add(name: str, data: bytes | None = None, kind: bytes = tarfile.REGTYPE,
                link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.mtime, info.type, info.linkname = 1_700_000_000, kind, link
            info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o640
            info.size = len(data or b"") if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if data is not None else None)

        add(".wh.data")
        add("etc", kind=tarfile.DIRTYPE)
        add("etc/os-release", b"NAME=top\n")
        add("gen/links", kind=tarfile.DIRTYPE)
        add("gen/links/sym-rel", kind=tarfile.DIRTYPE)
        add("gen/links/sym-rel/inside", b"a directory where a symlink was")
        add("hl", kind=tarfile.DIRTYPE)
        add("hl/a", os.urandom(3 * CHUNK + 7))
        add("hl/b", kind=tarfile.LNKTYPE, link="hl/a")
        old = tarfile.TarInfo("hl/before-1970")
        old.size, old.pax_headers = 3, {"mtime": "-86400.25"}
        tar.addfile(old, io.BytesIO(b"old"))
    path.write_bytes(buf.getvalue())
    return path


@pytest.fixture
def env(tmp_path, store):
    """env e@1: top, up (whiteouts, opaque dir), gen (the generated tree), base
    (busybox), with an image config; e@2 has the same layers without a config."""
    need_root()
    build(store, str(make_base(tmp_path / "base")), name="base", chunk_size=CHUNK)
    gen = tmp_path / "gen-src"
    make_tree(str(gen / "gen"), seed=5, chunk_size=CHUNK, big_dir=300)
    os.chmod(gen, 0o755)
    build(store, str(gen), name="gen", chunk_size=CHUNK)
    build(store, str(upper_tar(tmp_path / "up.tar")), name="up", chunk_size=CHUNK)
    build(store, str(top_tar(tmp_path / "top.tar")), name="top", chunk_size=CHUNK)
    layers = ["top@1", "up@1", "gen@1", "base@1"]
    refstore = RefStore(store)
    create_env(refstore, "e", "1", layers, config=CONFIG)
    create_env(refstore, "e", "2", layers)
    return store


def umoci_unpack(image: str, bundle: Path) -> Path:
    proc = subprocess.run(["umoci", "unpack", "--image", image, str(bundle)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return bundle / "rootfs"


def skopeo(*args: str) -> str:
    proc = subprocess.run(["skopeo", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def rootfs_differences(env_root: Path, image_root: Path) -> list[str]:
    """Entry by entry, but for what an image cannot hold or a sandbox shows its
    own way: the root directory (a sandbox's is its upper directory) and
    sockets (a tar cannot hold one)."""
    problems = []
    ours = {p: f for p, f in snapshot(str(env_root)).items()
            if p != "." and f[0] != stat.S_IFSOCK}
    theirs = {p: f for p, f in snapshot(str(image_root)).items() if p != "."}
    for path in sorted(set(ours) | set(theirs)):
        if ours.get(path) != theirs.get(path):
            problems.append(f"{path}: env {ours.get(path)} != image {theirs.get(path)}")
    return problems


def test_export_unpacks_to_the_env_rootfs(env, tmp_path, store_args):
    layout = tmp_path / "layout"
    out = json.loads(layerfs("export", "e@1", f"oci:{layout}:v1", "--json", *store_args).stdout)
    assert len(out["layers"]) == 4
    bottom, top = out["layers"][0], out["layers"][-1]
    assert (bottom["source"], top["source"]) == ("base@1", "top@1")  # bottom first
    up_layer = out["layers"][2]
    assert up_layer["whiteouts"] == 1 and up_layer["opaque_dirs"] == 1
    assert top["whiteouts"] == 1 and top["hard_links"] == 1
    assert out["layers"][1]["hard_links"] == 3 and out["layers"][1]["skipped_sockets"] == 1

    inspect = json.loads(skopeo("inspect", f"oci:{layout}:v1"))
    assert inspect["Env"] == CONFIG.env and inspect["Os"] == "linux"
    assert inspect["Labels"] == CONFIG.labels and len(inspect["Layers"]) == 4
    assert inspect["Architecture"] == host_architecture()
    config = json.loads((layout / "blobs" / "sha256" /
                         out["config"].removeprefix("sha256:")).read_text())
    assert config["config"]["ExposedPorts"] == {"8080/tcp": {}}
    assert config["config"]["StopSignal"] == "SIGTERM"
    assert config["rootfs"]["diff_ids"] == [x["diff_id"] for x in out["layers"]]

    # the same env again, and folded, into the same layout: tags added, nothing rewritten
    again = json.loads(layerfs("export", "e@1", f"oci:{layout}:v1", "--json",
                               *store_args).stdout)
    assert again["manifest"] == out["manifest"]
    folded = json.loads(layerfs("export", "e@1", f"oci:{layout}:folded", "--fold", "--json",
                                *store_args).stdout)
    assert len(folded["layers"]) == 1 and folded["layers"][0]["whiteouts"] == 0
    index = json.loads((layout / "index.json").read_text())
    tags = {m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]}
    assert tags == {"v1", "folded"}

    bundle = tmp_path / "bundle"
    image_root = umoci_unpack(f"{layout}:v1", bundle)
    process = json.loads((bundle / "config.json").read_text())["process"]
    assert process["args"] == ["/bin/sh", "-c", "echo $GREETING"]
    assert "GREETING=hello from the image" in process["env"] and process["cwd"] == "/etc"
    folded_root = umoci_unpack(f"{layout}:folded", tmp_path / "bundle-folded")

    daemon = NodeDaemon(tmp_path / "node", store_args).start()
    try:
        rootfs = Path(daemon.cli("up", "e@1", "--id", "x1").stdout.strip())
        assert not (rootfs / "data").exists() and (rootfs / "hl" / "b").exists()
        assert rootfs_differences(rootfs, image_root) == []
        assert rootfs_differences(rootfs, folded_root) == []
        daemon.cli("down", "x1")
    finally:
        assert daemon.cleanup() == []


def test_archive_is_accepted_by_skopeo(env, tmp_path, store_args):
    archive = tmp_path / "e.tar"
    out = json.loads(layerfs("export", "e@1", f"oci-archive:{archive}:v1", "--json",
                             *store_args).stdout)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    copy = tmp_path / "copy"
    skopeo("copy", f"oci-archive:{archive}:v1", f"oci:{copy}:t")
    inspect = json.loads(skopeo("inspect", f"oci:{copy}:t"))
    assert inspect["Layers"] == [x["digest"] for x in out["layers"]]
    assert inspect["Env"] == CONFIG.env
    zstd = json.loads(layerfs("export", "e@1", f"oci:{tmp_path / 'z'}", "--compression",
                              "zstd", "--json", *store_args).stdout)
    assert [x["diff_id"] for x in zstd["layers"]] == [x["diff_id"] for x in out["layers"]]
    manifest = json.loads((tmp_path / "z" / "blobs" / "sha256" /
                           zstd["manifest"].removeprefix("sha256:")).read_text())
    assert {x["mediaType"] for x in manifest["layers"]} == {
        "application/vnd.oci.image.layer.v1.tar+zstd"}
    assert json.loads(skopeo("inspect", f"oci:{tmp_path / 'z'}:latest"))["Env"] == CONFIG.env


def run_as(uid: int, gid: int, argv: list[str]) -> int:
    """Run the CLI in a forked child that dropped to ``uid``/``gid`` (this
    interpreter lives where only root may exec it, so no new process is run)."""
    import layerfs.store.s3  # noqa: F401  (imported while still root)
    from layerfs.cli.main import main

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def readable_store(store_args: list[str], work: Path, user) -> list[str]:
    """Store arguments a user can read (a file store is copied into ``work``,
    readable by all) and ``work/out``, a directory the user owns."""
    os.chmod(work, 0o755)
    args = list(store_args)
    if args[1].startswith("file://"):
        shutil.copytree(args[1].removeprefix("file://"), work / "store")
        subprocess.run(["chmod", "-R", "a+rX", str(work / "store")], check=True)
        args[1] = f"file://{work / 'store'}"
    (work / "out").mkdir()
    os.chown(work / "out", user.uid, user.gid)
    return args


def test_export_runs_unprivileged(env, tmp_path, store_args, local_user):
    """No mounts, no root: a user who can read the store exports the env."""
    work = Path(tempfile.mkdtemp(prefix="layerfs-export-"))
    try:
        args = readable_store(store_args, work, local_user)
        image = work / "out" / "img"
        assert run_as(local_user.uid, local_user.gid,
                      ["export", "e@1", f"oci:{image}:v1", *args]) == 0
        assert (image / "index.json").stat().st_uid == local_user.uid
        assert json.loads(skopeo("inspect", f"oci:{image}:v1"))["Env"] == CONFIG.env
    finally:
        shutil.rmtree(work)


def test_bad_input_is_one_line_and_writes_nothing(env, tmp_path, store_args):
    dest = tmp_path / "out"
    dest.mkdir()
    one_line_error(layerfs("export", "nope@1", f"oci:{dest / 'a'}", *store_args, check=False), 5)
    one_line_error(layerfs("export", "e@1", f"docker://{dest}", *store_args, check=False), 2)
    one_line_error(layerfs("export", "e@1", f"oci:{dest / 'a'}:bad!tag", *store_args,
                           check=False), 2)
    one_line_error(layerfs("export", "e@1", f"oci:{dest / 'no' / 'a'}", *store_args,
                           check=False), 2)
    (dest / "file.tar").write_bytes(b"mine")
    one_line_error(layerfs("export", "e@1", f"oci-archive:{dest / 'file.tar'}", *store_args,
                           check=False), 4)
    assert (dest / "file.tar").read_bytes() == b"mine"
    (dest / "notalayout").mkdir()
    (dest / "notalayout" / "keep").write_text("mine")
    one_line_error(layerfs("export", "e@1", f"oci:{dest / 'notalayout'}", *store_args,
                           check=False), 4)
    assert os.listdir(dest / "notalayout") == ["keep"]
    # a tag that names another image (e@2 has no image config) is not moved
    layerfs("export", "e@1", f"oci:{dest / 'img'}:t", *store_args)
    before = snapshot(str(dest / "img"), dir_mtime=False)
    one_line_error(layerfs("export", "e@2", f"oci:{dest / 'img'}:t", *store_args,
                           check=False), 4)
    assert snapshot(str(dest / "img"), dir_mtime=False) == before

    # a damaged chunk: integrity error, nothing at DEST, no temporaries beside it
    refstore = RefStore(env)
    manifest = refstore.layer(refstore.resolve("layers", "gen@1"))
    victim = max(refstore.chunk_table(manifest).entries, key=lambda e: e.length)
    data = bytearray(env.get(blob_key(victim.pack)))
    data[victim.pack_offset + 10] ^= 0x55
    env.put(blob_key(victim.pack), bytes(data))
    listing = sorted(os.listdir(dest))
    for target in (f"oci:{dest / 'fresh'}", f"oci-archive:{dest / 'fresh.tar'}"):
        line = one_line_error(layerfs("export", "e@1", target, *store_args, check=False), 6)
        assert victim.sha256.hex()[:16] in line
        assert sorted(os.listdir(dest)) == listing
    one_line_error(layerfs("export", "e@1", f"oci:{dest / 'img'}:other", *store_args,
                           check=False), 6)
    assert snapshot(str(dest / "img"), dir_mtime=False) == before  # no new blobs, same index


# -- the meta image reader --

@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(tree=trees())
def test_meta_image_reads_back_as_written(tree: FileTree):
    image = write_meta_image(tree, 0, 16)
    again = read_meta_image(image)
    assert write_meta_image(again.tree, again.blob_blocks, 16) == image


def test_times_before_1970_read_back():
    tree = FileTree(FsNode.directory(0o755, mtime=-1, mtime_ns=1))
    tree.put([b"old"], FsNode(mode=stat.S_IFREG | 0o644, inline=b"x", size=1,
                              mtime=-(2**40), mtime_ns=999_999_999))
    meta = read_meta_image(write_meta_image(tree, 0, 16))
    old = meta.tree.lookup([b"old"])
    assert old is not None and (old.mtime, old.mtime_ns) == (-(2**40), 999_999_999)
    assert (meta.tree.root.mtime, meta.tree.root.mtime_ns) == (-1, 1)
    assert pax_time(-1, 250_000_000) == "-0.750000000"
    assert pax_time(-(2**40), 999_999_999) == f"-{2**40 - 1}.000000001"
    assert pax_time(5, 7) == "5.000000007"


def test_layer_meta_image_reads_back(tmp_path, store):
    """A built layer (chunked files, holes, hard links, shared xattrs, devices)."""
    need_root()
    src = make_tree(str(tmp_path / "src"), seed=3, chunk_size=CHUNK, big_dir=300)
    refstore = RefStore(store)
    manifest = refstore.layer(build(store, src, chunk_size=CHUNK).digest)
    image = refstore.meta_image(manifest)
    meta = read_meta_image(image)
    assert meta.chunk_size == CHUNK
    assert write_meta_image(meta.tree, meta.blob_blocks, CHUNK.bit_length() - 1) == image
    links = meta.tree.lookup([b"links", b"a"])
    assert links is meta.tree.lookup([b"links", b"b"]) and links is not None
    assert links.links == 3
    dev = meta.tree.lookup([b"dev", b"bigminor"])
    assert dev is not None and (dev.rdev_major, dev.rdev_minor) == (200, 300000)


def test_export_tar_entries(env, tmp_path, store_args):
    """What the top layer's tar holds, as tar sees it: whiteout, hard link, modes."""
    layout = tmp_path / "layout"
    out = json.loads(layerfs("export", "e@1", f"oci:{layout}", "--json", *store_args).stdout)
    blob = layout / "blobs" / "sha256" / out["layers"][-1]["digest"].removeprefix("sha256:")
    with tarfile.open(blob, "r:gz") as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members[".wh.data"].isreg() and members[".wh.data"].size == 0
    assert members["hl/b"].islnk() and members["hl/b"].linkname == "hl/a"
    assert members["etc/os-release"].mode == 0o640
    assert members["hl"].pax_headers["mtime"] == "1700000000.000000000"
    assert members["hl/before-1970"].pax_headers["mtime"] == "-86400.250000000"
    with tarfile.open(layout / "blobs" / "sha256" /
                      out["layers"][1]["digest"].removeprefix("sha256:"), "r:gz") as tar:
        gen = {m.name: m for m in tar.getmembers()}
    assert gen["gen/files/suid"].mode == 0o4755
    assert gen["gen/x/.wh..wh..opq"].isreg()  # the opaque marker, not an xattr
    assert "SCHILY.xattr.trusted.overlay.opaque" not in gen["gen/x"].pax_headers
    assert "SCHILY.xattr.security.capability" in gen["gen/x/x0"].pax_headers
    assert gen["gen/dev/sda"].isblk() and (gen["gen/dev/sda"].devmajor,
                                          gen["gen/dev/sda"].devminor) == (8, 0)
    assert ".wh.whiteout" in {name.rpartition("/")[2] for name in gen}
    assert not any(name.endswith("/sock") for name in gen)


# -- a hostile destination: nothing written where its symlinks point --

@pytest.fixture
def small_env(tmp_path) -> list[str]:
    """env s@1 (one small layer) in a file store: the CLI arguments naming the store."""
    src = tmp_path / "small-src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "os-release").write_text("NAME=small\n")
    (src / "data").write_bytes(os.urandom(3 * CHUNK))
    store = FileStore(str(tmp_path / "store"))
    build(store, str(src), name="small", chunk_size=CHUNK)
    create_env(RefStore(store), "s", "1", ["small@1"], config=CONFIG)
    return ["--store", f"file://{tmp_path / 'store'}"]


def plant(user, link: Path, target: Path) -> None:
    """``link`` -> ``target``, made by the unprivileged user who owns the layout."""
    proc = user.run("ln", "-s", str(target), str(link))
    assert proc.returncode == 0, proc.stderr


HOSTILE_LINKS = {  # what the attacker links, and where to
    "blobs/sha256": ("blobs/sha256", "dir"),
    "blobs": ("blobs", "dir"),
    "index.json": ("index.json", "index"),
    "oci-layout": ("oci-layout", "file"),
}


@pytest.fixture
def shared_dir(local_user) -> Iterator[Path]:
    """A directory the unprivileged user owns, where root can be made to export."""
    work = Path(tempfile.mkdtemp(prefix="layerfs-export-"))
    try:
        os.chmod(work, 0o755)
        os.chown(work, local_user.uid, local_user.gid)
        yield work
    finally:
        shutil.rmtree(work)


@pytest.mark.parametrize("case", list(HOSTILE_LINKS))
def test_symlink_in_an_existing_layout_is_refused_and_not_followed(case, small_env, tmp_path,
                                                                   local_user, shared_dir):
    """A layout an unprivileged user owns, with a symlink where export writes
    (a directory the blobs go to, the index replaced, the layout marker): root's
    export is one error line, and nothing appears where the symlink points."""
    layout = shared_dir / "img"
    (layout / "blobs" / "sha256").mkdir(parents=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    name, kind = HOSTILE_LINKS[case]
    if (layout / name).is_dir():
        shutil.rmtree(layout / name)
    elif (layout / name).exists():
        (layout / name).unlink()
    subprocess.run(["chown", "-R", f"{local_user.uid}:{local_user.gid}", str(layout)],
                   check=True)
    target = tmp_path / "elsewhere" / "target"
    target.parent.mkdir()
    if kind == "dir":
        target.mkdir()
    else:  # a file the export would read or keep: a valid empty index, a layout marker
        target.write_text('{"manifests": []}' if kind == "index" else
                          '{"imageLayoutVersion": "1.0.0"}')
    plant(local_user, layout / name, target)
    before = snapshot(str(target.parent), dir_mtime=False)
    line = one_line_error(layerfs("export", "s@1", f"oci:{layout}:v1", *small_env,
                                  check=False), 4)
    assert "symlink" in line
    assert snapshot(str(target.parent), dir_mtime=False) == before
    assert os.readlink(layout / name) == str(target)  # not replaced either
    assert temporaries(shared_dir) == []


def test_destination_that_is_a_symlink_is_refused(small_env, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for target in (f"oci:{tmp_path / 'link'}", f"oci-archive:{tmp_path / 'link'}"):
        line = one_line_error(layerfs("export", "s@1", target, *small_env, check=False), 4)
        assert "symlink" in line
    assert os.listdir(tmp_path / "real") == []


# -- temporaries of a killed export --

def export_stopped_while(store_args: list[str], target: str,
                         writing: Callable[[], bool]) -> subprocess.Popen:
    """``layerfs export`` run a few milliseconds at a time (SIGCONT, SIGSTOP)
    until ``writing()`` holds, then left stopped there: in the middle of its
    work, as a kill would find it (the store's objects are regular files
    that cannot be made to stall it: FIFOs are refused)."""
    proc = subprocess.Popen([sys.executable, "-m", "layerfs.cli.main", "export", "s@1",
                             target, *store_args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while not writing():
        assert proc.poll() is None, "the export ended before it was caught writing"
        assert time.monotonic() < deadline, "timed out"
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.002)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.001)
    return proc


def temporaries(where: Path) -> list[Path]:
    return sorted(p for p in where.rglob("*") if ".tmp-" in p.name)


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("kind", ["new layout", "archive", "existing layout"])
def test_next_export_removes_what_a_killed_one_left(kind, small_env, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dest = out / ("img.tar" if kind == "archive" else "img")
    target = f"{'oci-archive' if kind == 'archive' else 'oci'}:{dest}"
    if kind == "existing layout":
        layerfs("export", "s@1", f"oci:{dest}:first", *small_env)
    proc = export_stopped_while(
        small_env, target, lambda: any(p.parent.name == "sha256" for p in temporaries(out)))
    proc.kill()
    proc.wait()
    left = temporaries(out)
    assert left and all(str(proc.pid) in p.name for p in left if p.parent == out)
    layerfs("export", "s@1", f"{target}:second", *small_env)
    assert temporaries(out) == []
    assert json.loads(skopeo("inspect", f"{target}:second"))["Env"] == CONFIG.env


def test_only_temporaries_of_dead_unlocking_exporters_are_removed(tmp_path, local_user):
    """Removed: this user's, unlocked, pid gone. Kept: locked (a live exporter,
    whatever its pid says), pid alive (an exporter between creating and locking,
    or a reused pid), another user's, a symlink, another destination's."""
    child = subprocess.Popen(["true"])  # a pid that has just exited
    child.wait()
    dead, alive = child.pid, os.getpid()
    names = {"dead": f".img.tmp-{dead}-ab12", "dead-dir": f".img.tmp-{dead}-cd34",
             "locked": f".img.tmp-{dead}-ef56", "alive": f".img.tmp-{alive}-0a0b",
             "other-user": f".img.tmp-{dead}-1c1d", "symlink": f".img.tmp-{dead}-2e2f",
             "other-dest": f".img2.tmp-{dead}-3a3b"}
    for key, name in names.items():
        if key == "dead-dir":
            (tmp_path / name / "blobs").mkdir(parents=True)
        elif key == "symlink":
            (tmp_path / name).symlink_to(tmp_path / names["dead"])
        else:
            (tmp_path / name).write_bytes(b"partial blob")
    os.chown(tmp_path / names["other-user"], local_user.uid, local_user.gid)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    holder = os.open(tmp_path / names["locked"], os.O_RDONLY)
    try:
        locked(holder)
        removed = remove_stale_temps(dir_fd, ".img")
    finally:
        os.close(holder)
        os.close(dir_fd)
    assert sorted(removed) == sorted([names["dead"], names["dead-dir"]])
    assert sorted(os.listdir(tmp_path)) == sorted(
        names[k] for k in ("locked", "alive", "other-user", "symlink", "other-dest"))


# -- tar-split: an imported image's layers go out as they came in --

LONG = "long-name-" * 12  # 120 bytes: a ustar header cannot hold it


def gzip_as_exported(data: bytes) -> bytes:
    """gzip as the export writes it (no name, mtime 0, level 6)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=6) as f:
        f.write(data)
    return buf.getvalue()


def python_tar(fmt: int) -> bytes:
    """A layer tar by Python's tarfile: long names and link targets (GNU long
    name headers or pax), a global pax header, a duplicate path (chunked and
    inline), a hard link, a whiteout, an opaque marker, an xattr, a uid beyond
    octal, an empty file last, and zero blocks after the end of the archive."""
    buf = io.BytesIO()
    pax = {"comment": "global"} if fmt == tarfile.PAX_FORMAT else None
    with tarfile.open(fileobj=buf, mode="w", format=fmt, pax_headers=pax) as tar:
        def add(name: str, data: bytes | None = None, kind: bytes = tarfile.REGTYPE,
                link: str = "", **extra: object) -> None:
            info = tarfile.TarInfo(name)
            info.mtime, info.type, info.linkname = 1_700_000_000, kind, link
            info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
            info.size = len(data) if data is not None else 0
            for key, value in extra.items():
                setattr(info, key, value)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)

        add("d", kind=tarfile.DIRTYPE)
        add(f"d/{LONG}", b"under a long name", uid=3_000_000)
        add("d/link", kind=tarfile.SYMTYPE, link=f"{LONG}/{LONG}")
        add("d/big", os.urandom(3 * CHUNK + 5))
        add("d/dup", os.urandom(10_000))
        add("d/small", b"first")
        add("d/hl", kind=tarfile.LNKTYPE, link="d/big")
        add("d/dup", b"replaced")
        add("d/small", b"second")
        add(".wh.gone")
        add("o", kind=tarfile.DIRTYPE)
        add("o/.wh..wh..opq")
        if fmt == tarfile.PAX_FORMAT:
            add("d/tagged", b"x", pax_headers={"SCHILY.xattr.user.note": "kept"})
        add("zz-empty", b"")
    return buf.getvalue() + bytes(3 * tarfile.BLOCKSIZE)


def python_image(layout: Path, tars: list[bytes]) -> Path:
    """An OCI layout, tag ``t``, of these layer tars gzip'd as the export does."""
    (layout / "blobs" / "sha256").mkdir(parents=True)

    def put(data: bytes) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        ociblob(layout, digest).write_bytes(data)
        return {"digest": digest, "size": len(data)}

    config = put(json.dumps({"architecture": host_architecture(), "os": "linux", "config": {},
                             "rootfs": {"type": "layers", "diff_ids": [
                                 "sha256:" + hashlib.sha256(t).hexdigest() for t in tars]}
                             }).encode())
    layers = [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
               **put(gzip_as_exported(t))} for t in tars]
    manifest = put(json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST_TYPE, "layers": layers,
                               "config": {"mediaType": OCI_CONFIG_TYPE, **config}}).encode())
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": OCI_MANIFEST_TYPE, **manifest,
         "annotations": {"org.opencontainers.image.ref.name": "t"}}]}))
    return layout


@pytest.fixture(scope="module")
def source_images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Path]]:
    """Import source → (what ``layerfs import`` takes, the OCI layout of the same image)."""
    root = tmp_path_factory.mktemp("tarsplit")
    umoci_layout = root / "U"
    make_image(umoci_layout, "t", [
        LayerChange(copy_tree=str(busybox_rootfs(root / "rootfs"))),
        LayerChange(files={f"srv/{LONG}/file": b"pax path", "srv/tagged": os.urandom(5000),
                           "srv/gone": b"to be deleted"},
                    xattrs={"srv/tagged": {"user.note": b"kept"}},
                    hardlinks={"srv/again": "srv/tagged"}),
        LayerChange(delete=["srv/gone", "bin/cat"], files={"zzz-empty": b""},
                    hardlinks={"srv/third": "srv/tagged"}),
    ])
    zstd_layout = root / "Z"
    skopeo("--insecure-policy", "copy", "--dest-compress-format", "zstd",
           f"oci:{umoci_layout}:t", f"oci:{zstd_layout}:t")
    assert {x["mediaType"] for x in manifest_of(zstd_layout, "t")[1]["layers"]} == {
        "application/vnd.oci.image.layer.v1.tar+zstd"}
    archive = to_docker_archive(umoci_layout, "t", root / "d.tar")
    gnu = python_image(root / "G", [python_tar(tarfile.GNU_FORMAT)])
    pax = python_image(root / "P", [python_tar(tarfile.PAX_FORMAT),
                                    python_tar(tarfile.GNU_FORMAT)])
    return {"umoci": (f"oci:{umoci_layout}:t", umoci_layout),
            "skopeo-zstd": (f"oci:{zstd_layout}:t", zstd_layout),
            "skopeo-docker-archive": (f"docker-archive:{archive}", umoci_layout),
            "python-gnu": (f"oci:{gnu}:t", gnu), "python-pax": (f"oci:{pax}:t", pax)}


def layer_tars(layout: Path, tag: str) -> tuple[list[str], list[bytes]]:
    """A tag's config diff_ids and its layers' uncompressed tars, bottom first."""
    _, manifest = manifest_of(layout, tag)
    config = json.loads(ociblob(layout, manifest["config"]["digest"]).read_bytes())
    tars = []
    for layer in manifest["layers"]:
        data = ociblob(layout, layer["digest"]).read_bytes()
        tars.append(zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read()
                    if layer["mediaType"].endswith("+zstd") else gzip.decompress(data))
    return config["rootfs"]["diff_ids"], tars


@pytest.mark.parametrize("kind", ["umoci", "skopeo-zstd", "skopeo-docker-archive", "python-gnu",
                                  "python-pax"])
def test_unchanged_image_layers_export_as_they_came(kind, source_images, tmp_path, store_args):
    """Every layer's tar comes out byte for byte: the same diff_ids, in the
    config too; gc keeps the records."""
    src, layout = source_images[kind]
    layerfs("import", src, "--name", "img", "--version", "1", *store_args)
    layerfs("gc", "--grace", "0", *store_args)
    out = json.loads(layerfs("export", "img@1", f"oci:{tmp_path / 'out'}:t", "--json",
                             *store_args).stdout)
    diff_ids, tars = layer_tars(layout, "t")
    got_ids, got = layer_tars(tmp_path / "out", "t")
    assert got_ids == diff_ids == [x["diff_id"] for x in out["layers"]]
    assert [hashlib.sha256(t).hexdigest() for t in got] == [
        d.removeprefix("sha256:") for d in diff_ids]
    assert got == tars
    if kind.startswith("python"):  # what the record counted, as the rebuilt tar would
        assert (out["layers"][0]["hard_links"], out["layers"][0]["whiteouts"],
                out["layers"][0]["opaque_dirs"]) == (1, 1, 1)


def test_changed_layers_are_rebuilt_as_before(source_images, tmp_path, store, store_args):
    """A folded import, an export --fold and a layer built here have no record:
    their tars are rebuilt from the tree; the image layers below keep theirs."""
    src, layout = source_images["umoci"]
    diff_ids, _ = layer_tars(layout, "t")
    layerfs("import", src, "--name", "img", "--version", "1", *store_args)
    layerfs("import", src, "--name", "folded", "--version", "1", "--fold", "1G", *store_args)
    build(store, str(top_tar(tmp_path / "top.tar")), name="mine", chunk_size=CHUNK)
    refstore = RefStore(store)
    imported = [layer.ref for layer in refstore.env(refstore.resolve("envs", "img@1")).layers]
    create_env(refstore, "mix", "1", ["mine@1", *imported])
    for env_name, extra, kept in (("folded@1", [], 0), ("img@1", ["--fold"], 0),
                                  ("mix@1", [], 3)):
        dest = tmp_path / env_name
        out = json.loads(layerfs("export", env_name, f"oci:{dest}:t", "--json", *extra,
                                 *store_args).stdout)
        got_ids, tars = layer_tars(dest, "t")
        assert got_ids[:kept] == diff_ids[:kept]
        for tar_bytes in tars[kept:]:  # rebuilt: layerfs's PAX tar, the root first
            assert "sha256:" + hashlib.sha256(tar_bytes).hexdigest() not in diff_ids
            with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
                assert tar.next().name == "."  # type: ignore[union-attr]
        assert len(out["layers"]) == len(got_ids)


def layer_with_record(store, env_name: str = "img@1"):
    """The bottom layer of the env: its ref, its manifest (which has a record)."""
    refstore = RefStore(store)
    layer = refstore.env(refstore.resolve("envs", env_name)).layers[-1]
    manifest = refstore.layer(layer.digest)
    assert manifest.tar_split is not None
    return refstore, layer, manifest


def test_damaged_record_fails_the_export_and_writes_nothing(source_images, tmp_path, store,
                                                            store_args):
    src, _ = source_images["python-pax"]
    layerfs("import", src, "--name", "img", "--version", "1", *store_args)
    refstore, layer, manifest = layer_with_record(store)
    key = blob_key(manifest.tar_split.digest)
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x01
    store.put(key, bytes(data))
    dest = tmp_path / "out"
    dest.mkdir()
    for target in (f"oci:{dest / 'a'}", f"oci-archive:{dest / 'a.tar'}"):
        line = one_line_error(layerfs("export", "img@1", target, *store_args, check=False), 6)
        assert f"tar-split record of {layer.ref}: content does not match its digest" in line
    assert os.listdir(dest) == []
    verify = layerfs("verify", layer.ref, *store_args, check=False)
    assert verify.returncode == 6 and "tar-split record" in verify.stdout + verify.stderr


def test_unprivileged_export_writes_the_recorded_tars(source_images, store_args, local_user):
    """A user who can only read the store gets the image's own tars too, and
    a damaged record stops that user's export as it stops root's."""
    src, layout = source_images["python-pax"]
    layerfs("import", src, "--name", "img", "--version", "1", *store_args)
    work = Path(tempfile.mkdtemp(prefix="layerfs-export-"))
    try:
        args = readable_store(store_args, work, local_user)
        image = work / "out" / "img"
        assert run_as(local_user.uid, local_user.gid,
                      ["export", "img@1", f"oci:{image}:t", *args]) == 0
        assert layer_tars(image, "t") == layer_tars(layout, "t")
        store = open_store(args[1], args[3] if len(args) > 3 else None)
        refstore, _, manifest = layer_with_record(store)
        assert manifest.tar_split is not None
        key = blob_key(manifest.tar_split.digest)
        store.put(key, store.get(key)[:-1])
        assert run_as(local_user.uid, local_user.gid,
                      ["export", "img@1", f"oci:{work / 'out' / 'bad'}", *args]) == 6
        assert not (work / "out" / "bad").exists()
    finally:
        shutil.rmtree(work)


def forged_record(blob: bytes) -> bytes:
    """The record with one byte of its raw stream (the first header's name) changed."""
    (index_len,) = struct.unpack("<Q", blob[8:16])
    raw = bytearray(zstandard.ZstdDecompressor().stream_reader(
        io.BytesIO(blob[16 + index_len:])).read())
    raw[0] ^= 0x01
    return blob[: 16 + index_len] + zstandard.ZstdCompressor().compress(bytes(raw))


def test_record_that_writes_another_tar_fails_the_export(source_images, tmp_path, store,
                                                         store_args):
    """A record whose digest checks but whose tar is not the diff_id's (a
    manifest naming a forged record) fails that layer, naming it."""
    src, _ = source_images["python-pax"]
    layerfs("import", src, "--name", "img", "--version", "1", *store_args)
    refstore, _, manifest = layer_with_record(store)
    assert manifest.tar_split is not None
    forged = forged_record(store.get_blob(manifest.tar_split.digest))
    digest, _ = store.put_blob(forged)
    copy = dataclasses.replace(manifest, name="forged", tar_split=dataclasses.replace(
        manifest.tar_split, digest=digest, size=len(forged)))
    layer_digest, _ = store.put_blob(copy.to_bytes())
    refstore.publish("layers", "forged", "1", layer_digest)
    create_env(refstore, "forged", "1", ["forged@1"])
    dest = tmp_path / "out"
    line = one_line_error(layerfs("export", "forged@1", f"oci:{dest}", *store_args,
                                  check=False), 6)
    assert "tar-split record of forged@1: the tar written has sha256:" in line
    assert f"not its diff_id {manifest.tar_split.diff_id}" in line
    assert not dest.exists()


def test_push_back_to_the_registry_uploads_no_layer(tmp_path, store_args):
    """An image whose layers are gzip'd as the export does (no name, mtime 0,
    level 6), pushed, imported from the registry, exported and pushed back:
    the registry stores no layer again, only the new config and manifest."""
    binary = find_registry()
    if binary is None:
        pytest.fail("docker-registry is not installed (make deps installs it)")
    layout = python_image(tmp_path / "src", [python_tar(tarfile.PAX_FORMAT),
                                             python_tar(tarfile.GNU_FORMAT)])
    server = start_registry(binary, tmp_path / "registry")
    blobs = tmp_path / "registry" / "storage" / "docker" / "registry" / "v2" / "blobs"
    try:
        ref = push(layout, "t", server, "test/img")
        before = {p.name for p in blobs.glob("sha256/*/*")}
        layerfs("import", ref, "--name", "img", "--version", "1", "--plain-http", *store_args)
        out = json.loads(layerfs("export", "img@1", f"oci:{tmp_path / 'out'}:back", "--json",
                                 *store_args).stdout)
        push(tmp_path / "out", "back", server, "test/img")
        after = {p.name for p in blobs.glob("sha256/*/*")}
    finally:
        server.stop()
    _, source = manifest_of(layout, "t")
    assert [x["digest"] for x in out["layers"]] == [x["digest"] for x in source["layers"]]
    new = {"sha256:" + name for name in after - before}
    assert new == {out["manifest"], out["config"]}


# -- the record read back is hostile input --

def craft(contents: list[bytes], raw: bytes, raw_size: int | None = None,
          tar_size: int | None = None, count: int | None = None) -> bytes:
    """A record blob: these serialized contents over this raw stream."""
    raw_size = len(raw) if raw_size is None else raw_size
    tar_size = raw_size + 10 * len(contents) if tar_size is None else tar_size
    index = tarsplit.HEADER.pack(raw_size, tar_size, len(contents) if count is None else count,
                                 0, 0, 0, 0) + b"".join(contents)
    packed = zstandard.ZstdCompressor().compress(index)
    return (tarsplit.MAGIC + struct.pack("<Q", len(packed)) + packed
            + zstandard.ZstdCompressor().compress(raw))


def file_entry(path: bytes, size: int = 10, offset: int = 0) -> bytes:
    return tarsplit.CONTENT.pack(tarsplit.FILE, offset, size) + struct.pack("<I", len(path)) + path


def chunks_entry(chunks: list[int], size: int = 10) -> bytes:
    return (tarsplit.CONTENT.pack(tarsplit.CHUNKS, 0, size) + struct.pack("<I", len(chunks))
            + struct.pack(f"<{len(chunks)}q", *chunks))


HOSTILE = {
    "not a record": (b"NOTASPLT" + bytes(64), "not a tar-split record"),
    "index past the end": (tarsplit.MAGIC + struct.pack("<Q", 1 << 40), "past the record's end"),
    "too many contents": (craft([], b"raw", count=1 << 40), "contents in a smaller index"),
    "missing file": (craft([file_entry(b"nope")], b"raw"), "/nope is not a regular file"),
    "wrong size": (craft([file_entry(b"f", 11)], b"raw", tar_size=14), "of 11 bytes"),
    "a directory": (craft([file_entry(b"d")], b"raw"), "/d is not a regular file"),
    "empty path": (craft([file_entry(b"")], b"raw"), "a path of 0 bytes"),
    "chunk count": (craft([chunks_entry([0, 0])], b"raw"), "2 chunks for 10 bytes"),
    "negative chunk": (craft([chunks_entry([-7])], b"raw"), "a negative chunk address"),
    "inline too big": (craft([tarsplit.CONTENT.pack(tarsplit.INLINE, 0, 1 << 20)], b"raw",
                             tar_size=3 + (1 << 20)), "bytes inline"),
    "unknown kind": (craft([tarsplit.CONTENT.pack(9, 0, 10)], b"raw"), "unknown kind 9"),
    "out of order": (craft([file_entry(b"f", offset=2), file_entry(b"f", offset=1)], b"raw"),
                     "out of order"),
    "past the raw": (craft([file_entry(b"f", offset=4)], b"raw"), "raw offset 4 out of order"),
    "sizes": (craft([file_entry(b"f")], b"raw", tar_size=99), "do not add up"),
    "index ends early": (craft([file_entry(b"f")[:-1]], b"raw"), "index ends early"),
    "raw too big": (craft([], b"", raw_size=1 << 40, tar_size=1 << 40), "sizes out of range"),
}


def hostile_tree() -> FileTree:
    tree = FileTree(FsNode.directory())
    tree.put([b"f"], FsNode(mode=stat.S_IFREG | 0o644, size=10, inline=b"0123456789"))
    tree.put([b"d"], FsNode.directory())
    return tree


@pytest.mark.parametrize("case", list(HOSTILE))
def test_malformed_record_is_refused(case, store):
    blob, message = HOSTILE[case]
    digest, _ = store.put_blob(blob)
    tar_size = struct.unpack("<QQ", zstandard.ZstdDecompressor().stream_reader(io.BytesIO(
        blob[16:])).read(16))[1] if blob.startswith(tarsplit.MAGIC) and len(blob) > 40 else 0
    ref = TarSplitRef(digest, len(blob), "sha256:" + "0" * 64, tar_size)
    with pytest.raises(IntegrityError, match=re.escape(message)):
        tarsplit.read_record(store, ref, hostile_tree(), CHUNK, "x@1")


def test_record_raw_stream_must_end_where_it_says(store):
    tree = hostile_tree()
    for raw, raw_size, message in ((b"ab", 3, "raw stream ends at byte 2"),
                                   (b"abcd", 3, "raw stream longer than 3 bytes")):
        blob = craft([file_entry(b"f", offset=1)], raw, raw_size=raw_size)
        digest, _ = store.put_blob(blob)
        split = tarsplit.read_record(store, TarSplitRef(digest, len(blob), "sha256:" + "0" * 64,
                                                        raw_size + 10), tree, CHUNK, "x@1")
        with pytest.raises(IntegrityError, match=message):
            tarsplit.write_tar_from_record(store, split, None, CHUNK,  # type: ignore[arg-type]
                                           io.BytesIO(), "x@1")


def test_index_bomb_is_refused(store, monkeypatch):
    monkeypatch.setattr(tarsplit, "MAX_INDEX", 1 << 16)
    blob = craft([file_entry(b"f")] * 5000, b"raw")
    digest, _ = store.put_blob(blob)
    with pytest.raises(IntegrityError, match="index larger than"):
        tarsplit.read_record(store, TarSplitRef(digest, len(blob), "sha256:" + "0" * 64, 0),
                             hostile_tree(), CHUNK, "x@1")


def test_manifest_tar_split_is_optional_and_checked():
    """Manifests without the field are as before; with it, it is typed and bounded."""
    diff = "sha256:" + "ab" * 32
    manifest = LayerManifest("l", "1", "base", CHUNK, MetaRef(diff, 1, diff, 1), BlobRef(diff, 1),
                             0, "now", source=f"oci:{diff}")
    plain = manifest.to_bytes()
    assert b"tar_split" not in plain and LayerManifest.from_bytes(plain) == manifest
    ref = TarSplitRef(diff, 10, diff, 99)
    kept = dataclasses.replace(manifest, tar_split=ref)
    assert LayerManifest.from_bytes(kept.to_bytes()).tar_split == ref
    for bad, message in ((dataclasses.replace(ref, size=MAX_TAR_SPLIT + 1), "tar_split.size"),
                         (dataclasses.replace(ref, diff_id="sha256:" + "0" * 64),
                          "not the layer's source"),
                         (dataclasses.replace(ref, digest="md5:x"), "tar_split.digest")):
        with pytest.raises(IntegrityError, match=message):
            LayerManifest.from_bytes(dataclasses.replace(manifest, tar_split=bad).to_bytes())


def test_record_past_its_bound_is_not_made(tmp_path, store, monkeypatch):
    """Raw bytes beyond the bound (here: a whiteout carrying random data) do
    not fail the import: the layer gets no record and is rebuilt on export."""
    monkeypatch.setattr(tarsplit, "MAX_TAR_SPLIT", 1 << 20)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(tarfile.TarInfo("a"), io.BytesIO(b""))
        padded = tarfile.TarInfo(".wh.b")
        padded.size = 3 << 20
        tar.addfile(padded, io.BytesIO(os.urandom(padded.size)))
    layout = python_image(tmp_path / "L", [buf.getvalue()])
    refstore = RefStore(store)
    result = import_image(refstore, open_oci_source(f"oci:{layout}:t"), ImportOptions("big", "1"))
    assert refstore.layer(result.layers[0].digest).tar_split is None
    export_env(refstore, "big@1", parse_destination(f"oci:{tmp_path / 'out'}:t"))
    (diff_id,), _ = layer_tars(layout, "t")
    got, _ = layer_tars(tmp_path / "out", "t")
    assert got != [diff_id]
