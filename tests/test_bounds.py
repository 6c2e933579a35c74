"""What a writer stores every reader reads (:mod:`layerfs.bounds`): an image
config with long strings imports and comes up; one over a bound is refused
before anything is published; a fold of many layers records a bounded source;
a ref or manifest that cannot be read is named and skipped by the store-wide
commands, which go on and exit 6 (gc then deletes no blob); malformed diff_ids and an index of
thousands of platforms are one bounded error line."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest
from support import build, need_root
from support.nodes import NodeDaemon

from harness.daemonproc import LAYERFS
from harness.ociimages import ImageSettings, LayerChange, busybox_rootfs, make_image
from layerfs.bounds import MAX_CONFIG, MAX_ERROR_LINE, MAX_ITEMS, MAX_STRING
from layerfs.builder.env import create_env
from layerfs.builder.layer import BuildOptions, build_layer
from layerfs.builder.oci.fold import fold_source
from layerfs.errors import OverLimit
from layerfs.imageconfig import ImageConfig
from layerfs.refstore import ENVS, LAYERS, RefStore, ref_key

pytestmark = pytest.mark.end_to_end  # the CLI and outside tools, end to end

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
TAR_LAYER = "application/vnd.oci.image.layer.v1.tar"
REF = "org.opencontainers.image.ref.name"


def cli(store_args: list[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*LAYERFS, *args, *store_args], capture_output=True, text=True,
                          timeout=300)


def one_error_line(proc: subprocess.CompletedProcess, code: int) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1, (proc.returncode, proc.stderr[:2000])
    assert lines[0].startswith("layerfs: error: ") and len(lines[0]) <= MAX_ERROR_LINE
    return lines[0]


# --- a crafted OCI layout: tiny uncompressed layers, any config --------------------------


def put_blob(layout: Path, data: bytes) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest.removeprefix("sha256:")).write_bytes(data)
    return {"digest": digest, "size": len(data)}


def tiny_tar(name: str, content: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = len(content)
        tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def crafted_layout(layout: Path, layers: int, config: dict | None = None,
                   top_diff_id: str = "") -> str:
    """An OCI layout tagged ``t``: ``layers`` one-file tar layers and an image config
    (``config`` its ``config`` object; ``top_diff_id`` instead of the top layer's own)."""
    tars = [tiny_tar(f"f{i}", b"%d\n" % i) for i in range(layers)]
    descs = [{"mediaType": TAR_LAYER, **put_blob(layout, t)} for t in tars]
    diff_ids = [d["digest"] for d in descs]
    diff_ids[-1] = top_diff_id or diff_ids[-1]
    doc = {"architecture": "amd64", "os": "linux", "config": config or {},
           "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    image_config = {"mediaType": OCI_CONFIG, **put_blob(layout, json.dumps(doc).encode())}
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": image_config,
                "layers": descs}
    write_index(layout, {"mediaType": OCI_MANIFEST,
                         **put_blob(layout, json.dumps(manifest).encode())})
    return f"oci:{layout}:t"


def write_index(layout: Path, desc: dict) -> None:
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    index = {"schemaVersion": 2, "manifests": [{**desc, "annotations": {REF: "t"}}]}
    (layout / "index.json").write_text(json.dumps(index))


# --- long strings: stored, read back, run ------------------------------------------------


def test_config_strings_over_4096_characters_import_list_gc_and_come_up(tmp_path, store_args):
    need_root()
    layout = tmp_path / "L"
    long_value = "x" * 5000
    make_image(layout, "bb", [LayerChange(copy_tree=str(busybox_rootfs(tmp_path / "rootfs")))],
               ImageSettings(env=["PATH=/bin", f"LONG={long_value}"],
                             cmd=["/bin/sh", "-c", "echo ${#LONG} # " + "y" * 5000],
                             labels={"org.example.big": "z" * 5000}))
    proc = cli(store_args, "import", f"oci:{layout}:bb", "--name", "big", "--version", "1")
    assert proc.returncode == 0, proc.stderr
    listed = cli(store_args, "env", "ls", "--json")
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    assert [r["ref"] for r in json.loads(listed.stdout)] == ["big@1"]
    for args in (["ls", "--json"], ["gc", "--dry-run", "--json"], ["inspect", "big@1"]):
        proc = cli(store_args, *args)
        assert proc.returncode == 0 and proc.stderr == "", (args, proc.stderr)
    node = NodeDaemon(tmp_path / "node", store_args, cache_size="64M").start()
    try:
        node.cli("up", "big@1", "--id", "s1")
        assert node.cli("run", "s1").stdout.splitlines() == ["5000"]
        node.cli("down", "s1")
    finally:
        assert node.cleanup() == []


OVER = {
    "a Cmd string": ({"Cmd": ["/bin/sh", "-c", "y" * (MAX_STRING + 1)]}, "config.cmd[2]",
                     str(MAX_STRING)),
    "a label value": ({"Labels": {"big": "z" * (MAX_STRING + 1)}}, "config.labels['big']",
                      str(MAX_STRING)),
    "too many Env values": ({"Env": [f"V{i}=1" for i in range(MAX_ITEMS + 1)]}, "config.env",
                            str(MAX_ITEMS)),
    "the whole config": ({"Labels": {f"l{i}": "v" * 60_000 for i in range(MAX_CONFIG // 60_000
                                                                          + 1)}},
                         "field config", str(MAX_CONFIG)),
}


@pytest.mark.parametrize("case", list(OVER))
def test_config_over_a_bound_is_refused_at_import_and_nothing_is_published(case, tmp_path):
    config, field, limit = OVER[case]
    (tmp_path / "store").mkdir()  # an empty store: a missing one is unreachable to readers
    store_args = ["--store", f"file://{tmp_path / 'store'}"]  # (refused before the store)
    src = crafted_layout(tmp_path / "L", 2, config)
    line = one_error_line(cli(store_args, "import", src, "--name", "over", "--version", "1"), 3)
    assert field in line and limit in line, line
    for args in (["env", "ls", "--json"], ["ls", "--json"]):
        listed = cli(store_args, *args)
        assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr
    gc = json.loads(cli(store_args, "gc", "--dry-run", "--json").stdout)
    assert (gc["reachable"], gc["unreachable"]) == (0, [])  # not even a blob was written


# --- fold: many layers, one bounded source -----------------------------------------------


def test_fold_of_61_layers_imports_with_a_bounded_source(tmp_path, store, store_args):
    src = crafted_layout(tmp_path / "L", 61)
    proc = cli(store_args, "import", src, "--name", "folded", "--version", "1", "--fold", "1G",
               "--json")
    assert proc.returncode == 0, proc.stderr
    (layer,) = json.loads(proc.stdout)["layers"]
    assert len(layer["diff_ids"]) == 61
    manifest = RefStore(store).layer(layer["digest"])
    assert manifest.source == "oci:" + ",".join(layer["diff_ids"])
    assert len(manifest.source) <= MAX_STRING
    for args in (["ls"], ["env", "ls"], ["gc", "--dry-run"]):
        proc = cli(store_args, *args)
        assert proc.returncode == 0 and proc.stderr == "", (args, proc.stderr)


def test_fold_source_of_a_list_longer_than_a_string_is_summed_up():
    diff_ids = ["sha256:" + hashlib.sha256(b"%d" % i).hexdigest() for i in range(2000)]
    source = fold_source(diff_ids, "ab" * 32)
    assert len(source) <= MAX_STRING
    assert source.startswith(f"oci:{diff_ids[0]},...,{diff_ids[-1]} (2000 layers")
    assert fold_source(diff_ids[:3], "cd" * 32) == "oci:" + ",".join(diff_ids[:3])


def test_a_layer_whose_manifest_is_over_a_bound_is_refused_before_its_ref(tmp_path, store):
    refstore = RefStore(store)
    with pytest.raises(OverLimit, match=r"field source is over the limit: a string of 65537"):
        build_layer(refstore, small_tree(tmp_path), BuildOptions("long", "1"),
                    origin="o" * (MAX_STRING + 1))
    assert refstore.list_refs(LAYERS) == []
    with pytest.raises(OverLimit, match=r"env e@1: field config.labels\['k'\]"):
        create_env(refstore, "e", "1", [build(store, small_tree(tmp_path)).ref],
                   config=ImageConfig(labels={"k": "v" * (MAX_STRING + 1)}))
    assert refstore.list_refs(ENVS) == []


# --- a bad object in the store: named, skipped; gc deletes no blob ----------------------


def small_tree(tmp_path: Path) -> str:
    (tmp_path / "tree" / "etc").mkdir(parents=True, exist_ok=True)
    (tmp_path / "tree" / "etc" / "hello").write_text("hello\n")
    return str(tmp_path / "tree")


def craft_bad_objects(store, tmp_path: Path) -> list[str]:
    """Two good envs; an env ref whose manifest does not parse, a layer ref that is
    not a digest, an env naming a layer manifest that is missing. The names to see."""
    refstore = RefStore(store)
    good = build(store, small_tree(tmp_path), name="good", version="1")
    create_env(refstore, "e", "1", ["good@1"])
    bad_env = json.dumps({"schema": 1, "kind": "env", "name": "bad", "version": "1",
                          "layers": [], "created": ""}).encode()
    digest, _ = store.put_blob(bad_env)
    store.put(ref_key(ENVS, "bad", "1"), digest.encode() + b"\n")
    store.put(ref_key(LAYERS, "junk", "1"), b"sha256:../../../../etc/passwd\n")
    orphan = json.dumps({"schema": 1, "kind": "env", "name": "orphan", "version": "1",
                         "created": "", "layers": [{"ref": "good@1",
                                                    "digest": "sha256:" + "0" * 64}]})
    digest, _ = store.put_blob(orphan.encode())
    store.put(ref_key(ENVS, "orphan", "1"), digest.encode() + b"\n")
    assert good.published
    return ["bad@1", "junk", "orphan@1"]


def skipped(proc: subprocess.CompletedProcess) -> list[str]:
    """The error lines naming what a store-wide command skipped (all it printed on
    stderr), after it went on to the end: exit 6."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 6, proc.stderr
    assert all(line.startswith("layerfs: error: skipped ") for line in lines), lines
    assert all(len(line) <= MAX_ERROR_LINE for line in lines)
    return lines


def test_unreadable_refs_and_manifests_are_named_and_skipped(tmp_path, store, store_args):
    craft_bad_objects(store, tmp_path)
    envs = cli(store_args, "env", "ls", "--json")
    assert [r["ref"] for r in json.loads(envs.stdout)] == ["e@1"]
    named = skipped(envs)
    assert len(named) == 2 and "env bad@1" in named[0] and "field layers: empty" in named[0]
    assert "env orphan@1" in named[1] and "0" * 64 in named[1], named
    layers = cli(store_args, "ls", "--json")
    assert [r["ref"] for r in json.loads(layers.stdout)] == ["good@1"]
    (junk,) = skipped(layers)
    assert "layer ref junk/1" in junk and "ref file is not a digest" in junk


def test_gc_with_an_unreadable_object_deletes_no_blob_until_it_is_removed(tmp_path, store,
                                                                          store_args):
    craft_bad_objects(store, tmp_path)
    unreachable, _ = store.put_blob(b"nothing references this")
    for args in (["gc", "--dry-run", "--grace", "0", "--json"], ["gc", "--grace", "0", "--json"]):
        proc = cli(store_args, *args)
        assert len(skipped(proc)) == 3, proc.stderr
        report = json.loads(proc.stdout)
        assert not report["swept"] and report["deleted"] == 0
        assert unreachable in [u["digest"] for u in report["unreachable"]]
        assert store.exists("blobs/sha256/" + unreachable.removeprefix("sha256:"))
    for kind, name in ((ENVS, "bad"), (LAYERS, "junk"), (ENVS, "orphan")):
        store.delete(ref_key(kind, name, "1"))
    proc = cli(store_args, "gc", "--grace", "0", "--json")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert json.loads(proc.stdout)["swept"]
    assert not store.exists("blobs/sha256/" + unreachable.removeprefix("sha256:"))
    assert cli(store_args, "env", "ls").stdout.split()[0] == "e@1"


def test_gc_text_says_why_it_deleted_nothing(tmp_path, store, store_args):
    craft_bad_objects(store, tmp_path)
    proc = cli(store_args, "gc", "--grace", "0")
    assert len(skipped(proc)) == 3
    assert proc.stdout.strip().splitlines()[-1].endswith(
        "deleted 0 (3 refs or manifests unreadable: no blob is deleted until each is "
        "repaired or its ref removed)")


# --- junk digests and long error lines -------------------------------------------------


JUNK = {
    "a path": "sha256:../../../../" + "a" * 52,
    "upper case": "sha256:" + "A" * 64,
    "another algorithm": "sha512:" + "a" * 64,
    "not hex": "sha256:" + "g" * 64,
    "a newline": "sha256:" + "a" * 63 + "\n",
    "too short": "sha256:abc",
}


@pytest.mark.parametrize("case", list(JUNK))
def test_malformed_diff_id_is_one_error_line(case, tmp_path):
    junk = JUNK[case]
    src = crafted_layout(tmp_path / "L", 2, top_diff_id=junk)
    store = ["--store", f"file://{tmp_path / 'store'}"]
    line = one_error_line(cli(store, "import", src, "--name", "j", "--version", "1"), 3)
    assert "malformed diff_id" in line
    assert not (tmp_path / "store" / "refs").exists()


def test_index_of_3000_platforms_none_matching_is_one_bounded_line(tmp_path):
    layout = tmp_path / "L"
    entries = [{"mediaType": OCI_MANIFEST, "digest": "sha256:" + f"{i:064x}", "size": 100,
                "platform": {"os": "linux", "architecture": f"arch{i}" + "q" * 60}}
               for i in range(3000)]
    index = put_blob(layout, json.dumps({"schemaVersion": 2, "manifests": entries}).encode())
    write_index(layout, {"mediaType": OCI_INDEX, **index})
    store = ["--store", f"file://{tmp_path / 'store'}"]
    proc = cli(store, "import", f"oci:{layout}:t", "--name", "p", "--version", "1",
               "--platform", "linux/amd64")
    line = one_error_line(proc, 3)
    assert "no image for platform linux/amd64" in line and "3000:" in line
    assert "and 2995 more" in line


def test_an_error_message_longer_than_a_line_is_cut_with_a_marker(tmp_path):
    store = ["--store", f"file://{tmp_path / 'store'}"]
    proc = cli(store, "import", "oci:/nonexistent:t", "--name", "p", "--version", "1",
               "--platform", "x" * 5000)
    line = one_error_line(proc, 2)
    assert line.startswith("layerfs: error: invalid platform 'xxx")
    assert line.endswith("more characters]") and len(line) == MAX_ERROR_LINE


@pytest.mark.parametrize("size", ["1e999", "inf", "x" * 5000])
def test_a_size_no_number_holds_is_a_usage_error_of_bounded_lines(size, tmp_path):
    store = ["--store", f"file://{tmp_path / 'store'}"]
    proc = cli(store, "import", "oci:/nonexistent:t", "--name", "p", "--version", "1",
               "--fold", size)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[:2000]
    lines = proc.stderr.strip().splitlines()
    assert "not a size" in lines[-1] and len(lines[-1]) <= MAX_ERROR_LINE + 32, lines[-1][:200]
