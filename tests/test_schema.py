"""One typed-JSON schema layer (:mod:`layerfs.schema`) for everything layerfs
reads from others: the store's manifests and records and the control
messages. A fuzz run over both feeds valid documents mutated into hostile ones
(a value swapped for a huge or negative int, a float, NaN, a bool, a long
string, a long list, deep nesting; a field dropped or added; bytes flipped):
each is parsed into a typed record that round-trips, or refused with the
parser's own error, never another exception. And the rules themselves: exact
types, bounded integers, no float taken from an int, bounded strings and lists."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerfs import schema
from layerfs.bounds import MAX_ITEMS, MAX_STRING
from layerfs.errors import IntegrityError, OverLimit, UsageError
from layerfs.imageconfig import ImageConfig
from layerfs.manifest import (
    BlobRef,
    DiskManifest,
    EnvLayer,
    EnvManifest,
    LayerManifest,
    MetaRef,
    TarSplitRef,
    manifest_head,
)
from layerfs.node import protocol
from layerfs.node.reads.accesstraces import parse_trace
from layerfs.retention import _parse_expiry

D1, D2, D3 = ("sha256:" + c * 64 for c in "abc")

LAYER = LayerManifest(
    "base/py", "1", "base", 65536, MetaRef(D1, 100, D2, 4096), BlobRef(D3, 200), 1 << 20,
    "2026-01-01T00:00:00Z", dedup_sources=["other@2"], source=f"oci:{D2}",
    tar_split=TarSplitRef(D1, 50, D2, 10240))
DISK = DiskManifest("disk/a", "1", 65536, BlobRef(D1, 10), 1 << 20, 1 << 30, "u-1", D2, "p@1",
                    4096, 16, "2026-01-01T00:00:00Z")
ENV = EnvManifest("env/a", "1", [EnvLayer("base/py@1", D1), EnvLayer(D2, D2)],
                  "2026-01-01T00:00:00Z",
                  ImageConfig(env=["PATH=/bin"], cmd=["sh"], labels={"a": "b"}))
MANIFESTS: dict[str, tuple[bytes, Any]] = {
    "layer": (LAYER.to_bytes(), LayerManifest.from_bytes),
    "disk": (DISK.to_bytes(), DiskManifest.from_bytes),
    "env": (ENV.to_bytes(), EnvManifest.from_bytes),
}

RECORD = protocol.SandboxRecord(
    "s1", [D1], "/r/sandboxes/s1/rootfs", "up", env="env/a@1", layer_refs=["base/py@1"],
    config={"env": ["A=1"], "labels": {"k": "v"}, "n": [1, 2.5, None, True]},
    created=1764547200.25, limits=protocol.Limits(memory=1 << 30, cpus=0.5),
    offline=[protocol.OfflineRef("base/py@1", D1, 1764547100.5)])
ANSWERS: list[protocol.Message] = [
    protocol.SandboxAnswer(RECORD),
    protocol.PsAnswer([protocol.SandboxStatus(**vars(RECORD), upper_bytes=4096)]),
    protocol.DiskList([protocol.DiskRecord("d1", 1 << 20, "/r/fuse/disks/d1", None, None, 0, 0,
                                           0), protocol.BrokenDisk("d2", "no chain")], ["v1"]),
    protocol.VmAnswer(protocol.VmRecord("v1", [protocol.VmDrive("rw", "/p", False)],
                                        [protocol.VmLayer("t@1", D1, "m", ["b"])], "v1-rw",
                                        [D1])),
    protocol.StatsAnswer({"hits": 3}, {D1: protocol.LayerStats(1, 2, 3, 4, 5)}, 1),
    protocol.CommitAnswer("w@1", D1, True, "s1", 65536, 1, 2, 3, 4, 5, 6, [], [], ["/a"],
                          expires=1764547200.5),
]
REQUESTS: list[protocol.Request] = [
    *(cls() for cls in protocol.REQUESTS.values()),
    protocol.Up(id="s1", layers=["a@1"], limits=protocol.Limits(memory=1 << 20, cpus=1.5)),
    protocol.Commit(id="s1", name="w", version="1", expire=3600.0),
    protocol.DiskCreate(id="d1", size=1 << 20, base="b@1"),
]

# -- hostile values and mutations ---------------------------------------------------------

DEEP = "__deep__"  # in JSON text: stands for 5000 nested lists (past the parser's depth)


def dumps(doc: object) -> bytes:
    return json.dumps(doc).replace(json.dumps(DEEP), "[" * 5000 + "]" * 5000).encode()


HOSTILE_SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from([-1, 2**63, 2**63 - 1, -(2**63) - 1, 10**30, 2**200, 0, 4096]),
    st.integers(), st.floats(), st.sampled_from([float("nan"), float("inf"), 1.0, 0.5]),
    st.text(max_size=12), st.sampled_from(["x" * (MAX_STRING + 1), "", "sha256:" + "0" * 64,
                                           "sha256:XYZ", "../../etc", "a@1", "é", DEEP]),
)


def deep(depth: int) -> object:
    doc: object = 1
    for _ in range(depth):
        doc = [doc]
    return doc


HOSTILE = st.one_of(
    HOSTILE_SCALARS,
    st.lists(HOSTILE_SCALARS, max_size=4),
    st.dictionaries(st.text(max_size=6), HOSTILE_SCALARS, max_size=3),
    st.sampled_from([[0] * (MAX_ITEMS + 1), {str(i): 0 for i in range(MAX_ITEMS + 1)}]),
    st.integers(min_value=1, max_value=400).map(deep),
)


def paths(doc: object, at: tuple = ()) -> list[tuple]:
    """Every place in a JSON document: a path of keys and indexes from the root."""
    found = [at]
    if isinstance(doc, dict):
        for key, value in doc.items():
            found += paths(value, (*at, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            found += paths(value, (*at, i))
    return found


@st.composite
def mutated(draw: st.DrawFn, doc: object) -> object:
    """``doc`` (a copy) with one to three mutations at places hypothesis picks."""
    for _ in range(draw(st.integers(1, 3))):
        doc = json.loads(json.dumps(doc))  # (a copy: drawn values are never changed in place)
        where = draw(st.sampled_from(paths(doc)))
        how = draw(st.sampled_from(["replace", "replace", "drop", "add", "wrap"]))
        if not where:
            if how == "replace":
                doc = draw(HOSTILE)
            elif how == "wrap":
                doc = [doc]
            continue
        parent = doc
        for step in where[:-1]:
            parent = parent[step]  # type: ignore[index]
        last = where[-1]
        if how == "drop":
            del parent[last]  # type: ignore[union-attr,arg-type]
        elif how == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(HOSTILE)
        elif how == "wrap":
            inner = parent[last]  # type: ignore[index]
            parent[last] = [inner] if draw(st.booleans()) else {"value": inner}  # type: ignore
        else:
            parent[last] = draw(HOSTILE)  # type: ignore[index]
    return doc


FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- the fuzz run over both -----------------------------------------------------------

@FUZZ
@given(st.data())
def test_hostile_manifests_parse_or_are_one_integrity_error(data):
    kind = data.draw(st.sampled_from(sorted(MANIFESTS)))
    valid, parse = MANIFESTS[kind]
    doc = data.draw(mutated(json.loads(valid)))
    raw = dumps(doc)
    if data.draw(st.booleans()):  # and bytes flipped or cut
        cut = data.draw(st.integers(0, len(raw)))
        raw = raw[:cut] + data.draw(st.binary(max_size=3)) + raw[cut + 1:]
    try:
        manifest = parse(raw, "sha256:" + "f" * 64)
    except IntegrityError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 1024, str(exc)[:2000]
    else:
        assert parse(manifest.to_bytes()) == manifest  # a typed record, whole
    for other in (manifest_head, *(p for _, p in MANIFESTS.values())):  # (read as any kind)
        try:
            other(raw)
        except IntegrityError as exc:
            assert "\n" not in str(exc)


@FUZZ
@given(st.data())
def test_hostile_control_messages_parse_or_are_one_bad_message(data):
    if data.draw(st.booleans()):
        request = data.draw(st.sampled_from(REQUESTS))
        doc = data.draw(mutated(request.to_json()))
        try:
            parsed = protocol.parse_request(doc)
        except UsageError as exc:  # BadMessage, or an unknown op
            assert exc.exit_code == 2 and "\n" not in str(exc) and len(str(exc)) < 1024
        else:
            assert protocol.parse_request(parsed.to_json()) == parsed
        return
    answer = data.draw(st.sampled_from(ANSWERS))
    doc = data.draw(mutated(answer.to_json()))
    extra = data.draw(st.booleans())
    try:
        parsed = type(answer).from_json(doc, extra_fields=extra)
    except protocol.BadMessage as exc:
        assert exc.exit_code == 2 and "\n" not in str(exc) and len(str(exc)) < 1024
    else:
        assert type(answer).from_json(parsed.to_json()) == parsed


@FUZZ
@given(st.data())
def test_hostile_store_records_parse_or_are_refused(data):
    expiry = {"digest": D1, "expires": 1764547200.5}
    raw = dumps(data.draw(mutated(expiry)))
    try:
        parsed = _parse_expiry("layers", "a/1", raw)
    except IntegrityError:
        pass
    else:
        assert type(parsed.expires) is float and parsed.digest.startswith("sha256:")
    trace = dumps(data.draw(mutated([3, 1, 2])))
    got = parse_trace(trace)
    assert got is None or all(type(i) is int and 0 <= i < 2**63 for i in got)


# -- the rules ----------------------------------------------------------------------------

@pytest.mark.parametrize("hint, value, text", [
    (int, True, "f must be int, not True"),
    (int, 1.0, "f must be int, not 1.0"),
    (int, -1, "f must be an int in [0, 2^63), not -1"),
    (int, 2**63, "f must be an int in [0, 2^63), not 9223372036854775808"),
    (int, 10**400, "f must be an int in [0, 2^63), not an int of 1329 bits"),
    (float, 2, "f must be float, not 2"),
    (float, float("inf"), "f must be a finite float, not inf"),
    (float, float("nan"), "f must be a finite float, not nan"),
    (bool, 0, "f must be bool, not 0"),
    (str, None, "f must be str, not None"),
    (int | None, "1G", "f must be int | None, not '1G'"),
    (list[str], {"a": 1}, "f must be list[str], not an object of 1 keys"),
    (dict[str, int], {"a": -5}, "f['a'] must be an int in [0, 2^63), not -5"),
])
def test_one_rule_for_every_type(hint, value, text):
    with pytest.raises(schema.SchemaError) as caught:
        schema.value(hint, value, "f")
    assert caught.value.text == text


def test_bounds_are_over_bound_errors_a_writer_reports_as_over_a_limit():
    for hint, value, amount in ((str, "x" * (MAX_STRING + 1), "a string of 65537 characters"),
                                (list[int], [0] * (MAX_ITEMS + 1), f"{MAX_ITEMS + 1} items"),
                                (schema.ANY, {"a": [["y" * (MAX_STRING + 1)]]},
                                 "a string of 65537 characters")):
        with pytest.raises(schema.OverBound) as caught:
            schema.value(hint, value, "f")
        assert caught.value.amount == amount
    big = EnvManifest("e", "1", [EnvLayer("a@1", D1)], "now",
                      ImageConfig(labels={"k": "z" * (MAX_STRING + 1)}))
    with pytest.raises(OverLimit, match=r"field config\.labels\['k'\] is over the limit"):
        big.checked_bytes()


def test_any_is_walked_without_recursion_and_bounded():
    schema.value(schema.ANY, deep(100_000), "f")  # (far past the interpreter's own depth)
    for bad in ({1: "x"}, [2**64], [float("nan")], [b"bytes"]):
        with pytest.raises(schema.SchemaError):
            schema.value(schema.ANY, bad, "f")


def test_unknown_keys_are_refused_or_ignored_as_the_caller_says():
    wire = {"id": "d2", "error": "x", "later": 1}
    with pytest.raises(schema.SchemaError, match="unknown field 'later'"):
        schema.parse(protocol.BrokenDisk, wire)
    assert schema.parse(protocol.BrokenDisk, wire, extra=True) == protocol.BrokenDisk("d2", "x")
    doc = json.loads(LAYER.to_bytes())
    doc["meta"]["extra"] = 1
    with pytest.raises(IntegrityError, match="unknown field 'meta.extra'"):
        LayerManifest.from_bytes(json.dumps(doc).encode())


def test_a_float_is_never_made_from_an_int_nor_json_text_that_is_not_json():
    with pytest.raises(protocol.BadMessage, match=re.escape("expire must be float | None, not 60")):
        protocol.parse_request({"op": "commit", "id": "s1", "expire": 60})
    assert protocol.parse_request({"op": "commit", "expire": 60.0}).expire == 60.0
    for raw in (b"[" * 100_000, b"\xff", b'{"a": 1e999999}x'):
        with pytest.raises(schema.SchemaError, match="not JSON"):
            schema.loads(raw)
