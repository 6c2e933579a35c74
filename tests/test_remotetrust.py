"""What a node and the CLI trust in a store: a ref must name the manifest it
points at, an env's layers must be the layers it names, ref files and manifests
are parsed strictly (one line for garbage, never a traceback), and a meta image
must pass the structural check before anything mounts it."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import zstandard
from support.cli import layerfs, one_line_error
from support.metaimages import layout_of, reseal
from support.remotelayers import node, small_tree, two_layers  # noqa: F401  (fixtures)

from layerfs.builder.env import create_env
from layerfs.errors import (
    BadMetaImage,
    IntegrityError,
    ObjectNotFound,
    RefMismatch,
)
from layerfs.manifest import (
    EnvLayer,
    EnvManifest,
    MetaRef,
)
from layerfs.node.reads.accesstraces import trace_bytes, trace_key
from layerfs.node.replica.metacheck import MetaChecker
from layerfs.refstore import ENVS, LAYERS, RefStore, ref_key
from layerfs.store.base import Store, blob_key, sha256_digest

pytestmark = pytest.mark.end_to_end  # the CLI and outside tools, end to end


def point_ref(store: Store, kind: str, ref: str, data: bytes) -> None:
    name, _, version = ref.rpartition("@")
    store.put(ref_key(kind, name, version), data)


def publish_manifest(store: Store, kind: str, ref: str, manifest_bytes: bytes) -> str:
    digest, _ = store.put_blob(manifest_bytes)
    point_ref(store, kind, ref, digest.encode() + b"\n")
    return digest


# -- finding 5a: a ref must name its manifest --

def test_ref_rewritten_to_another_layers_manifest_is_refused(store, store_args, two_layers):
    _, b = two_layers
    point_ref(store, LAYERS, "a@1", b.encode() + b"\n")  # a@1 now serves b's tree
    for args in (["verify", "a@1"], ["inspect", "a@1"], ["ls"]):
        line = one_line_error(layerfs(*args, *store_args, check=False), code=6)
        assert "a@1" in line and "b@1" in line, line
    with pytest.raises(RefMismatch):
        RefStore(store).resolve(LAYERS, "a@1")
    assert layerfs("verify", "b@1", *store_args).returncode == 0  # b itself is fine
    # e@1 pinned a's manifest by digest when it was made: it still names a@1's tree
    assert layerfs("verify", "e@1", *store_args).stdout.startswith("a@1: ")


def test_env_ref_rewritten_or_env_naming_other_layers_is_refused(store, store_args,
                                                                 two_layers):
    a, b = two_layers
    refstore = RefStore(store)
    create_env(refstore, "f", "1", ["b@1"])
    e_digest = refstore.read_ref(ENVS, "e", "1").encode()
    point_ref(store, ENVS, "e@1", refstore.read_ref(ENVS, "f", "1").encode())
    for args in (["verify", "e@1"], ["env", "ls"]):
        line = one_line_error(layerfs(*args, *store_args, check=False), code=6)
        assert "e@1" in line and "f@1" in line, line
    point_ref(store, ENVS, "e@1", e_digest)
    # an env manifest that says "a@1" but pins b's manifest
    lying = EnvManifest("g", "1", [EnvLayer("a@1", b)], created="now")
    publish_manifest(store, ENVS, "g@1", lying.to_bytes())
    for args in (["verify", "g@1"], ["inspect", "g@1"], ["env", "ls"]):
        line = one_line_error(layerfs(*args, *store_args, check=False), code=6)
        assert "a@1" in line and "b@1" in line, line
    pinned = EnvManifest("h", "1", [EnvLayer(a, b)], created="now")  # by digest, other digest
    publish_manifest(store, ENVS, "h@1", pinned.to_bytes())
    with pytest.raises(RefMismatch):
        refstore.env(refstore.resolve(ENVS, "h@1"))


class GatedManifests:
    """The store, whose GETs of the given blobs each wait until all of them are
    asked for (so a caller that reads them one after another fails)."""

    def __init__(self, store: Store, digests: set[str]) -> None:
        self.store = store
        self.digests = digests
        self.gate = threading.Barrier(len(digests), timeout=10)

    def get_blob(self, digest: str) -> bytes:
        if digest in self.digests:
            self.gate.wait()
        return self.store.get_blob(digest)

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


def test_an_envs_layer_manifests_are_fetched_at_once(store, two_layers):
    """Resolving an env reads its layers' manifests in parallel: one store round
    trip for all of them; each is still checked against its ref."""
    a, b = two_layers
    create_env(RefStore(store), "both", "1", ["a@1", "b@1"])
    refstore = RefStore(store)
    digest = refstore.resolve(ENVS, "both@1")
    gated = RefStore(GatedManifests(store, {a, b}))  # type: ignore[arg-type]
    assert [layer.digest for layer in gated.env(digest).layers] == [a, b]


def test_a_missing_layer_manifest_of_an_env_is_read_once_and_one_error(store, two_layers):
    a, b = two_layers
    create_env(RefStore(store), "both", "1", ["a@1", "b@1"])
    digest = RefStore(store).resolve(ENVS, "both@1")
    store.delete(blob_key(b))
    reads: list[str] = []

    class Counting(GatedManifests):
        def get_blob(self, digest: str) -> bytes:
            reads.append(digest)
            return self.store.get_blob(digest)

    with pytest.raises(ObjectNotFound):
        RefStore(Counting(store, {a, b})).env(digest)  # type: ignore[arg-type]
    assert reads.count(b) == 1 and reads.count(a) == 1


# -- finding 11: garbage ref files and manifests are one line --

GARBAGE_REFS = [b"\xff\xfe\x00garbage\n", b"not a digest\n", b"sha256:" + b"0" * 63 + b"\n",
                b"", b"sha256:" + b"a" * 64 + b"\nsecond line\n", b"x" * 5000]


@pytest.mark.parametrize("data", GARBAGE_REFS, ids=range(len(GARBAGE_REFS)))
def test_garbage_ref_file_is_one_line(tmp_path, data):
    store_args = ["--store", "file://" + str(tmp_path / "store")]
    layerfs("build", small_tree(tmp_path / "src", "x"), "--name", "x", "--version", "1",
            *store_args)
    ref_file = tmp_path / "store" / "refs" / "layers" / "x" / "1"
    ref_file.write_bytes(data)
    for args in (["ls"], ["verify", "x@1"], ["inspect", "x@1"], ["gc", "--dry-run"]):
        line = one_line_error(layerfs(*args, *store_args, check=False), code=6)
        assert "x@1" in line or "x/1" in line, line


def _layer_doc(store: Store, digest: str) -> dict:
    return json.loads(store.get_blob(digest))


def test_mutated_manifests_through_the_cli_are_one_line(tmp_path):
    store_args = ["--store", "file://" + str(tmp_path / "store")]
    layerfs("build", small_tree(tmp_path / "src", "m"), "--name", "m", "--version", "1",
            *store_args)
    from layerfs.store import open_store

    store = open_store(store_args[1])
    refstore = RefStore(store)
    good = json.loads(store.get_blob(refstore.read_ref(LAYERS, "m", "1")))
    mutants = [{"chunk_size": "65536"}, {"meta": [good["meta"]]},
               {"stats": {**good["stats"], "files": -1}}, {"role": 7},
               {"meta": {**good["meta"], "raw_size": 2.5}}, {"blob_size": None},
               {"chunk_table": {"digest": 5, "size": 1}}, {"extra": {"x": 1}},
               {"dedup_sources": "m@0"}, {"created": ["now"]}]
    for i, change in enumerate(mutants):
        version = str(i + 2)
        doc = {**good, "version": version, **change}
        publish_manifest(store, LAYERS, f"m@{version}", json.dumps(doc).encode())
        for args in (["inspect", f"m@{version}"], ["verify", f"m@{version}"], ["ls"]):
            proc = layerfs(*args, *store_args, check=False)
            one_line_error(proc, code=6)
            assert "Traceback" not in proc.stderr
        store.delete(ref_key(LAYERS, "m", version))  # ls must see the next one alone
    store.close()


# -- finding 5b through the registry and verify: a bad meta image is refused --

def republish_with_meta(store: Store, digest: str, image: bytes, ref: str) -> str:
    """A copy of layer ``digest`` as ``ref`` whose meta image is ``image`` (digests right)."""
    refstore = RefStore(store)
    manifest = refstore.layer(digest)
    stored = zstandard.ZstdCompressor().compress(image)
    meta_digest, _ = store.put_blob(stored)
    name, _, version = ref.rpartition("@")
    bad = replace(manifest, name=name, version=version,
                  meta=MetaRef(meta_digest, len(stored), sha256_digest(image), len(image)))
    return publish_manifest(store, LAYERS, ref, bad.to_bytes())


def chunk_past_blob(store: Store, digest: str) -> bytes:
    """The layer's meta image with its first chunk index pointing past the blob."""
    refstore = RefStore(store)
    manifest = refstore.layer(digest)
    image = bytearray(refstore.meta_image(manifest))
    at = layout_of(bytes(image), manifest.blob_size, manifest.chunk_size).chunk_indexes[0]
    image[at + 4 : at + 8] = (1 << 20).to_bytes(4, "little")
    return reseal(image)


