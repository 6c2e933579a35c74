"""`layerfs import`: OCI layouts and archives made with umoci and skopeo, imported
into both stores; trees checked against umoci's own unpack and real overlay
mounts; bad input is one error line and publishes no env."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import zstandard
from support import mounted_layer, need_root
from support.nodes import NodeDaemon
from support.tarcuts import CUT_SHORT, ENDINGS, gnu_long_name_then_end, pax_header_then_end
from support.treecmp import diff_trees

from harness.containerdserver import ContainerdServer, running_containerd
from harness.daemonproc import LAYERFS
from harness.ociimages import (
    ImageSettings,
    LayerChange,
    blob,
    busybox_rootfs,
    make_image,
    manifest_of,
    run,
    tiny_layers_image,
    to_docker_archive,
    to_oci_archive,
)
from harness.registryserver import find_registry, push, start_registry
from layerfs.builder.oci.resolve import host_platform
from layerfs.mounts import mount, umount
from layerfs.refstore import ENVS, LAYERS, RefStore
from layerfs.store.file import FileStore

pytestmark = pytest.mark.end_to_end  # the CLI and outside tools, end to end

REF = "org.opencontainers.image.ref.name"
SETTINGS = ImageSettings(env=["PATH=/bin", "GREETING=hello"], entrypoint=["/bin/sh", "-c"],
                         cmd=["echo $GREETING"], working_dir="/srv", user="0:0",
                         labels={"org.example.kind": "test"}, exposed_ports=["8080/tcp"],
                         stop_signal="SIGTERM")

# A base layer and four layers on it: files changed and deleted (whiteouts), a
# directory emptied and refilled (opaque), hard links, a layer deleting what an
# earlier one added, a directory replaced by a file and a file by a directory,
# an opaque directory listed again by a later layer.
CHANGES = [
    LayerChange(files={"etc/os-release": b"NAME=base\n", "srv/keep": b"keep",
                       "srv/old/a": b"old a", "srv/old/sub/b": b"old b",
                       "data/big": os.urandom(300_000), "data/small": b"small",
                       "tobefile/x": b"x", "tobedir": b"file"},
                dirs=["empty"], symlinks={"srv/link": "keep"}),
    LayerChange(files={"added/later": b"added", "data/big": os.urandom(200_000),
                       "links/one": b"linked content " * 400},
                hardlinks={"links/two": "links/one"}, delete=["data/small"]),
    LayerChange(opaque_dir="/srv/old", files={"fresh": b"fresh"}),
    LayerChange(delete=["added", "tobefile", "tobedir"],
                files={"tobefile": b"now a file", "tobedir/y": b"now a dir"},
                hardlinks={"links/three": "links/one"}),
    LayerChange(files={"srv/old/again": b"again", "etc/os-release": b"NAME=top\n"},
                delete=["srv/link"], modes={"srv/old": 0o750}),
]


def cli(store_args: list[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*LAYERFS, *args, *store_args], capture_output=True, text=True,
                          timeout=300)


def do_import(store_args: list[str], src: str, name: str = "img", version: str = "1",
              *extra: str) -> dict:
    proc = cli(store_args, "import", src, "--name", name, "--version", version, "--json",
               *extra)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layout L with tags base (1 layer), multi (5 layers), more (base + 1 layer)."""
    root = tmp_path_factory.mktemp("images")
    layout = root / "L"
    make_image(layout, "base", CHANGES[:1], SETTINGS)
    make_image(layout, "multi", CHANGES[1:], SETTINGS, base="base")
    make_image(layout, "more", [LayerChange(files={"more/file": os.urandom(100_000)})],
               SETTINGS, base="base")
    return layout


def test_layout_import_makes_one_layer_per_diff_id_and_keeps_the_config(images, store_args,
                                                                         store):
    out = do_import(store_args, f"oci:{images}:multi")
    _, manifest = manifest_of(images, "multi")
    config = json.loads(blob(images, manifest["config"]["digest"]).read_bytes())
    diff_ids = config["rootfs"]["diff_ids"]
    assert [x["diff_ids"] for x in out["layers"]] == [[d] for d in reversed(diff_ids)]
    assert [x["ref"] for x in out["layers"]] == [
        f"oci/sha256/{d.removeprefix('sha256:')}@1" for d in reversed(diff_ids)]
    refstore = RefStore(store)
    env = refstore.env(refstore.resolve(ENVS, "img@1"))
    assert [layer.ref for layer in env.layers] == [x["ref"] for x in out["layers"]]
    c = env.config
    assert c is not None
    assert (c.env, c.entrypoint, c.cmd, c.working_dir, c.user) == (
        ["PATH=/bin", "GREETING=hello"], ["/bin/sh", "-c"], ["echo $GREETING"], "/srv", "0:0")
    assert (c.labels, c.exposed_ports, c.stop_signal) == (
        {"org.example.kind": "test"}, ["8080/tcp"], "SIGTERM")
    assert c.architecture == config["architecture"] and c.os == "linux"
    for x in out["layers"]:
        assert refstore.layer(x["digest"]).source == "oci:" + x["diff_ids"][0]


