"""Retention: ``rm`` of layer and env refs, expiring refs, and what ``gc`` frees,
on both store backends."""

from __future__ import annotations

import json
import time

from support.cli import layerfs, one_line_error
from support.gentree import write_tree

from layerfs.refstore import LAYERS, RefStore
from layerfs.retention import expires_at, read_expiries, set_expiry
from layerfs.store.base import BLOB_PREFIX, Store


def blob_bytes(store: Store) -> int:
    return sum(info.size for info in store.list(BLOB_PREFIX))


def build(tmp_path, store_args, name: str, seed: int) -> dict:
    write_tree(tmp_path / name, seed, files=4)
    return json.loads(layerfs("build", str(tmp_path / name), "--name", name, "--version", "1",
                              "--chunk-size", "16K", "--json", *store_args).stdout)


def test_rm_of_a_layer_an_env_names_is_refused_and_rm_gc_frees_its_bytes(
        tmp_path, store, store_args):
    build(tmp_path, store_args, "base", 1)
    build(tmp_path, store_args, "gone", 2)
    layerfs("env", "create", "e@1", "--layer", "gone@1", "--layer", "base@1", *store_args)
    layerfs("env", "create", "e@2", "--layer", "gone@1", *store_args)
    err = one_line_error(layerfs("rm", "gone@1", *store_args, check=False), 15)
    assert "layer gone@1 is in use by env e@1, env e@2" in err
    assert "gone@1" in layerfs("ls", *store_args).stdout  # nothing removed
    # the envs named in the same command go first: then the layer is no longer in use
    one_line_error(layerfs("rm", "gone@1", "e@2", *store_args, check=False), 15)
    assert [e["ref"] for e in json.loads(layerfs("env", "ls", "--json", *store_args).stdout)
            ] == ["e@1", "e@2"]
    assert "removed env e@1" in layerfs("rm", "e@1", *store_args).stdout
    out = json.loads(layerfs("rm", "gone@1", "--force", "--json", *store_args).stdout)
    assert [(r["kind"], r["ref"], r["removed"]) for r in out] == [("layer", "gone@1", True)]
    # e@2 still names gone@1's manifest: its blobs stay reachable; e@1's manifest goes
    kept = json.loads(layerfs("gc", "--grace", "0", "--json", *store_args).stdout)
    assert kept["freed"]["objects"] == 1 and kept["unreachable"][0]["size"] < 1000
    before = blob_bytes(store)
    layerfs("rm", "e@2", *store_args)
    gc = json.loads(layerfs("gc", "--grace", "0", "--json", *store_args).stdout)
    after = blob_bytes(store)
    assert after < before and gc["freed"]["bytes"] == before - after
    assert gc["freed"]["objects"] == gc["deleted"] >= 4  # manifest, meta, table, packs
    assert "gone@1" not in layerfs("ls", *store_args).stdout
    assert "base@1" in layerfs("ls", *store_args).stdout
    assert "ok" in layerfs("verify", "base@1", *store_args).stdout
    assert one_line_error(layerfs("rm", "gone@1", *store_args, check=False), 5)
    text = layerfs("gc", "--grace", "0", *store_args).stdout
    assert "freed 0 objects, 0 B (0 bytes)\n4 reachable" in text


def test_rm_leaves_a_ref_published_again_meanwhile(tmp_path, store, store_args):
    from layerfs.retention import remove_ref
    build(tmp_path, store_args, "a", 1)
    refstore = RefStore(store)
    assert not remove_ref(refstore, LAYERS, "a", "1", "sha256:" + "0" * 64)  # another digest
    assert refstore.read_ref(LAYERS, "a", "1") is not None


def test_an_expired_ref_is_removed_by_gc_and_freed_a_never_expiring_one_kept(
        tmp_path, store, store_args):
    short = build(tmp_path, store_args, "short", 3)
    build(tmp_path, store_args, "long", 4)
    named = build(tmp_path, store_args, "named", 5)
    refstore = RefStore(store)
    set_expiry(refstore, LAYERS, "short", "1", short["digest"], expires_at(1))
    set_expiry(refstore, LAYERS, "named", "1", named["digest"], expires_at(1))
    layerfs("env", "create", "keep@1", "--layer", "named@1", *store_args)
    time.sleep(1.2)
    before = blob_bytes(store)
    dry = json.loads(layerfs("gc", "--dry-run", "--grace", "0", "--json", *store_args).stdout)
    assert dry["expired"] == ["layer short@1"] and dry["unreachable"]
    assert "short@1" in layerfs("ls", *store_args).stdout  # a dry run removes nothing
    text = layerfs("gc", "--grace", "0", *store_args).stdout
    assert "removed expired layer short@1" in text
    assert "kept expired layer named@1 (by env keep@1)" in text
    assert f"({before - blob_bytes(store)} bytes)" in text and blob_bytes(store) < before
    refs = [r["ref"] for r in json.loads(layerfs("ls", "--json", *store_args).stdout)]
    assert refs == ["long@1", "named@1"]
    assert "ok" in layerfs("verify", "long@1", *store_args).stdout


def test_a_stale_expiry_never_removes_a_later_publication(tmp_path, store, store_args):
    first = build(tmp_path, store_args, "v", 6)
    refstore = RefStore(store)
    set_expiry(refstore, LAYERS, "v", "1", first["digest"], expires_at(0.1))
    layerfs("rm", "v@1", *store_args)
    set_expiry(refstore, LAYERS, "v", "1", first["digest"], expires_at(0.1))  # left behind
    write_tree(tmp_path / "v", 7, files=2)
    layerfs("build", str(tmp_path / "v"), "--name", "v", "--version", "1", *store_args)
    time.sleep(0.3)
    gc = json.loads(layerfs("gc", "--grace", "0", "--json", *store_args).stdout)
    assert gc["expired"] == [] and gc["stale_expiries"] == 1
    assert "v@1" in layerfs("ls", *store_args).stdout


def test_an_expiry_record_that_names_no_time_or_no_digest_is_set_aside(tmp_path):
    """NaN and infinite times, a non-digest and an oversized record are
    unreadable expiries (left alone), never a ref removed at once."""
    from layerfs.store.file import FileStore

    store = FileStore(tmp_path / "store")
    refstore = RefStore(store)
    digest = "sha256:" + "ab" * 32
    records = {
        "nan": b'{"digest": "%s", "expires": NaN}' % digest.encode(),
        "minf": b'{"digest": "%s", "expires": -Infinity}' % digest.encode(),
        "name": b'{"digest": "x@1", "expires": 1.0}',
        "big": b'{"digest": "%s", "expires": 1.0, "pad": "%s"}' % (digest.encode(), b"x" * 4096),
    }
    for name, data in records.items():
        store.put(f"expiry/layers/{name}/1", data)
    found, bad = read_expiries(refstore, LAYERS)
    assert found == [] and sorted(bad) == sorted(f"expiry/layers/{n}/1" for n in records)

