"""Builder and publishing, on both store backends: dedup, immutability, push
order and what a failed push leaves."""

from __future__ import annotations

import random

import pytest
from support import ManifestPutFails, build
from support.gentree import write_tree

from layerfs.builder.env import create_env
from layerfs.errors import RefNotFound, StoreError, UsageError, VersionExists
from layerfs.formats.chunktable import FILE_START
from layerfs.gc import collect
from layerfs.refstore import ENVS, LAYERS, RefStore
from layerfs.store.base import BLOB_PREFIX


def blobs(store) -> set[str]:
    return {o.key for o in store.list(BLOB_PREFIX)}


def test_same_content_again_uploads_nothing(tmp_path, store):
    write_tree(tmp_path / "a", 1)
    first = build(store, str(tmp_path / "a"), chunk_size=16384)
    before = blobs(store)
    again = build(store, str(tmp_path / "a"), chunk_size=16384)
    assert again.published is False and again.digest == first.digest
    assert blobs(store) == before


def test_other_content_under_same_version_fails(tmp_path, store):
    write_tree(tmp_path / "a", 1)
    write_tree(tmp_path / "b", 2)
    first = build(store, str(tmp_path / "a"), chunk_size=16384)
    before = blobs(store)
    with pytest.raises(VersionExists):
        build(store, str(tmp_path / "b"), chunk_size=16384)
    assert blobs(store) == before
    assert RefStore(store).resolve(LAYERS, "t@1") == first.digest


def test_new_version_uploads_only_changed_chunks(tmp_path, store):
    src = tmp_path / "a"
    write_tree(src, 1, files=50)
    v1 = build(store, str(src), version="1", chunk_size=16384)
    with open(src / "f007", "r+b") as f:  # change one file of fifty
        f.write(b"changed!")
    v2 = build(store, str(src), version="2", chunk_size=16384)
    s1, s2 = v1.manifest.stats, v2.manifest.stats
    assert v2.manifest.dedup_sources == ["t@1"]
    assert s2.reused_chunks == s2.unique_chunks - 1
    assert s2.uploaded_bytes < 0.1 * s1.uploaded_bytes


def test_dedup_with_other_layer(tmp_path, store):
    write_tree(tmp_path / "a", 1)
    base = build(store, str(tmp_path / "a"), name="base", chunk_size=16384)
    write_tree(tmp_path / "b", 1)  # same bytes, other layer name
    other = build(store, str(tmp_path / "b"), name="other", chunk_size=16384,
                  dedup_with=["base@1"])
    assert other.manifest.stats.reused_chunks == other.manifest.stats.unique_chunks
    assert other.manifest.stats.uploaded_packs == 0
    assert base.manifest.stats.uploaded_packs > 0


def test_holes_are_not_stored(tmp_path, store):
    src = tmp_path / "s"
    src.mkdir()
    with open(src / "sparse", "wb") as f:
        f.truncate(64 * 16384)
        f.seek(5 * 16384)
        f.write(b"data")
    res = build(store, str(src), chunk_size=16384)
    assert res.manifest.stats.holes == 63
    assert res.manifest.stats.unique_chunks == 1


def test_each_file_flags_its_first_chunk_in_the_blob(tmp_path, store):
    """Files whose first chunk is a hole or repeats another file's bytes have
    their first chunk placed in the blob flagged instead: every file with a
    chunk of its own starts at a flagged entry."""
    c = 16384
    one, two, three = (random.Random(n).randbytes(c) for n in (1, 2, 3))
    src = tmp_path / "s"
    src.mkdir()
    (src / "a").write_bytes(one + two)  # two chunks of its own
    (src / "b").write_bytes(one + three)  # its first chunk is a's
    with open(src / "c", "wb") as f:  # a hole, then a chunk
        f.truncate(c)
        f.write(random.Random(4).randbytes(100))
    refstore = RefStore(store)
    table = refstore.chunk_table(refstore.layer(build(store, str(src), chunk_size=c).digest))
    flagged = [bool(e.flags & FILE_START) for e in table.entries]
    assert len(flagged) == 4 and flagged == [True, False, True, True]  # a, a, b's 2nd, c's 2nd


def test_failed_push_publishes_nothing_and_gc_sees_leftovers(tmp_path, store):
    write_tree(tmp_path / "keep", 3, files=5)
    kept = build(store, str(tmp_path / "keep"), name="keep", chunk_size=16384)
    write_tree(tmp_path / "a", 4)
    with pytest.raises(StoreError):
        build(ManifestPutFails(store), str(tmp_path / "a"), name="broken", chunk_size=16384)
    refstore = RefStore(store)
    with pytest.raises(RefNotFound):
        refstore.resolve(LAYERS, "broken@1")
    dry = collect(refstore, dry_run=True, grace=3600)
    assert len(dry.unreachable) >= 3  # packs, chunk table and meta image of the failed push
    assert all(u["young"] for u in dry.unreachable) and dry.deleted == 0
    done = collect(refstore, dry_run=False, grace=0)
    assert done.deleted == len(dry.unreachable)
    assert collect(refstore, dry_run=True).unreachable == []
    assert refstore.resolve(LAYERS, "keep@1") == kept.digest  # reachable data untouched
    from layerfs.verify import verify_layer
    assert verify_layer(refstore, kept.digest).ok


@pytest.mark.parametrize("kw,err", [
    ({"chunk_size": 3000}, UsageError),
    ({"chunk_size": 2048}, UsageError),
    ({"chunk_size": 32 << 20}, UsageError),
    ({"name": "Bad"}, Exception),
    ({"version": "a b"}, Exception),
    ({"role": "nope"}, UsageError),
])
def test_bad_options(tmp_path, store, kw, err):
    write_tree(tmp_path / "a", 1, files=2)
    with pytest.raises(err):
        build(store, str(tmp_path / "a"), **kw)
    assert blobs(store) == set()


def test_envs(tmp_path, store):
    for i, name in enumerate(["base", "tool", "ws"]):
        write_tree(tmp_path / name, i, files=3)
        build(store, str(tmp_path / name), name=name, chunk_size=16384)
    refstore = RefStore(store)
    env = create_env(refstore, "e", "1", ["ws@1", "tool@1", "base@1"])
    assert env.published and [x.ref for x in env.manifest.layers] == ["ws@1", "tool@1", "base@1"]
    assert create_env(refstore, "e", "1", ["ws@1", "tool@1", "base@1"]).published is False
    with pytest.raises(VersionExists):
        create_env(refstore, "e", "1", ["tool@1", "base@1"])
    with pytest.raises(RefNotFound):
        create_env(refstore, "e", "2", ["missing@1"])
    assert [str(r) for r in refstore.list_refs(ENVS)] == ["e@1"]