def test_second_tag_sharing_the_base_uploads_only_its_new_layer(images, store_args):
    first = do_import(store_args, f"oci:{images}:base", "a")
    second = do_import(store_args, f"oci:{images}:more", "b")
    (base,) = first["layers"]
    new, shared = second["layers"]
    assert base["built"] and base["uploaded_bytes"] > 300_000
    assert shared["ref"] == base["ref"] and shared["digest"] == base["digest"]
    assert not shared["built"] and shared["uploaded_bytes"] == 0
    assert new["built"] and 100_000 < new["uploaded_bytes"] < base["uploaded_bytes"]
    inspect = json.loads(cli(store_args, "inspect", "b@1", "--json").stdout)
    assert [x["uploaded_bytes"] for x in inspect["layers"]] == [new["uploaded_bytes"],
                                                                 base["uploaded_bytes"]]
    again = do_import(store_args, f"oci:{images}:more", "b")
    assert not any(x["built"] for x in again["layers"]) and not again["published"]


@contextmanager
def overlay_of(store, digests: list[str], work: Path) -> Iterator[Path]:
    """A read-only overlay mount of layers (top first) over an empty bottom."""
    with ExitStack() as stack:
        lowers = [stack.enter_context(mounted_layer(store, d, str(work / f"l{i}")))
                  for i, d in enumerate(digests)]
        empty, mnt = work / "empty", work / "ovl"
        empty.mkdir()
        mnt.mkdir()
        mount("overlay", str(mnt), "overlay", 0, "lowerdir=" + ":".join([*lowers, str(empty)]))
        stack.callback(umount, str(mnt))
        yield mnt


# How to fold the five layers of "multi": the fold size from the blob sizes,
# and the groups that gives, bottom first.
GROUPINGS = {
    "bottom three": (lambda sizes: sum(sizes[:3]), [3, 2]),
    "top four": (lambda sizes: sum(sizes[1:]), [1, 4]),
}


@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_layers_overlaid_equal_umoci_unpack_and_folding_equals_the_overlay(
        grouping, images, store_args, store, tmp_path):
    need_root()
    plain = do_import(store_args, f"oci:{images}:multi", "plain")
    _, manifest = manifest_of(images, "multi")
    size_of, groups = GROUPINGS[grouping]
    fold = size_of([x["size"] for x in manifest["layers"]])
    folded = do_import(store_args, f"oci:{images}:multi", "folded", "1", "--fold", str(fold))
    assert [len(x["diff_ids"]) for x in reversed(folded["layers"])] == groups
    assert all(x["ref"].startswith("oci/folded/") for x in folded["layers"]
               if len(x["diff_ids"]) > 1)
    run("umoci", "unpack", "--image", f"{images}:multi", str(tmp_path / "bundle"))
    with overlay_of(store, [x["digest"] for x in plain["layers"]], tmp_path / "p") as unfolded, \
            overlay_of(store, [x["digest"] for x in folded["layers"]], tmp_path / "f") as fold_mnt:
        assert (unfolded / "srv" / "old").exists()
        assert sorted(os.listdir(unfolded / "srv" / "old")) == ["again", "fresh"]
        assert not (unfolded / "added").exists() and not (unfolded / "data" / "small").exists()
        assert os.stat(unfolded / "links" / "one").st_ino == os.stat(
            unfolded / "links" / "three").st_ino
        # umoci applies each layer onto the ones below it, so a directory a layer
        # does not list keeps the lower one's mtime; a layer on its own makes it
        # anew (see docs/oci.md): directory mtimes are left out of this comparison.
        problems = diff_trees(str(tmp_path / "bundle" / "rootfs"), str(unfolded),
                              dir_mtime=False)
        assert problems == [], "\n".join(problems)
        problems = diff_trees(str(unfolded), str(fold_mnt))
        assert problems == [], "\n".join(problems)


