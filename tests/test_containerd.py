"""layerfs as containerd's snapshotter, with the real things: Debian's
containerd 1.6 (its own root, state and sockets, layerfs as a
``proxy_plugins`` entry, the CRI plugin pulling with it as Kubernetes does),
the real registry (``docker-registry``, whose access log counts the layer
blobs fetched) and runc.

One containerd, registry and layerfs daemon for the module (about 6 s in
all): an image layerfs imported is pulled through CRI with no layer blob
downloaded and runs from lazily served layers; an image layerfs never saw
pulls and unpacks into plain snapshots (``ctr image pull``) and runs; one
whose lower layers layerfs imported fetches and unpacks only its upper
layer, over the lazy ones; the
snapshots API's semantics and error codes, asked directly and through ``ctr
snapshots``; a ``kill -9`` of the daemon under a running container, whose
reads go on; containerd's garbage collection removing the snapshots (Remove,
Cleanup) and with them the layer mounts and directories.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from support import need_root
from support.nodes import NodeDaemon

from harness.containerdserver import (
    ContainerdServer,
    cri_config,
    cri_pull,
    find_containerd,
    proxy_snapshotter_config,
    running_containerd,
)
from harness.daemonproc import LAYERFS, detach_mounts
from harness.ociimages import busybox_rootfs, tiny_layers_image
from harness.registryserver import RegistryServer, find_registry, push, start_registry
from layerfs.builder.env import publish_env
from layerfs.builder.oci.chains import chain_env, chain_ids, chain_of
from layerfs.builder.oci.importer import ImportOptions, import_image
from layerfs.builder.oci.sources import open_source
from layerfs.errors import LayerInUse
from layerfs.manifest import EnvLayer
from layerfs.node.containerd.api import snapshots_pb2, snapshots_pb2_grpc
from layerfs.node.containerd.snapshotter import MAX_LOWERS, Snapshotter
from layerfs.node.containerd.snapstore import (
    ACTIVE,
    COMMITTED,
    MAX_LABELS,
    SnapshotInvalid,
    SnapshotPrecondition,
    SnapshotRecord,
    SnapshotsClosed,
    SnapshotStore,
    check_labels,
)
from layerfs.node.replica.replica import Replica
from layerfs.refstore import ENVS, RefStore
from layerfs.retention import remove
from layerfs.store.file import FileStore

MiB = 1 << 20
SNAPSHOTTER = "layerfs"
K8S = "k8s.io"  # the namespace CRI pulls into
APPLETS = ("sh", "cat", "echo", "ls", "sha256sum", "sleep", "id")
# garbage is collected when a test asks (`rm --sync`), never in the middle of another
GC_ON_REQUEST = ('[plugins."io.containerd.gc.v1.scheduler"]\n  mutation_threshold = 1000000\n'
                 '  startup_delay = "1h"\n')
BLOB_GET = re.compile(r'"GET /v2/[^ ]+/blobs/(sha256:[0-9a-f]{64}) ')


@dataclass
class Image:
    ref: str  # HOST/REPO:TAG
    layers: list[str]  # blob digests, bottom first
    config: str  # its config's digest
    files: dict[str, bytes]  # of its top layer


@dataclass
class World:
    registry: RegistryServer
    node: NodeDaemon
    containerd: ContainerdServer
    socket: Path
    lazy: Image  # imported into layerfs
    plain: Image  # not imported
    mixed: Image  # the lazy image's layers and one not imported

    def blob_gets(self, since: int) -> list[str]:
        """The blob digests the registry served (GET) since log offset ``since``."""
        with open(self.registry.log_path, "rb") as f:
            f.seek(since)
            return BLOB_GET.findall(f.read().decode(errors="replace"))

    def log_offset(self) -> int:
        return self.registry.log_path.stat().st_size

    def ctr(self, *args: str, namespace: str = K8S,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.containerd.ctr(*args, namespace=namespace, check=check)

    def stub(self) -> snapshots_pb2_grpc.SnapshotsStub:
        return snapshots_pb2_grpc.SnapshotsStub(grpc.insecure_channel(f"unix:{self.socket}"))


def make_image(layout: Path, tag: str, files: list[dict[str, bytes]], base: Path,
               ) -> tuple[Path, dict]:
    """A busybox layer (the tree ``base``, made if missing: the same tree is
    the same layer) and a layer of each of ``files``."""
    if not base.exists():
        busybox_rootfs(base, APPLETS)
    tiny_layers_image(layout, tag, [base, *files])
    index = json.loads((layout / "index.json").read_text())
    desc = index["manifests"][-1]
    manifest = json.loads((layout / "blobs" / "sha256" /
                           desc["digest"].removeprefix("sha256:")).read_bytes())
    return layout, manifest


def pushed(layout: Path, tag: str, manifest: dict, registry: RegistryServer, repo: str,
           files: dict[str, bytes]) -> Image:
    push(layout, tag, registry, repo)
    return Image(f"{registry.host}/{repo}:{tag}", [d["digest"] for d in manifest["layers"]],
                 manifest["config"]["digest"], files)


def need_tools() -> None:
    need_root()
    for tool in ("docker-registry", "skopeo", "runc", "containerd-shim-runc-v2"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (make deps)")
    if find_containerd() is None:
        pytest.skip("containerd is not installed (make deps)")


def test_import_records_every_chain_and_its_layers_make_it_again(tmp_path):
    layout = tiny_layers_image(tmp_path / "layout", "v1", [{"a": b"1"}, {"b": b"2"},
                                                           {"a": b"1"}, {"c": b"3"}])
    refstore = RefStore(FileStore(tmp_path / "store"))
    source = open_source(f"oci:{layout}:v1")
    try:
        result = import_image(refstore, source, ImportOptions("img", "1"))
    finally:
        source.close()
    diff_ids = [d for x in reversed(result.layers) for d in x.diff_ids]
    a, b = diff_ids[:2]
    assert chain_ids(diff_ids)[:2] == [a, "sha256:" + sha(f"{a} {b}".encode())]  # the spec's
    assert result.chains == chain_ids(diff_ids)
    layers = [x.digest for x in result.layers]  # top first
    for k, chain in enumerate(result.chains):
        env = refstore.env(refstore.resolve(ENVS, chain_env(chain)))
        assert [x.digest for x in env.layers] == layers[len(layers) - k - 1:]
        assert chain_of([refstore.layer(x.digest) for x in env.layers]) == chain
    # a second import of the same image keeps the entries
    source = open_source(f"oci:{layout}:v1")
    try:
        assert import_image(refstore, source, ImportOptions("img", "1")).chains == result.chains
    finally:
        source.close()
    # removing the image's env and layers takes their chain entries along (no users)
    other = tiny_layers_image(tmp_path / "other", "v1", [{"a": b"1"}, {"z": b"9"}])
    source = open_source(f"oci:{other}:v1")
    try:
        imported = import_image(refstore, source, ImportOptions("other", "1"))
    finally:
        source.close()
    kept = imported.chains
    assert kept[0] == result.chains[0]  # the same bottom layer
    only_img = sorted({x.ref for x in result.layers} - {x.ref for x in imported.layers})
    with pytest.raises(LayerInUse):  # env img@1 names them
        remove(refstore, only_img)
    removed = remove(refstore, ["env:img@1", *only_img])
    gone = {f"{entry.name}@{entry.version}" for entry, done in removed if done}
    assert gone == {"img@1", *only_img, *(chain_env(c) for c in result.chains[1:])}
    for chain in kept:  # other@1's chains: still there
        refstore.env(refstore.resolve(ENVS, chain_env(chain)))
    # an entry whose layers hold another chain ([a, b] under the name of [b, a]) shows it
    wrong = chain_ids([b, a])[-1]
    name, _, version = chain_env(wrong).partition("@")
    publish_env(refstore, name, version, [EnvLayer(result.layers[-2].ref, layers[-2]),
                                          EnvLayer(result.layers[-1].ref, layers[-1])])
    env = refstore.env(refstore.resolve(ENVS, chain_env(wrong)))
    assert chain_of([refstore.layer(x.digest) for x in env.layers]) != wrong


@pytest.fixture(scope="module")
def ctrd(starts_a_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    need_tools()
    base = tmp_path_factory.mktemp("ctrd")
    registry_binary = find_registry()
    assert registry_binary is not None
    registry = start_registry(registry_binary, base / "registry")
    node: NodeDaemon | None = None
    try:
        lazy_files = {"etc/msg": b"hello from layerfs\n", "data/big.bin": os.urandom(3 * MiB),
                      "data/later.bin": os.urandom(8 * MiB)}
        plain_files = {"etc/msg": b"plain unpack\n"}
        mixed_files = {"etc/msg": b"mixed: unpacked over lazy layers\n"}
        layout, manifest = make_image(base / "lazy-layout", "v1", [lazy_files], base / "bb")
        lazy = pushed(layout, "v1", manifest, registry, "lazy/app", lazy_files)
        # the lazy image's two layers and one more that layerfs does not have
        layout, manifest = make_image(base / "mixed-layout", "v1", [lazy_files, mixed_files],
                                      base / "bb")
        mixed = pushed(layout, "v1", manifest, registry, "mixed/app", mixed_files)
        layout, manifest = make_image(base / "plain-layout", "v1", [plain_files],
                                      base / "bb-plain")
        plain = pushed(layout, "v1", manifest, registry, "plain/app", plain_files)
        store = f"file://{base / 'store'}"
        subprocess.run([*LAYERFS, "import", f"docker://{lazy.ref}", "--plain-http", "--name",
                        "lazy/app", "--version", "1", "--store", store], check=True,
                       capture_output=True, timeout=120)
        socket = base / "snapshotter.sock"
        node = NodeDaemon(base / "node", ["--store", store])
        node.extra_args = ["--containerd-snapshotter", str(socket)]
        node.start()
        directory = base / "containerd"
        config = (proxy_snapshotter_config(SNAPSHOTTER, socket)
                  + cri_config(directory, SNAPSHOTTER, registry.host) + GC_ON_REQUEST)
        with running_containerd(directory, config, cri=True) as containerd:
            yield World(registry, node, containerd, socket, lazy, plain, mixed)
    finally:
        registry.stop()
        if node is not None:
            left = node.cleanup()
            assert not [p for p in left if "/snapshots/" not in p], left


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run_in(ctrd: World, image: Image, cid: str, *argv: str, namespace: str = K8S) -> str:
    """The command's standard output, written to a file of a host directory
    bound into the container: ctr's own copy of a process's output can miss
    its last writes when the process exits right after them."""
    out = Path(tempfile.mkdtemp(prefix=f"ctr-{cid}-"))
    try:
        ctrd.ctr("run", "--rm", "--snapshotter", SNAPSHOTTER,
                 "--mount", f"type=bind,src={out},dst=/out,options=rbind:rw",
                 image.ref, cid, "sh", "-c", f"{shlex.join(argv)} > /out/stdout",
                 namespace=namespace)
        return (out / "stdout").read_text()
    finally:
        shutil.rmtree(out, ignore_errors=True)


def backend_snapshots(ctrd: World) -> list[snapshots_pb2.Info]:
    stub = ctrd.stub()
    return [info for answer in stub.List(snapshots_pb2.ListSnapshotsRequest()) for info in
            answer.info]


def test_cri_pull_of_an_imported_image_fetches_no_layer_blob_and_runs_lazily(ctrd):
    since = ctrd.log_offset()
    cri_pull(ctrd.containerd.address, ctrd.lazy.ref)
    gets = ctrd.blob_gets(since)
    assert ctrd.lazy.config in gets  # manifest and config only
    assert not set(ctrd.lazy.layers) & set(gets), gets
    infos = [i for i in backend_snapshots(ctrd) if i.kind == snapshots_pb2.COMMITTED]
    assert len(infos) == len(ctrd.lazy.layers)  # one committed snapshot per chain, lazily
    listed = ctrd.ctr("snapshots", "--snapshotter", SNAPSHOTTER, "ls").stdout
    assert listed.count("Committed") == len(ctrd.lazy.layers), listed
    out = run_in(ctrd, ctrd.lazy, "lazy-run", "sh", "-c",
                 "cat /etc/msg; sha256sum /data/big.bin; id -u")
    assert "hello from layerfs" in out
    assert sha(ctrd.lazy.files["data/big.bin"]) in out
    stats = ctrd.node.request("stats")
    read = sum(layer["bytes_read"] for layer in stats["layers"].values())
    assert read >= 3 * MiB  # served by layerfs, on demand: data/later.bin was never read
    assert read < sum(layer["blob_bytes"] for layer in stats["layers"].values())


def test_an_image_layerfs_has_not_imported_unpacks_into_plain_snapshots_and_runs(ctrd):
    since = ctrd.log_offset()
    ctrd.ctr("image", "pull", "--plain-http", "--snapshotter", SNAPSHOTTER, ctrd.plain.ref,
              namespace="default")
    assert set(ctrd.plain.layers) <= set(ctrd.blob_gets(since))
    out = run_in(ctrd, ctrd.plain, "plain-run", "cat", "/etc/msg", namespace="default")
    assert out.strip() == "plain unpack"
    unpacked = list((ctrd.node.root / "snapshots").glob("*/fs/etc/msg"))
    assert b"plain unpack\n" in [p.read_bytes() for p in unpacked]  # a plain directory


def test_an_image_on_imported_layers_unpacks_only_its_other_layer_over_them(ctrd):
    assert ctrd.mixed.layers[:2] == ctrd.lazy.layers  # the same blobs
    since = ctrd.log_offset()
    cri_pull(ctrd.containerd.address, ctrd.mixed.ref)
    gets = set(ctrd.blob_gets(since))
    assert gets == {ctrd.mixed.config, ctrd.mixed.layers[2]}, gets
    out = run_in(ctrd, ctrd.mixed, "mixed-run", "sh", "-c", "cat /etc/msg; sha256sum /data/big.bin")
    assert "mixed: unpacked over lazy layers" in out
    assert sha(ctrd.lazy.files["data/big.bin"]) in out


def code_of(call, *args) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args)
    return caught.value.code()


def test_snapshot_api_keys_parents_kinds_labels_and_errors(ctrd):
    s, pb = ctrd.stub(), snapshots_pb2
    mounts = s.Prepare(pb.PrepareSnapshotRequest(key="t/a", labels={"x": "1"})).mounts
    assert [(m.type, "rw" in m.options) for m in mounts] == [("bind", True)]
    assert {"nosuid", "nodev"} <= set(mounts[0].options)  # as every mount it hands out
    (Path(mounts[0].source) / "file").write_bytes(b"x" * 10000)
    assert code_of(s.Prepare, pb.PrepareSnapshotRequest(key="t/a")) == \
        grpc.StatusCode.ALREADY_EXISTS
    assert code_of(s.Prepare, pb.PrepareSnapshotRequest(key="t/b", parent="t/none")) == \
        grpc.StatusCode.NOT_FOUND
    assert code_of(s.Prepare, pb.PrepareSnapshotRequest(key="t/b", parent="t/a")) == \
        grpc.StatusCode.INVALID_ARGUMENT  # a parent must be committed
    for target in ("../../etc", "sha256:" + "0" * 64):  # no chain ID, a chain not imported
        label = {"containerd.io/snapshot.ref": target}
        made = s.Prepare(pb.PrepareSnapshotRequest(key="t/target", labels=label)).mounts
        assert made[0].type == "bind"  # an ordinary snapshot, for containerd to unpack into
        s.Remove(pb.RemoveSnapshotRequest(key="t/target"))
    s.Commit(pb.CommitSnapshotRequest(name="t/c", key="t/a", labels={"y": "2"}))
    assert code_of(s.Commit, pb.CommitSnapshotRequest(name="t/c2", key="t/a")) == \
        grpc.StatusCode.NOT_FOUND
    info = s.Stat(pb.StatSnapshotRequest(key="t/c")).info
    assert (info.kind, dict(info.labels)) == (pb.COMMITTED, {"y": "2"})
    usage = s.Usage(pb.UsageRequest(key="t/c"))
    assert usage.size >= 10000 and usage.inodes == 1
    assert code_of(s.Mounts, pb.MountsRequest(key="t/c")) == grpc.StatusCode.FAILED_PRECONDITION
    child = s.Prepare(pb.PrepareSnapshotRequest(key="t/child", parent="t/c")).mounts
    assert child[0].type == "overlay"
    options = list(child[0].options)
    assert {"nosuid", "nodev", "redirect_dir=nofollow", "metacopy=off"} <= set(options)
    assert any(o.startswith("lowerdir=") and o.endswith("/fs") for o in options)
    assert list(s.Mounts(pb.MountsRequest(key="t/child")).mounts) == list(child)
    view = s.View(pb.ViewSnapshotRequest(key="t/view", parent="t/c")).mounts
    assert [(m.type, "ro" in m.options) for m in view] == [("bind", True)]
    assert {"nosuid", "nodev"} <= set(view[0].options)
    assert code_of(s.Commit, pb.CommitSnapshotRequest(name="t/v2", key="t/view")) == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(s.Remove, pb.RemoveSnapshotRequest(key="t/c")) == \
        grpc.StatusCode.FAILED_PRECONDITION  # it has children
    updated = s.Update(pb.UpdateSnapshotRequest(
        info=pb.Info(name="t/c", labels={"z": "3"}, kind=pb.ACTIVE, parent="t/whatever"),
        update_mask={"paths": ["labels.z"]})).info
    assert (dict(updated.labels), updated.kind, updated.parent) == ({"y": "2", "z": "3"},
                                                                    pb.COMMITTED, "")
    assert code_of(s.Update, pb.UpdateSnapshotRequest(info=pb.Info(name="t/c"),
                                                      update_mask={"paths": ["parent"]})) == \
        grpc.StatusCode.INVALID_ARGUMENT
    names = {i.name: i.kind for i in backend_snapshots(ctrd) if i.name.startswith("t/")}
    assert names == {"t/c": pb.COMMITTED, "t/child": pb.ACTIVE, "t/view": pb.VIEW}
    filtered = [i.name for a in s.List(pb.ListSnapshotsRequest(filters=['labels."z"==3']))
                for i in a.info]
    assert filtered == ["t/c"]
    for key in ("t/child", "t/view", "t/c"):
        s.Remove(pb.RemoveSnapshotRequest(key=key))
    assert code_of(s.Stat, pb.StatSnapshotRequest(key="t/c")) == grpc.StatusCode.NOT_FOUND
    assert code_of(s.Remove, pb.RemoveSnapshotRequest(key="t/c")) == grpc.StatusCode.NOT_FOUND
    # Cleanup: directories no record names (a crash's) go, the others stay
    kept = s.Prepare(pb.PrepareSnapshotRequest(key="t/kept")).mounts[0].source
    orphan = ctrd.node.root / "snapshots" / "999999" / "fs"
    orphan.mkdir(parents=True)
    s.Cleanup(pb.CleanupRequest())
    assert not orphan.parent.exists() and Path(kept).is_dir()
    s.Remove(pb.RemoveSnapshotRequest(key="t/kept"))
    assert not Path(kept).exists()


def test_ctr_snapshots_prepare_ls_rm(ctrd):
    c = ("snapshots", "--snapshotter", SNAPSHOTTER)
    ctrd.ctr(*c, "prepare", "by-ctr", namespace="default")
    assert re.search(r"^by-ctr\s+Active", ctrd.ctr(*c, "ls", namespace="default").stdout,
                     re.M)
    backend = [i.name for i in backend_snapshots(ctrd)]
    assert any(n.startswith("default/") and n.endswith("/by-ctr") for n in backend), backend
    assert ctrd.ctr(*c, "prepare", "by-ctr", namespace="default",
                     check=False).returncode != 0
    ctrd.ctr(*c, "rm", "by-ctr", namespace="default")  # layerfs's goes at the next gc
    assert "by-ctr" not in ctrd.ctr(*c, "ls", namespace="default").stdout


def overlay_of(container_pid: int) -> str:
    """The mount options of a container's root (as its own mount table says)."""
    for line in Path(f"/proc/{container_pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == "/":
            return line
    raise AssertionError("no root mount")


def containerd_reconnects(ctrd: World, key: str, within: float = 30.0) -> bool:
    """Whether containerd's calls to the snapshotter (a Usage of ``key``) work
    again within ``within`` seconds of a daemon restart (calls made while its
    connection is down fail with UNAVAILABLE; gRPC reconnects with backoff)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if ctrd.ctr("snapshots", "--snapshotter", SNAPSHOTTER, "usage", key,
                    check=False).returncode == 0:
            return True
        time.sleep(0.2)
    return False


def test_daemon_restart_under_a_running_container(ctrd):
    cri_pull(ctrd.containerd.address, ctrd.lazy.ref)
    ctrd.ctr("run", "-d", "--snapshotter", SNAPSHOTTER, ctrd.lazy.ref, "lazy-long",
              "sleep", "600")
    try:
        pid = int(re.search(r"\d+", ctrd.ctr("task", "ls").stdout.split("lazy-long", 1)[1])[0])
        root = overlay_of(pid)
        assert " - overlay " in root and "nosuid" in root and "nodev" in root, root
        assert f"lowerdir={ctrd.node.root / 'layers'}" in root  # layerfs's layer mounts
        ctrd.node.kill()  # kill -9: the keeper holds the FUSE connection
        ctrd.node.start()
        out = ctrd.ctr("task", "exec", "--exec-id", "read", "lazy-long", "sha256sum",
                        "/data/later.bin").stdout
        assert sha(ctrd.lazy.files["data/later.bin"]) in out  # read after the restart
        # containerd's own connection comes back by itself: a call that reaches the daemon
        assert containerd_reconnects(ctrd, "lazy-long")
        # the service answers again: the container's snapshot is there, on its lazy parent
        infos = {i.name: i for i in backend_snapshots(ctrd)}
        mine = [i for n, i in infos.items() if n.endswith("/lazy-long")]
        assert len(mine) == 1 and infos[mine[0].parent].kind == snapshots_pb2.COMMITTED
    finally:
        ctrd.ctr("task", "kill", "-s", "SIGKILL", "lazy-long", check=False)
        for _ in range(50):
            if ctrd.ctr("task", "rm", "lazy-long", check=False).returncode == 0:
                break
            time.sleep(0.1)
        ctrd.ctr("container", "rm", "lazy-long", check=False)


TARGET = "containerd.io/snapshot.ref"


def lazy_chains(ctrd: World) -> tuple[str, str]:
    """The lazy image's two chain IDs (bottom, top), as its CRI pull labels them."""
    cri_pull(ctrd.containerd.address, ctrd.lazy.ref)
    lazy = [i for i in backend_snapshots(ctrd) if i.kind == snapshots_pb2.COMMITTED
            and i.labels.get(TARGET) and i.name.startswith(f"{K8S}/")]
    bottom = next(i for i in lazy if i.parent == "")
    top = next(i for i in lazy if i.parent == bottom.name)
    return bottom.labels[TARGET], top.labels[TARGET]


def drop_cri_images(ctrd: World) -> None:
    """Every image of CRI's namespace removed, and with them their snapshots."""
    names = ctrd.ctr("image", "ls", "-q").stdout.split()
    if names:
        ctrd.ctr("image", "rm", "--sync", *names)


def upper_of(ctrd: World, namespace: str, key: str) -> Path:
    """The writable directory of ``namespace``'s active snapshot ``key`` (layerfs's side)."""
    name = next(i.name for i in backend_snapshots(ctrd)
                if i.name.startswith(f"{namespace}/") and i.name.endswith(f"/{key}"))
    mount = ctrd.stub().Mounts(snapshots_pb2.MountsRequest(key=name)).mounts[0]
    if mount.type == "bind":
        return Path(mount.source)
    return Path(next(o for o in mount.options if o.startswith("upperdir=")).partition("=")[2])


def plant(ctrd: World, namespace: str, key: str, parent: str, chain: str) -> None:
    """A snapshot of ``namespace`` holding a file ``/planted``, committed as
    ``key`` on ``parent`` and labelled (containerd's Update) as chain ``chain``."""
    c = ("snapshots", "--snapshotter", SNAPSHOTTER)
    ctrd.ctr(*c, "prepare", f"{key}-active", *([parent] if parent else []), namespace=namespace)
    upper = upper_of(ctrd, namespace, f"{key}-active")
    (upper / "etc").mkdir(exist_ok=True)
    (upper / "etc" / "msg").write_bytes(b"planted\n")
    (upper / "planted").write_bytes(b"x")
    ctrd.ctr(*c, "commit", key, f"{key}-active", namespace=namespace)
    ctrd.ctr(*c, "label", key, f"{TARGET}={chain}", namespace=namespace)


def test_a_namespace_cannot_plant_a_tree_for_another_namespaces_lazy_chain(ctrd):
    """A snapshot counts as a chain's only if layerfs made it from the layers
    it verified: namespace ``a-planter`` commits trees labelled (by Update) as
    the lazy image's chains, and CRI's pull in ``k8s.io`` still gets layerfs's
    own snapshots, and so does containerd's filtered look-up."""
    bottom, top = lazy_chains(ctrd)
    drop_cri_images(ctrd)
    assert not [i for i in backend_snapshots(ctrd) if i.labels.get(TARGET) == bottom]
    ns, c = "a-planter", ("snapshots", "--snapshotter", SNAPSHOTTER)  # sorts before k8s.io
    plant(ctrd, ns, "evil", "", bottom)
    plant(ctrd, ns, "evil2", "evil", top)
    # through the API as well: a Commit's label
    s, pb = ctrd.stub(), snapshots_pb2
    s.Prepare(pb.PrepareSnapshotRequest(key="b-api/1/p"))
    s.Commit(pb.CommitSnapshotRequest(name="b-api/2/c", key="b-api/1/p",
                                      labels={TARGET: bottom}))
    # now: containerd's garbage collection may remove it later (its metadata
    # does not know a snapshot made through the snapshotter's socket)
    planted = s.Stat(pb.StatSnapshotRequest(key="b-api/2/c")).info
    assert planted.labels[TARGET] == bottom  # kept as a label, naming nothing
    try:
        cri_pull(ctrd.containerd.address, ctrd.lazy.ref)
        out = run_in(ctrd, ctrd.lazy, "unplanted", "sh", "-c",
                     "cat /etc/msg; test -e /planted && echo PLANTED || echo clean")
        assert out.split("\n")[:2] == ["hello from layerfs", "clean"], out
        asked = [i for a in s.List(pb.ListSnapshotsRequest(
            filters=[f'labels."{TARGET}"=={bottom},parent==""'])) for i in a.info]
        assert [i.name.split("/")[0] for i in asked] == [K8S], asked
        # another lazy Prepare of the chain is answered from layerfs's own snapshot
        with pytest.raises(grpc.RpcError) as lazy:
            s.Prepare(pb.PrepareSnapshotRequest(key="b-api/3/l", labels={TARGET: bottom}))
        assert lazy.value.code() == grpc.StatusCode.ALREADY_EXISTS
    finally:
        ctrd.ctr(*c, "rm", "evil2", namespace=ns, check=False)
        ctrd.ctr(*c, "rm", "evil", namespace=ns, check=False)
        with contextlib.suppress(grpc.RpcError):  # (gone already: containerd's collection)
            s.Remove(pb.RemoveSnapshotRequest(key="b-api/2/c"))


def test_labels_are_bounded_in_number_and_size(ctrd):
    s, pb = ctrd.stub(), snapshots_pb2
    many = {f"l{k}": "v" for k in range(65)}
    big = {f"l{k}": "v" * 4000 for k in range(5)}
    for labels in (many, big):
        assert code_of(s.Prepare, pb.PrepareSnapshotRequest(key="lb/x", labels=labels)) == \
            grpc.StatusCode.INVALID_ARGUMENT
    s.Prepare(pb.PrepareSnapshotRequest(key="lb/x", labels={"a": "1"}))
    try:
        assert code_of(s.Update, pb.UpdateSnapshotRequest(info=pb.Info(name="lb/x", labels=big),
                                                          update_mask={"paths": ["labels"]})) \
            == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(s.Stat(pb.StatSnapshotRequest(key="lb/x")).info.labels) == {"a": "1"}
    finally:
        s.Remove(pb.RemoveSnapshotRequest(key="lb/x"))


def test_a_request_that_is_not_utf8_is_invalid_argument_not_a_traceback(ctrd):
    channel = grpc.insecure_channel(f"unix:{ctrd.socket}")
    for method in ("Prepare", "Stat", "Remove"):
        call = channel.unary_unary(f"/containerd.services.snapshots.v1.Snapshots/{method}")
        # field 2 (each one's key) holding the bytes ff fe
        assert code_of(call, b"\x12\x02\xff\xfe") == grpc.StatusCode.INVALID_ARGUMENT
    ctrd.node.check_log()  # no traceback, no error line


def settled(ctrd: World) -> list[str]:
    """The backend's snapshots once containerd's garbage collection is done
    with them: its removal of the snapshots its metadata does not name runs
    after `rm --sync` returns, and would take this test's own (made on the
    snapshotter directly) if it ran into it. The same names for 1 s."""
    names, since = sorted(i.name for i in backend_snapshots(ctrd)), time.monotonic()
    deadline = since + 15
    while time.monotonic() - since < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
        now = sorted(i.name for i in backend_snapshots(ctrd))
        if now != names:
            names, since = now, time.monotonic()
    return names


def test_concurrent_lazy_prepares_of_one_chain_make_one_snapshot(ctrd):
    """64 lazy Prepares of one chain on one parent at once: each answered
    ALREADY_EXISTS, one snapshot made (the first Prepare's), the layers held once."""
    bottom, _ = lazy_chains(ctrd)
    settled(ctrd)
    s, pb = ctrd.stub(), snapshots_pb2
    s.Prepare(pb.PrepareSnapshotRequest(key="cc/base-active"))
    s.Commit(pb.CommitSnapshotRequest(name="cc/base", key="cc/base-active"))
    users = {d: x["users"] for d, x in ctrd.node.request("stats")["layers"].items()}

    def prepare(k: int) -> grpc.StatusCode:
        return code_of(s.Prepare, pb.PrepareSnapshotRequest(key=f"cc/{k}", parent="cc/base",
                                                            labels={TARGET: bottom}))
    with ThreadPoolExecutor(64) as pool:
        codes = list(pool.map(prepare, range(64)))
    try:
        assert set(codes) == {grpc.StatusCode.ALREADY_EXISTS}
        made = [i.name for i in backend_snapshots(ctrd) if i.parent == "cc/base"]
        assert len(made) == 1, made
        after = {d: x["users"] for d, x in ctrd.node.request("stats")["layers"].items()}
        assert sum(after.values()) == sum(users.values()) + 1  # one more hold, one layer
    finally:
        for name in [i.name for i in backend_snapshots(ctrd) if i.parent == "cc/base"]:
            s.Remove(pb.RemoveSnapshotRequest(key=name))
        s.Remove(pb.RemoveSnapshotRequest(key="cc/base"))


def test_ps_lists_containerd_snapshots(ctrd):
    lazy_chains(ctrd)
    out = ctrd.node.cli("ps").stdout
    assert "containerd snapshots:" in out, out
    assert re.search(r"^committed\s+lazy, 2 layerfs layer\(s\)\s+k8s\.io/", out, re.M), out
    assert re.search(r"^committed\s+lazy, 1 layerfs layer\(s\)\s+k8s\.io/", out, re.M), out


def test_garbage_collection_removes_the_snapshots_their_mounts_and_files(ctrd):
    cri_pull(ctrd.containerd.address, ctrd.lazy.ref)
    assert ctrd.node.request("stats")["layers"]
    names = ctrd.ctr("image", "ls", "-q").stdout.split()  # CRI's: by tag, digest and ID
    assert ctrd.lazy.ref in names
    ctrd.ctr("image", "rm", "--sync", *names)
    ctrd.ctr("image", "rm", "--sync", ctrd.plain.ref, namespace="default", check=False)
    deadline = time.monotonic() + 15  # the backend's removals run after rm --sync returns
    while (left := [i.name for i in backend_snapshots(ctrd)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], left
    assert ctrd.node.request("stats")["layers"] == {}  # the lazy layers unmounted
    assert list((ctrd.node.root / "snapshots").iterdir()) == []  # plain ones: removed


def refused_socket(tmp_path: Path, socket: Path) -> str:
    """The one error line of a daemon given ``--containerd-snapshotter socket`` (exit 2)."""
    return refused_daemon(tmp_path, tmp_path / "root", socket)


def test_a_socket_the_daemon_cannot_listen_at_is_one_error_line(tmp_path):
    need_root()
    (tmp_path / "a-file").write_text("")
    assert "cannot listen there" in refused_socket(tmp_path, tmp_path / "a-file" / "s.sock")


def test_a_socket_another_daemon_serves_is_left_to_it(ctrd, tmp_path):
    assert "another process serves it" in refused_socket(tmp_path, ctrd.socket)
    assert ctrd.socket.is_socket()
    backend_snapshots(ctrd)  # and it still answers


def test_a_local_user_cannot_reach_the_snapshotter(ctrd, local_user):
    """The socket is root's alone (0600): a user who can reach its directory
    is refused at connect (a hard link in an open directory: the same inode,
    its mode the only bar), while root's connect through that link works."""
    st = os.stat(ctrd.socket)
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600)
    place = Path(tempfile.mkdtemp(prefix="lfs-sock-"))
    try:
        place.chmod(0o755)
        link = place / "s.sock"
        os.link(ctrd.socket, link)
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(link))  # the link leads to the snapshotter
        tried = local_user.python(
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            "    s.connect(sys.argv[1])\n"
            "except PermissionError:\n"
            "    print('refused')\n", str(link))
        assert tried.stdout.decode().strip() == "refused", tried
    finally:
        shutil.rmtree(place)


