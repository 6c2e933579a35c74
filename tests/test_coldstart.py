"""The first ``up`` of never-seen layers: the store requests it costs, and the
access traces that ``up`` replays by default (merged over several runs)."""

from __future__ import annotations

import json
import time

import pytest
from support.baseenv import CHUNK, publish_base_env, settle, up
from support.nodes import NodeDaemon, serving

from layerfs.node.reads.accesstraces import MAX_TRACE, merge_traces, parse_trace, trace_key
from layerfs.refstore import RefStore


def test_traces_merge_as_a_union_in_first_touch_order():
    assert merge_traces([5, 1, 7], [1, 9, 5, 2]) == [5, 1, 9, 7, 2]
    assert merge_traces([], [3, 4]) == [3, 4]
    assert merge_traces([3, 3, 4]) == [3, 4]  # each chunk once
    long = list(range(MAX_TRACE + 10))
    assert merge_traces(long, [MAX_TRACE + 20]) == [0, MAX_TRACE + 20, *range(1, MAX_TRACE - 1)]


def test_a_stored_trace_is_only_chunk_indexes():
    assert parse_trace(b"[2, 0, 2, 1]") == [2, 0, 1]
    for bad in (b"{}", b'["1"]', b"[true]", b"[-1]", b"[1.5]", b"not json", b"\xff"):
        assert parse_trace(bad) is None, bad


@pytest.fixture
def node(starts_a_server, tmp_path, store, store_location):
    """Layers base@1 and up@1, env e@1 (up over base), and a daemon on them."""
    publish_base_env(tmp_path, store)
    daemon = NodeDaemon(tmp_path / "node", store_location.cli_args(), cache_size="64M")
    daemon.location = store_location
    yield from serving(daemon)


def store_gets(node: NodeDaemon) -> int:
    return node.request("stats")["store"].get("get", 0)


def settled_gets(node: NodeDaemon) -> int:
    """The store GETs once the background ones (a trace's) are done."""
    last = -1
    for _ in range(50):
        gets = store_gets(node)
        if gets == last:
            return gets
        last = gets
        time.sleep(0.2)
    return last


def test_first_up_of_a_never_seen_env_gets_each_object_once(node, tmp_path):
    """e@1 = up@1 over base@1 on an empty node: the env's ref and manifest, and
    per layer its manifest, chunk table and meta image, each one GET (plus,
    by default, one for the layer's pushed trace); no HEAD, no LIST."""
    other = NodeDaemon(tmp_path / "node2", node.location.cli_args()).start()
    try:
        before = other.request("stats")["store"]
        rootfs = up(other, "s1", "e@1", "--prefetch", "none")
        assert (rootfs / "lower" / "a").read_text() == "upper a"  # inline: no chunk read
        after = other.request("stats")["store"]
        assert {k: after[k] - before.get(k, 0) for k in after} == {"get": 2 + 2 * 3}
        assert f"store requests: get {after['get']}" in other.cli("stats").stdout
        other.cli("down", "s1")
        other.cli("up", "e@1", "--id", "s2")  # manifests now known: the ref and 2 traces
        assert settled_gets(other) - after["get"] == 1 + 2
        other.cli("down", "s2")
    finally:
        assert other.cleanup() == []


def pushed_chunks(node: NodeDaemon) -> int:
    return json.loads(node.cli("trace", "push", "base@1", "--json").stdout)["chunks"]


def test_up_replays_a_pushed_trace_by_default_and_traces_of_runs_merge(node, tmp_path, store):
    (up(node, "s1") / "data" / "file2").read_bytes()
    node.cli("down", "s1")
    first = pushed_chunks(node)
    (up(node, "s2") / "data" / "file0").read_bytes()
    node.cli("down", "s2")
    both = pushed_chunks(node)  # this node's two runs, merged
    assert both > first
    other = NodeDaemon(tmp_path / "node2", node.location.cli_args()).start()
    try:
        up(other, "t1", "e@1", "--prefetch", "none")
        assert settle(other)["bytes_fetched"] == 0  # none: lazy only
        other.cli("down", "t1")
        rootfs = up(other, "t2")  # the default replays the pushed trace
        fetched = settle(other)["bytes_fetched"]
        assert fetched >= 2 * 5 * CHUNK  # file2 and file0, never read on this node
        (rootfs / "data" / "file1").read_bytes()
        other.cli("down", "t2")
        merged = pushed_chunks(other)  # merged with what the store held
        assert merged > both
        digest = RefStore(store).resolve("layers", "base@1")
        stored = parse_trace(store.get(trace_key(digest)))
        assert stored is not None and len(stored) == merged
    finally:
        assert other.cleanup() == []