def test_archives_import_the_same_layers_as_the_layout(images, store_args, tmp_path):
    want = do_import(store_args, f"oci:{images}:multi")
    oci_tar = to_oci_archive(images, "multi", tmp_path / "o.tar")
    oci = do_import(store_args, f"oci-archive:{oci_tar}", "o")
    docker_tar = to_docker_archive(images, "multi", tmp_path / "d.tar")
    docker = do_import(store_args, f"docker-archive:{docker_tar}", "d")
    for got in (oci, docker):
        assert [x["digest"] for x in got["layers"]] == [x["digest"] for x in want["layers"]]
        assert not any(x["built"] for x in got["layers"])
    envs = {e: json.loads(cli(store_args, "inspect", f"{e}@1", "--json").stdout)
            for e in ("img", "o", "d")}
    assert len({json.dumps([x["digest"] for x in r["layers"]]) for r in envs.values()}) == 1


def recompress_zstd(layout: Path, tag: str) -> None:
    """Store the tag's bottom layer zstd-compressed (umoci writes gzip only)."""
    def edit(manifest: dict) -> None:
        layer = manifest["layers"][0]
        data = zstandard.ZstdCompressor().compress(
            gzip.decompress(blob(layout, layer["digest"]).read_bytes()))
        layer.update(mediaType="application/vnd.oci.image.layer.v1.tar+zstd",
                     digest=put_blob(layout, data), size=len(data))
    retag(layout, tag, edit_manifest=edit)


def test_zstd_layer_is_the_same_layer_as_its_gzip_copy(images, store_args, tmp_path):
    layout = tmp_path / "L"
    shutil.copytree(images, layout)
    gz = do_import(store_args, f"oci:{layout}:multi", "gz")
    recompress_zstd(layout, "multi")
    zst = do_import(store_args, f"oci:{layout}:multi", "zst")
    assert zst["image"]["manifest_digest"] != gz["image"]["manifest_digest"]
    assert [x["digest"] for x in zst["layers"]] == [x["digest"] for x in gz["layers"]]
    assert not any(x["built"] for x in zst["layers"])


def test_index_picks_the_host_platform_or_the_one_asked_for(images, store_args, tmp_path):
    layout = tmp_path / "L"
    shutil.copytree(images, layout)
    make_image(layout, "arm", [LayerChange(files={"arm": b"arm"})],
               ImageSettings(architecture="arm64"), base="base")
    host = host_platform().architecture
    entries = []
    for tag, arch, variant in (("arm", "arm64", "v8"), ("more", host, "")):
        path, _ = manifest_of(layout, tag)
        entries.append({"mediaType": "application/vnd.oci.image.manifest.v1+json",
                        "digest": "sha256:" + path.name, "size": path.stat().st_size,
                        "platform": {"os": "linux", "architecture": arch,
                                     **({"variant": variant} if variant else {})}})
    data = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                       "manifests": entries}).encode()
    index = json.loads((layout / "index.json").read_text())
    index["manifests"].append({"mediaType": "application/vnd.oci.image.index.v1+json",
                               "digest": put_blob(layout, data), "size": len(data),
                               "annotations": {REF: "all"}})
    (layout / "index.json").write_text(json.dumps(index))
    mine = do_import(store_args, f"oci:{layout}:all", "mine")
    assert mine["image"]["manifest_digest"] == entries[1]["digest"]
    arm = do_import(store_args, f"oci:{layout}:all", "arm", "1", "--platform", "linux/arm64")
    assert arm["image"]["manifest_digest"] == entries[0]["digest"]
    proc = cli(store_args, "import", f"oci:{layout}:all", "--name", "x", "--version", "1",
               "--platform", "linux/s390x")
    assert proc.returncode == 3 and "no image for platform linux/s390x" in proc.stderr


def test_registry_image_imports_to_the_layout_s_layers(images, store_args, tmp_path):
    binary = find_registry()
    if binary is None:
        pytest.fail("docker-registry is not installed (make deps installs it)")
    server = start_registry(binary, tmp_path / "registry")
    try:
        ref = push(images, "multi", server, "test/multi")
        want = do_import(store_args, f"oci:{images}:multi")
        got = do_import(store_args, ref, "reg", "1", "--plain-http")
    finally:
        server.stop()
    assert [x["digest"] for x in got["layers"]] == [x["digest"] for x in want["layers"]]
    assert not any(x["built"] for x in got["layers"])


# --- bad input: one error line, nonzero exit, no env ---------------------------------