def refused_daemon(tmp_path: Path, root: Path, socket: Path) -> str:
    """The one error line of a daemon on ``root`` serving ``socket`` (exit 2)."""
    (tmp_path / "store").mkdir(exist_ok=True)
    done = subprocess.run([*LAYERFS, "daemon", "--root", str(root), "--store",
                           f"file://{tmp_path / 'store'}", "--containerd-snapshotter",
                           str(socket)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "--containerd-snapshotter" in errors[0], done.stderr
    return errors[0]


def test_a_socket_in_a_directory_another_user_could_change_is_refused(local_user):
    """The user could rename the socket and bind their own, and containerd
    (root) would take its mounts from them: the daemon refuses such a place,
    as ``up --bundle`` refuses such a directory."""
    place = Path(tempfile.mkdtemp(prefix="containerd-sock-"))
    try:
        place.chmod(0o755)
        theirs = place / "theirs"
        theirs.mkdir()
        os.chown(theirs, local_user.uid, local_user.gid)
        assert local_user.run("touch", str(theirs / "mine")).returncode == 0  # theirs to change
        line = refused_daemon(place, place / "root", theirs / "s.sock")
        assert f"owned by uid {local_user.uid}" in line, line
        below = theirs / "root-owned"  # root's directory below theirs: they can rename it
        below.mkdir()
        assert f"owned by uid {local_user.uid}" in refused_daemon(place, place / "root",
                                                                  below / "s.sock")
        shared = place / "shared"
        shared.mkdir()
        shared.chmod(0o777)  # anyone may rename in it (not sticky)
        assert "writable by group or others" in refused_daemon(place, place / "root",
                                                               shared / "s.sock")
        assert not [p for p in place.rglob("*.sock")]
    finally:
        assert detach_mounts(place) == []  # (a daemon that started would have mounted)
        shutil.rmtree(place)


def test_a_root_the_overlay_options_cannot_carry_is_refused_at_start(tmp_path):
    need_root()
    for bad in ("a,b", "a:b"):
        line = refused_daemon(tmp_path, tmp_path / bad / "root", tmp_path / "s.sock")
        assert "overlay mount options cannot carry" in line, line


@pytest.mark.daemon_log(r"containerd snapshotter stopped with \d+ call")
def test_a_stop_under_a_flood_of_calls_is_clean(tmp_path):
    """SIGTERM while 16 clients Prepare (lazily, half of them: an imported
    chain) and Remove: exit 0, the calls answered, cancelled or refused with
    UNAVAILABLE, no error line or traceback in the log (the replica is closed
    only once no call uses it)."""
    need_root()
    layout = tiny_layers_image(tmp_path / "layout", "v1", [{"a": b"1"}, {"b": b"2"}])
    source = open_source(f"oci:{layout}:v1")
    try:
        chain = import_image(RefStore(FileStore(tmp_path / "store")), source,
                             ImportOptions("flood", "1")).chains[-1]
    finally:
        source.close()
    node = NodeDaemon(tmp_path / "node", ["--store", f"file://{tmp_path / 'store'}"])
    node.extra_args = ["--containerd-snapshotter", str(tmp_path / "s.sock")]
    node.start()
    stub = snapshots_pb2_grpc.SnapshotsStub(grpc.insecure_channel(f"unix:{tmp_path / 's.sock'}"))
    pb = snapshots_pb2
    stop = threading.Event()
    seen: set[grpc.StatusCode] = set()
    done = [0]

    def flood(k: int) -> None:
        labels = {TARGET: chain} if k % 2 else {}
        n = 0
        while not stop.is_set():
            try:
                try:
                    stub.Prepare(pb.PrepareSnapshotRequest(key=f"f/{k}/{n}", labels=labels),
                                 timeout=30)
                    stub.Remove(pb.RemoveSnapshotRequest(key=f"f/{k}/{n}"), timeout=30)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                        raise
                done[0] += 1
            except grpc.RpcError as exc:
                seen.add(exc.code())
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    return
            n += 1
    try:
        with ThreadPoolExecutor(16) as pool:
            for k in range(16):
                pool.submit(flood, k)
            while done[0] < 300:
                time.sleep(0.05)
            assert node.stop() == 0
            stop.set()
        # queued calls no thread ran yet are cancelled, later ones refused
        assert seen <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}, seen
    finally:
        stop.set()
        node.cleanup()


# -- the records and their indexes, without a daemon ---------------------------------

def records_store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(Replica(tmp_path / "replica"))


def test_the_indexes_follow_every_change_and_are_built_for_an_older_replica(tmp_path):
    store = records_store(tmp_path)
    chain = "sha256:" + "c" * 64
    store.create(SnapshotRecord("n/1/base-a", ACTIVE, 0))
    store.commit("n/1/base-a", "n/2/base", {}, 0, 0)
    for k in range(20):
        store.create(SnapshotRecord(f"n/3/{k}", ACTIVE, 0, "n/2/base"))
    lazy = SnapshotRecord("n/4/lazy", COMMITTED, 0, "n/2/base", {TARGET: chain},
                          layers=["sha256:" + "1" * 64], chain=chain)
    assert store.create(lazy) is lazy
    again = SnapshotRecord("n/5/lazy", COMMITTED, 0, "n/2/base", layers=lazy.layers, chain=chain)
    assert store.create(again).name == "n/4/lazy"  # the one there is, nothing added
    planted = SnapshotRecord("n/6/planted", COMMITTED, 0, "", {TARGET: chain})
    store.create(planted)  # a label, no chain: not found as one
    assert store.find_target(chain, "") is None
    assert store.find_target(chain, "n/2/base").name == "n/4/lazy"
    assert store.index_problems() == []
    with pytest.raises(SnapshotPrecondition):
        store.remove("n/2/base")
    for k in range(20):
        store.remove(f"n/3/{k}")
    store.remove("n/4/lazy")
    assert store.find_target(chain, "n/2/base") is None
    assert store.index_problems() == []
    store.remove("n/2/base")
    # a replica written before the indexes: its lazy records (layers, which layerfs alone
    # sets, and the Prepare's label) are found by chain, a labelled plain one is not
    old_lazy = {"name": "o/1/lazy", "kind": COMMITTED, "id": 90, "parent": "",
                "labels": {TARGET: chain}, "layers": lazy.layers}
    old_plain = {"name": "o/2/plain", "kind": COMMITTED, "id": 91, "parent": "o/1/lazy",
                 "labels": {TARGET: chain}}
    replica = store.replica
    with replica.env.begin(write=True) as txn:
        for doc in (old_lazy, old_plain):
            txn.put(doc["name"].encode(), json.dumps(doc).encode(), db=replica.dbs["snapshots"])
        txn.delete(b"snapshot-indexes", db=replica.dbs["counters"])
    store = SnapshotStore(replica)
    assert store.index_problems() == []
    assert store.find_target(chain, "").name == "o/1/lazy"
    assert store.find_target(chain, "o/1/lazy") is None
    with pytest.raises(SnapshotPrecondition):
        store.remove("o/1/lazy")  # its child, found through the rebuilt index


def test_labels_over_their_bounds_are_refused():
    check_labels({f"k{n}": "v" * 200 for n in range(MAX_LABELS)})
    with pytest.raises(SnapshotInvalid):
        check_labels({f"k{n}": "v" for n in range(MAX_LABELS + 1)})
    with pytest.raises(SnapshotInvalid):
        check_labels({f"k{n}": "v" * 4000 for n in range(5)})


def test_a_tree_deeper_than_overlayfs_stacks_is_refused(tmp_path):
    """Past 500 lower directories (the kernel's limit), or overlay options
    longer than containerd can pass to mount(2) even written relative, a
    Prepare or View is refused with INVALID_ARGUMENT and says why."""
    store = records_store(tmp_path)
    sn = Snapshotter(tmp_path, store, None, None, None, None)  # (records and paths only)
    parent = ""
    with store.replica.env.begin(write=True) as txn:  # 501 committed, one on the other
        for n in range(MAX_LOWERS + 1):
            record = SnapshotRecord(f"d/{n}", COMMITTED, n + 1, parent)
            txn.put(record.name.encode(), record.to_bytes(), db=store.db)
            parent = record.name
    assert len(sn.lowers(f"d/{MAX_LOWERS - 1}")) == MAX_LOWERS
    with pytest.raises(SnapshotInvalid, match="more than 500 directories deep"):
        sn.lowers(f"d/{MAX_LOWERS}")
    assert sn.mounts_of(SnapshotRecord("d/c", ACTIVE, 9999, f"d/{MAX_LOWERS - 1}"))[0].type \
        == "overlay"  # 500 directories ROOT/snapshots/N/fs: containerd writes them relative
    with pytest.raises(SnapshotInvalid, match="more than 500 directories deep"):
        sn.mounts_of(SnapshotRecord("d/c", ACTIVE, 9999, f"d/{MAX_LOWERS}"))
    # lazy layers' directories are longer (ROOT/layers/<64 hex>): 60 are too long a page
    for count in (50, 60):
        layers = [f"sha256:{n:064x}" for n in range(count)]
        store.create(SnapshotRecord(f"z/{count}", COMMITTED, 0, layers=layers,
                                    chain=f"sha256:{count:064x}"))
    assert sn.mounts_of(SnapshotRecord("z/c", ACTIVE, 9999, "z/50"))[0].type == "overlay"
    with pytest.raises(SnapshotInvalid, match="more than containerd passes to mount"):
        sn.mounts_of(SnapshotRecord("z/c", ACTIVE, 9999, "z/60"))


def test_a_closed_store_waits_for_the_calls_inside_and_lets_no_more_in(tmp_path):
    """The stop's guarantee: closing the gate waits for the calls inside (the
    replica is closed only after), and from then on no record is read or
    written (UNAVAILABLE), by a call still inside either."""
    store = records_store(tmp_path)
    inside, leave = threading.Event(), threading.Event()

    def call() -> str:
        with store.gate:
            store.create(SnapshotRecord("g/1", ACTIVE, 0))
            inside.set()
            leave.wait(10)
            try:
                store.get("g/1")
            except SnapshotsClosed as exc:
                return exc.code
            return "read"
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(call)
        inside.wait(10)
        assert store.gate.close(0.2) == 1  # still inside when the wait ended
        leave.set()
        assert running.result(10) == "UNAVAILABLE"
    assert store.gate.close(1) == 0
    with pytest.raises(SnapshotsClosed):
        store.get("g/1")