def test_verify_refuses_a_meta_image_with_a_chunk_outside_the_blob(store, store_args,
                                                                   two_layers):
    a, _ = two_layers
    republish_with_meta(store, a, chunk_past_blob(store, a), "bad@1")
    proc = layerfs("verify", "bad@1", *store_args, check=False)
    assert proc.returncode == 6 and "outside the blob" in proc.stdout, proc.stdout
    assert proc.stderr.strip().splitlines() == ["layerfs: error: verify bad@1: 1 bad objects "
                                                "(1 corrupt)"], proc.stderr


# -- the daemon --

def _mounts() -> str:
    return Path("/proc/self/mountinfo").read_text()


def test_daemon_up_refuses_bad_refs_and_bad_meta_images(node, store, two_layers):
    a, b = two_layers
    bad = republish_with_meta(store, a, chunk_past_blob(store, a), "bad@1")
    # a pushed trace: the replay starts once the (sound) chunk table is in, and the
    # up that then fails on the meta image stops it
    chunks = len(RefStore(store).chunk_table(RefStore(store).layer(bad)).entries)
    store.put(trace_key(bad), trace_bytes(list(range(chunks))))
    create_env(RefStore(store), "badenv", "1", ["bad@1"])
    point_ref(store, LAYERS, "c@1", b.encode() + b"\n")  # c@1 points at b's manifest
    point_ref(store, LAYERS, "g@1", b"\xff\xfe garbage")
    cases = [(["--layer", "c@1"], "b@1"), (["--layer", "g@1"], "not ASCII"),
             (["badenv@1"], "outside the blob"), (["--layer", "bad@1"], "outside the blob")]
    for i, (args, words) in enumerate(cases):
        proc = node.cli("up", *args, "--id", f"s{i}", check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 6 and len(lines) == 1 and words in lines[0], proc.stderr
        assert "internal error" not in proc.stderr
    bad_hex = RefStore(store).read_ref(LAYERS, "bad", "1").removeprefix("sha256:")
    assert bad_hex not in _mounts()  # never mounted
    assert not (node.root / "meta" / f"{bad_hex}.erofs").exists()
    rootfs = Path(node.cli("up", "e@1", "--id", "ok").stdout.strip())
    assert (rootfs / "etc" / "who").read_text() == "a"
    node.cli("down", "ok")


def test_the_daemons_checker_gives_the_same_image_and_verdicts(store, two_layers):
    """RefStore.meta_image through the checker processes (the stored bytes sent,
    decompressed and checked there while this side hashes its own copy): the
    same image as in-process, the same refusal, and a digest that does not
    match is said before the structure."""
    a, _ = two_layers
    refstore = RefStore(store)
    checker = MetaChecker()
    try:
        layer_a = refstore.layer(a)
        assert refstore.meta_image(layer_a, checker.check) == refstore.meta_image(layer_a)
        bad = refstore.layer(republish_with_meta(store, a, chunk_past_blob(store, a), "bad@1"))
        with pytest.raises(BadMetaImage, match="outside the blob"):
            refstore.meta_image(bad, checker.check)
        lying = replace(bad, meta=replace(bad.meta, raw_digest=sha256_digest(b"other")))
        with pytest.raises(IntegrityError, match="does not match its digest") as info:
            refstore.meta_image(lying, checker.check)
        assert not isinstance(info.value, BadMetaImage)
    finally:
        checker.close()