def put_blob(layout: Path, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blob(layout, digest).write_bytes(data)
    return digest


def retag(layout: Path, tag: str, edit_manifest: Callable[[dict], None] | None = None,
          edit_config: Callable[[dict], None] | None = None, media_type: str | None = None
          ) -> None:
    """Rewrite a tag's manifest (and config) with correct digests after an edit."""
    _, manifest = manifest_of(layout, tag)
    if edit_config:
        config = json.loads(blob(layout, manifest["config"]["digest"]).read_bytes())
        edit_config(config)
        data = json.dumps(config).encode()
        manifest["config"].update(digest=put_blob(layout, data), size=len(data))
    if edit_manifest:
        edit_manifest(manifest)
    data = json.dumps(manifest).encode()
    index = json.loads((layout / "index.json").read_text())
    for desc in index["manifests"]:
        if desc.get("annotations", {}).get(REF) == tag:
            desc.update(digest=put_blob(layout, data), size=len(data))
            if media_type:
                desc["mediaType"] = media_type
    (layout / "index.json").write_text(json.dumps(index))


def wrong_diff_id(config: dict) -> None:
    config["rootfs"]["diff_ids"][-1] = "sha256:" + "0" * 64


def media_type(manifest: dict) -> None:
    manifest["mediaType"] = "application/vnd.example.manifest.v9+json"


def tamper_manifest(layout: Path) -> None:
    path, _ = manifest_of(layout, "bad")
    path.write_bytes(path.read_bytes().replace(b'"schemaVersion":2', b'"schemaVersion": 2'))


def truncate_top_layer(layout: Path) -> None:
    _, manifest = manifest_of(layout, "bad")
    path = blob(layout, manifest["layers"][-1]["digest"])
    data = path.read_bytes()
    path.unlink()  # the blob is shared with other tags' copies: write a new file
    path.write_bytes(data[: len(data) // 2])


BAD = {
    "manifest digest": (tamper_manifest, "integrity check failed", "bad"),
    "diff_id": (lambda lay: retag(lay, "bad", edit_config=wrong_diff_id), "diff_id", "bad"),
    "truncated blob": (truncate_top_layer, "bytes, expected", "bad"),
    "media type": (lambda lay: retag(lay, "bad", media_type,
                                     media_type="application/vnd.example.manifest.v9+json"),
                   "unknown manifest media type", "bad"),
    "missing tag": (lambda lay: None, "no image tagged 'nope'", "nope"),
}


@pytest.fixture(scope="module")
def two_layer_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    layout = tmp_path_factory.mktemp("bad") / "L"
    return make_image(layout, "bad", [LayerChange(files={"a": os.urandom(70_000)}),
                                      LayerChange(files={"b": os.urandom(90_000)})], SETTINGS)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_image_is_one_error_line_and_no_env(case, two_layer_image, tmp_path, store_args):
    layout = tmp_path / "L"
    shutil.copytree(two_layer_image, layout)
    spoil, message, tag = BAD[case]
    spoil(layout)
    proc = cli(store_args, "import", f"oci:{layout}:{tag}", "--name", "bad", "--version", "1")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("layerfs: error: "), proc.stderr
    assert message in lines[0]
    listed = cli(store_args, "env", "ls", "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == []


def set_layers(manifest: dict) -> None:
    manifest["layers"] = "not a list"


def set_env(config: dict) -> None:
    config["config"]["Env"] = 5


def set_label(config: dict) -> None:
    config["config"]["Labels"] = {"a": ["b"]}


MALFORMED = {
    "layers not a list": (lambda lay: retag(lay, "bad", edit_manifest=set_layers), "layers"),
    "Env a number": (lambda lay: retag(lay, "bad", edit_config=set_env), "'Env'"),
    "label not a string": (lambda lay: retag(lay, "bad", edit_config=set_label), "Labels"),
    "index entry not an object": (
        lambda lay: (lay / "index.json").write_text('{"manifests": [5]}'), "descriptor"),
    "index not JSON": (lambda lay: (lay / "index.json").write_text("{"), "not valid JSON"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_documents_are_one_error_line(case, two_layer_image, tmp_path):
    layout = tmp_path / "L"
    shutil.copytree(two_layer_image, layout)
    spoil, message = MALFORMED[case]
    spoil(layout)
    store = ["--store", f"file://{tmp_path / 'store'}"]
    proc = cli(store, "import", f"oci:{layout}:bad", "--name", "bad", "--version", "1")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 3 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("layerfs: error: source ") and message in lines[0]


def test_docker_archive_with_malformed_repo_tags_is_one_error_line(two_layer_image, tmp_path):
    good = to_docker_archive(two_layer_image, "bad", tmp_path / "good.tar")
    bad = tmp_path / "bad.tar"
    with tarfile.open(good) as src, tarfile.open(bad, "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member) if member.isreg() else None
            if member.name == "manifest.json":
                doc = json.loads(data.read())  # type: ignore[union-attr]
                doc[0]["RepoTags"] = 5
                raw = json.dumps(doc).encode()
                member.size, data = len(raw), io.BytesIO(raw)
            dst.addfile(member, data)
    store = ["--store", f"file://{tmp_path / 'store'}"]
    proc = cli(store, "import", f"docker-archive:{bad}:test/image:bad", "--name", "x",
               "--version", "1")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 3 and len(lines) == 1, proc.stderr
    assert "RepoTags must be a list of strings" in lines[0]


# --- a hostile layout: what is not a regular file beneath it is not read ----------------

HOSTILE_TIMEOUT = 60  # a FIFO blob used to hang the import for ever: fail instead
SECRET = b"host secret " + os.urandom(8).hex().encode()


def fifo_blob(layout: Path, host: Path) -> None:
    path = blob(layout, manifest_of(layout, "bad")[1]["layers"][0]["digest"])
    path.unlink()
    os.mkfifo(path)


def fifo_index(layout: Path, host: Path) -> None:
    (layout / "index.json").unlink()
    os.mkfifo(layout / "index.json")


def blob_linked_to_host_file(layout: Path, host: Path) -> None:
    """The top layer (holding a secret) moved to a root-only host file; the blob a
    symlink to it: followed, the import would succeed and store the secret."""
    path = blob(layout, manifest_of(layout, "bad")[1]["layers"][-1]["digest"])
    host.mkdir(mode=0o700)
    secret = host / "secret-blob"
    shutil.move(path, secret)
    os.chmod(secret, 0o600)
    path.symlink_to(secret)


def blob_dir_linked_elsewhere(layout: Path, host: Path) -> None:
    shutil.move(layout / "blobs" / "sha256", host)
    (layout / "blobs" / "sha256").symlink_to(host)


HOSTILE = {
    "blob a FIFO": (fifo_blob, "not a regular file (a FIFO)"),
    "index.json a FIFO": (fifo_index, "index.json: not a regular file (a FIFO)"),
    "blob a symlink to a host file": (blob_linked_to_host_file, "a symlink"),
    "blobs/sha256 a symlink": (blob_dir_linked_elsewhere, "a symlink"),
}


@pytest.fixture(scope="module")
def secret_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    layout = tmp_path_factory.mktemp("secret") / "L"
    return make_image(layout, "bad", [LayerChange(files={"a": os.urandom(70_000)}),
                                      LayerChange(files={"secret": SECRET})], SETTINGS)


@pytest.mark.parametrize("case", list(HOSTILE))
def test_layout_file_not_regular_beneath_it_is_refused_unread(case, secret_image, tmp_path):
    layout = tmp_path / "L"
    shutil.copytree(secret_image, layout)
    spoil, message = HOSTILE[case]
    spoil(layout, tmp_path / "host")
    store = tmp_path / "store"
    store.mkdir()  # an empty store (a missing one is unreachable to readers)
    proc = subprocess.run([*LAYERFS, "import", f"oci:{layout}:bad", "--name", "bad",
                           "--version", "1", "--store", f"file://{store}"],
                          capture_output=True, text=True, timeout=HOSTILE_TIMEOUT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 3 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("layerfs: error: source ") and message in lines[0], lines[0]
    listed = cli(["--store", f"file://{store}"], "env", "ls", "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == []
    stored = [p.read_bytes() for p in store.rglob("*") if p.is_file()] if store.exists() else []
    assert not any(SECRET in data for data in stored)


@pytest.mark.parametrize("scheme", ["oci-archive", "docker-archive"])
def test_archive_that_is_a_fifo_is_one_line_not_a_hang(scheme, tmp_path):
    os.mkfifo(tmp_path / "image.tar")
    proc = subprocess.run([*LAYERFS, "import", f"{scheme}:{tmp_path / 'image.tar'}", "--name",
                           "bad", "--version", "1", "--store", f"file://{tmp_path / 'store'}"],
                          capture_output=True, text=True, timeout=HOSTILE_TIMEOUT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 3 and len(lines) == 1, proc.stderr
    assert "not a regular file (a FIFO)" in lines[0]


# --- a real image in a real sandbox ----------------------------------------------------


def test_busybox_image_comes_up_in_a_sandbox(tmp_path, store_args):
    need_root()
    layout = tmp_path / "L"
    rootfs = busybox_rootfs(tmp_path / "rootfs")
    make_image(layout, "bb", [LayerChange(copy_tree=str(rootfs)),
                              LayerChange(files={"srv/hello.txt": b"hello from the image\n"})],
               ImageSettings(env=["PATH=/bin", "GREETING=hello"], entrypoint=["/bin/sh", "-c"],
                             cmd=["echo $GREETING; pwd; cat hello.txt"], working_dir="/srv"))
    do_import(store_args, f"docker-archive:{to_docker_archive(layout, 'bb', tmp_path / 'd.tar')}",
              "bb")
    node = NodeDaemon(tmp_path / "node", store_args, cache_size="64M").start()
    try:
        up = node.cli("up", "bb@1", "--id", "s1")
        sandbox = Path(up.stdout.strip())
        assert (sandbox / "srv" / "hello.txt").read_text() == "hello from the image\n"
        proc = node.cli("run", "s1")  # the image's Entrypoint + Cmd, Env and WorkingDir
        assert proc.stdout.splitlines() == ["hello", "/srv", "hello from the image"]
        node.cli("down", "s1")
    finally:
        assert node.cleanup() == []


@pytest.mark.parametrize("mode", ["htpasswd", "token"])
def test_registry_import_needs_credentials_and_takes_them_from_the_auth_file(
        images, store_args, tmp_path, monkeypatch, mode):
    binary = find_registry()
    if binary is None:
        pytest.fail("docker-registry is not installed (make deps installs it)")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no real credentials
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
    server = start_registry(binary, tmp_path / "registry", mode)
    try:
        ref = push(images, "base", server, "test/base")
        denied = cli(store_args, "import", ref, "--name", "reg", "--version", "1",
                     "--plain-http")
        assert denied.returncode == 7, denied.stderr
        assert denied.stderr.count("\n") == 1 and "authentication required" in denied.stderr
        assert server.account is not None and server.account.password not in denied.stderr
        assert "reg" not in cli(store_args, "env", "ls").stdout  # nothing published
        auth = server.account.auth_file(tmp_path / "auth.json", server.host)
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(auth))
        got = do_import(store_args, ref, "reg", "1", "--plain-http")
    finally:
        server.stop()
    assert got["layers"] and server.account.password not in json.dumps(got)


# --- containerd as the reference: the tree it unpacks is the tree layerfs imports -------

BUSYBOX_SETTINGS = ImageSettings(env=["PATH=/bin", "GREETING=hello"],
                                 entrypoint=["/bin/sh", "-c"],
                                 cmd=["echo $GREETING; pwd; cat hello.txt"], working_dir="/srv")


@pytest.fixture(scope="module")
def containerd(starts_a_server,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[ContainerdServer]:
    need_root()
    with running_containerd(tmp_path_factory.mktemp("containerd")) as server:
        yield server


@pytest.fixture(scope="module")
def inserted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layout with tag "ins" made with ``umoci insert`` only, whose layer tars
    end right after the last member's data: a busybox tree (files of odd and
    whole-block sizes, a symlink, a hard link), then one small file."""
    root = tmp_path_factory.mktemp("inserted")
    rootfs = busybox_rootfs(root / "rootfs")
    (rootfs / "srv" / "sub").mkdir(parents=True)
    (rootfs / "srv" / "odd").write_bytes(os.urandom(1000))
    (rootfs / "srv" / "sub" / "block").write_bytes(os.urandom(1024))
    (rootfs / "srv" / "sub" / "empty").write_bytes(b"")
    os.link(rootfs / "srv" / "odd", rootfs / "srv" / "odd.link")
    (rootfs / "srv" / "to-odd").symlink_to("odd")
    layout = make_image(root / "L", "ins", [], BUSYBOX_SETTINGS)
    run("umoci", "insert", "--image", f"{layout}:ins", str(rootfs), "/")
    hello = root / "hello.txt"
    hello.write_bytes(b"hello from the image\n")
    run("umoci", "insert", "--image", f"{layout}:ins", str(hello), "/srv/hello.txt")
    return layout


@pytest.fixture(scope="module")
def repacked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layout with tag "ctd": the layers of "multi" made with umoci repack and
    Python's tarfile (the opaque one), less the one containerd 1.6 refuses
    (umoci 0.4.7 writes ``tobefile/.wh.x`` after the file ``tobefile``, where
    containerd cannot make the whiteout's parent)."""
    layout = tmp_path_factory.mktemp("repacked") / "L"
    return make_image(layout, "ctd", [CHANGES[0], CHANGES[1], CHANGES[2], CHANGES[4]],
                      SETTINGS)


def layout_archive(layout: Path, path: Path) -> Path:
    """The layout as one tar, as ``ctr image import`` takes an OCI layout."""
    run("tar", "-C", str(layout), "-cf", str(path), ".")
    return path


def file_store(tmp_path: Path) -> tuple[FileStore, list[str]]:
    return FileStore(str(tmp_path / "store")), ["--store", f"file://{tmp_path / 'store'}"]


def containerd_and_layerfs_trees(containerd: ContainerdServer, archive: Path, tag: str,
                                 src: str, work: Path) -> list[str]:
    """Import into both; the differences between containerd's unpacked tree and
    the layers layerfs imported, overlaid."""
    names = [n for n in containerd.imported_names(containerd.import_image(archive))
             if n.endswith(f":{tag}")]
    assert len(names) == 1, names
    store, store_args = file_store(work)
    digests = [x["digest"] for x in do_import(store_args, src, "x")["layers"]]
    with containerd.mounted(names[0], work / "containerd") as theirs, \
            overlay_of(store, digests, work / "layerfs") as ours:
        # a directory a layer does not list keeps the lower one's mtime when
        # containerd applies layers one on another (docs/oci.md)
        return diff_trees(str(theirs), str(ours), dir_mtime=False)


def test_tools_layer_tars_unpack_in_containerd_as_layerfs_imports_them(
        containerd, repacked, inserted, tmp_path):
    """umoci insert (no padding, no end blocks), umoci repack and Python's
    tarfile (the opaque layer), skopeo's oci-archive and docker-archive."""
    oci_tar = tmp_path / "o.tar"
    run("skopeo", "--insecure-policy", "copy", f"oci:{repacked}:ctd",
        f"oci-archive:{oci_tar}:ctd")
    docker_tar = to_docker_archive(repacked, "ctd", tmp_path / "d.tar")
    cases = {
        "umoci insert": (layout_archive(inserted, tmp_path / "ins.tar"), "ins",
                         f"oci:{inserted}:ins"),
        "umoci repack": (layout_archive(repacked, tmp_path / "ctd.tar"), "ctd",
                         f"oci:{repacked}:ctd"),
        "skopeo oci-archive": (oci_tar, "ctd", f"oci-archive:{oci_tar}"),
        "skopeo docker-archive": (docker_tar, "ctd", f"docker-archive:{docker_tar}"),
    }
    problems = {case: containerd_and_layerfs_trees(containerd, archive, tag, src,
                                                   tmp_path / f"w{i}")
                for i, (case, (archive, tag, src)) in enumerate(cases.items())}
    assert problems == dict.fromkeys(cases, [])


def single_layer_layout(layout: Path, tag: str, tar: bytes) -> Path:
    """An OCI layout whose one image has ``tar`` (gzip-compressed) as its layer."""
    (layout / "blobs" / "sha256").mkdir(parents=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    data = gzip.compress(tar)
    layer = {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
             "digest": put_blob(layout, data), "size": len(data)}
    config = json.dumps({"architecture": host_platform().architecture, "os": "linux",
                         "config": {}, "rootfs": {"type": "layers", "diff_ids": [
                             "sha256:" + hashlib.sha256(tar).hexdigest()]}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": put_blob(layout, config), "size": len(config)},
        "layers": [layer]}).encode()
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": put_blob(layout, manifest), "size": len(manifest),
        "annotations": {REF: tag}}]}
    (layout / "index.json").write_text(json.dumps(index))
    return layout


def test_containerd_and_layerfs_agree_where_a_layer_tar_may_end(containerd, tmp_path):
    """Each ending and each cut of tests/support/tarcuts.py as an image layer: both
    accept or both refuse it (layerfs with one error line), and what both
    accept unpacks to the same tree."""
    cases = {**ENDINGS, "GNU long name, no member after it": gnu_long_name_then_end,
             "pax header, no member after it": pax_header_then_end, **CUT_SHORT}
    verdicts, problems = {}, {}
    for i, (case, make) in enumerate(cases.items()):
        work = tmp_path / f"c{i}"
        layout = single_layer_layout(work / "L", f"cut{i}", make())
        theirs = containerd.import_image(layout_archive(layout, work / "L.tar"), check=False)
        store, store_args = file_store(work)
        ours = cli(store_args, "import", f"oci:{layout}:cut{i}", "--name", "x", "--version",
                   "1", "--json")
        verdicts[case] = (theirs.returncode == 0, ours.returncode == 0)
        if ours.returncode != 0:
            assert ours.returncode == 3 and ours.stderr.count("\n") == 1, ours.stderr
        if theirs.returncode == 0 and ours.returncode == 0:
            (name,) = containerd.imported_names(theirs)
            digest = json.loads(ours.stdout)["layers"][0]["digest"]
            with containerd.mounted(name, work / "containerd") as ctd_tree, \
                    overlay_of(store, [digest], work / "layerfs") as our_tree:
                problems[case] = diff_trees(str(ctd_tree), str(our_tree), dir_mtime=False)
    assert verdicts == {case: (case not in CUT_SHORT,) * 2 for case in cases}
    assert problems == {case: [] for case in cases if case not in CUT_SHORT}


def test_umoci_insert_image_comes_up_in_a_sandbox(inserted, tmp_path):
    """The layer umoci insert writes ends inside a block; the image imports and runs."""
    need_root()
    _, manifest = manifest_of(inserted, "ins")
    top = gzip.decompress(blob(inserted, manifest["layers"][-1]["digest"]).read_bytes())
    assert len(top) % 512 != 0  # no padding, no end-of-archive blocks
    _, store_args = file_store(tmp_path)
    do_import(store_args, f"oci:{inserted}:ins", "ins")
    node = NodeDaemon(tmp_path / "node", store_args, cache_size="64M").start()
    try:
        up = node.cli("up", "ins@1", "--id", "s1")
        sandbox = Path(up.stdout.strip())
        assert (sandbox / "srv" / "hello.txt").read_text() == "hello from the image\n"
        proc = node.cli("run", "s1")
        assert proc.stdout.splitlines() == ["hello", "/srv", "hello from the image"]
        node.cli("down", "s1")
    finally:
        assert node.cleanup() == []


# --- many layers, repeated layers ------------------------------------------------------

MANY = 300  # an overlay option string of ROOT/layers/<hex> paths holds about 40


def file_layers(count: int, tag: str) -> list[dict[str, bytes]]:
    """``count`` tiny layers: each adds ``many/N`` and writes its number to ``top``."""
    return [{f"many/{k}": f"{tag} {k}\n".encode(), "top": f"{k}\n".encode()}
            for k in range(count)]


@pytest.mark.parametrize("store_location", ["file"], indirect=True)
def test_an_image_of_300_layers_imports_comes_up_and_runs(tmp_path, store, store_args):
    need_root()
    layout = tiny_layers_image(tmp_path / "L", "many",
                               [busybox_rootfs(tmp_path / "rootfs"), *file_layers(MANY, "m")],
                               {"Env": ["PATH=/bin"], "Cmd": ["cat", "/top"]})
    got = do_import(store_args, f"oci:{layout}:many", "many")
    assert len(got["layers"]) == MANY + 1
    # an env of these 301 and 200 more: more than a sandbox stacks, refused
    more = do_import(store_args, f"oci:{tiny_layers_image(layout, 'more', file_layers(200, 'x'))}"
                     ":more", "more")
    proc = cli(store_args, "env", "create", "big@1", "--on", "many@1",
               *[arg for x in more["layers"] for arg in ("--layer", x["ref"])])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "env big@1 has 501 distinct layers" in lines[0] and "--fold" in lines[0]
    assert RefStore(store).read_ref(ENVS, "big", "1") is None
    node = NodeDaemon(tmp_path / "node", store_args, cache_size="64M").start()
    try:
        rootfs = Path(node.cli("up", "many@1", "--id", "s1").stdout.strip())
        assert sorted(os.listdir(rootfs / "many"), key=int) == [str(k) for k in range(MANY)]
        assert all((rootfs / "many" / str(k)).read_text() == f"m {k}\n" for k in range(MANY))
        assert (rootfs / "top").read_text() == f"{MANY - 1}\n"  # the topmost layer's
        assert node.cli("run", "s1").stdout == f"{MANY - 1}\n"
        node.cli("down", "s1")
    finally:
        assert node.cleanup() == []


@pytest.mark.parametrize("store_location", ["file"], indirect=True)
def test_an_image_that_repeats_a_layer_comes_up_with_its_topmost_place(tmp_path, store_args):
    need_root()
    a, b = {"who": b"a\n", "a": b"a"}, {"who": b"b\n", "b": b"b"}
    layout = tiny_layers_image(tmp_path / "L", "rep", [a, b, a, b, a])
    got = do_import(store_args, f"oci:{layout}:rep", "rep")
    assert len(got["layers"]) == 5 and len({x["digest"] for x in got["layers"]}) == 2
    assert [x["built"] for x in got["layers"]].count(True) == 2
    node = NodeDaemon(tmp_path / "node", store_args, cache_size="64M").start()
    try:
        rootfs = Path(node.cli("up", "rep@1", "--id", "s1").stdout.strip())
        assert (rootfs / "who").read_text() == "a\n"  # a is the top layer
        assert (rootfs / "a").read_text() == "a" and (rootfs / "b").read_text() == "b"
        ps = json.loads(node.cli("ps", "--json").stdout)
        assert len(ps[0]["layers"]) == 2  # each layer mounted once
        node.cli("down", "s1")
    finally:
        assert node.cleanup() == []


def test_an_image_of_more_layers_than_an_overlay_stacks_is_refused_naming_fold(
        tmp_path, store, store_args):
    layout = tiny_layers_image(tmp_path / "L", "big", file_layers(501, "b"))
    proc = cli(store_args, "import", f"oci:{layout}:big", "--name", "big", "--version", "1")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "501 distinct layers" in lines[0] and "500" in lines[0] and "--fold" in lines[0]
    refstore = RefStore(store)
    assert refstore.list_refs(ENVS) == [] and refstore.list_refs(LAYERS) == []  # nothing published
    assert list(store.list("")) == []
