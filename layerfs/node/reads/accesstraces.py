"""Access traces: the order in which sandboxes first touched a layer's chunks.

A trace is a list of chunk indexes (into the layer's chunk table), each at
most once, in first-touch order. A node keeps one per layer in its replica
and may push it to the store (``traces/<layer hex>``, JSON), where other
nodes' ``up`` finds it. Traces of several runs merge: the union, ordered by
how early each chunk was first touched in any run (its smallest position;
ties go to the older trace), cut to ``MAX_TRACE`` chunks. A trace read from
the store is data from anyone: one that is not a JSON list of chunk indexes
(:mod:`layerfs.schema`'s rules: at most ``MAX_TRACE`` of them) is ignored.
"""

from __future__ import annotations

import json

from ... import schema

MAX_TRACE = 1 << 16  # chunks kept in a trace: 64 Ki indexes, ~0.5 MB of JSON
TRACE = list[int]  # its type (layerfs.schema: at most MAX_ITEMS = MAX_TRACE indexes)


def trace_key(digest: str) -> str:
    return "traces/" + digest.removeprefix("sha256:")


def merge_traces(*traces: list[int]) -> list[int]:
    """The union of the traces (oldest first), each chunk at the smallest
    position any of them first touched it at, at most ``MAX_TRACE`` chunks."""
    first: dict[int, tuple[int, int]] = {}  # chunk → (position, which trace)
    for which, trace in enumerate(traces):
        for position, chunk in enumerate(trace):
            rank = (position, which)
            if chunk not in first or rank < first[chunk]:
                first[chunk] = rank
    return sorted(first, key=first.__getitem__)[:MAX_TRACE]


def parse_trace(data: bytes) -> list[int] | None:
    """A stored trace's chunk indexes (first touch of each kept), or None if
    the bytes are not a JSON list of at most ``MAX_TRACE`` non-negative integers."""
    try:
        doc = schema.value(TRACE, schema.loads(data), "trace")
    except schema.SchemaError:
        return None
    return merge_traces(doc)


def trace_bytes(order: list[int]) -> bytes:
    return json.dumps(order[:MAX_TRACE], separators=(",", ":")).encode()
