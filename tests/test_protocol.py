"""The control protocol's typed messages: every request round-trips, a bad
field is refused with one error (by the parse and by a real daemon), and
sandbox records an earlier version wrote to ``replica.lmdb`` still load."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import build, need_root
from support.nodes import NodeDaemon, serving

from layerfs import records
from layerfs.errors import UsageError
from layerfs.node.control import RemoteError
from layerfs.node.protocol import (
    REQUESTS,
    BadMessage,
    BrokenDisk,
    DiskList,
    DiskRecord,
    Down,
    Limits,
    PsAnswer,
    SandboxRecord,
    SandboxStatus,
    Up,
    VmAnswer,
    VmList,
    VmRecord,
    VmUp,
    parse_request,
)
from layerfs.node.replica.replica import Replica


def old_record(sid: str, digest: str, rootfs: Path, **changes: object) -> dict[str, object]:
    """A sandbox record as the previous version wrote it (the sandbox manager's dict)."""
    record: dict[str, object] = {
        "id": sid, "env": None, "layer_refs": ["t@1"], "layers": [digest], "config": None,
        "prefetch": "none", "created": 1764547200.25, "state": "up", "rootfs": str(rootfs)}
    record.update(changes)
    return record


def test_every_request_round_trips():
    for op, cls in REQUESTS.items():
        request = cls()
        wire = request.to_json()
        assert wire["op"] == op
        assert parse_request(wire) == request
    up = Up(id="s1", env=None, layers=["a@1", "b@2"], prefetch="trace")
    assert parse_request(up.to_json()) == up
    assert parse_request({"op": "down", "id": "s1"}) == Down(id="s1", keep_upper=False)


@pytest.mark.parametrize("wire, message", [
    ({"op": "up", "id": 5}, "bad request up: id must be str, not 5"),
    ({"op": "up", "id": "s1", "layers": "a@1"}, "bad request up: layers must be list[str]"),
    ({"op": "up", "id": "s1", "layers": ["a@1", 7]}, "bad request up: layers[1] must be str"),
    ({"op": "down", "id": "s1", "keep_upper": "no"},
     "bad request down: keep_upper must be bool, not 'no'"),
    ({"op": "vm-up", "id": "v1", "disk_size": True}, "bad request vm-up: disk_size must be int"),
    ({"op": "disk-create", "id": "d1", "size": "1G"},
     "bad request disk-create: size must be int | None, not '1G'"),
    ({"op": "ps", "verbose": True}, "bad request ps: unknown field 'verbose'"),
    ({"op": "reboot"}, "unknown request 'reboot'"),
    ({"id": "s1"}, "unknown request None"),
])
def test_a_bad_field_is_one_usage_error(wire, message):
    with pytest.raises(UsageError) as caught:
        parse_request(wire)
    assert str(caught.value).startswith(message), str(caught.value)
    assert caught.value.exit_code == 2 and "\n" not in str(caught.value)


def test_an_integer_is_not_taken_for_a_bool_nor_a_bool_for_an_integer():
    assert parse_request({"op": "vm-up", "disk_size": 4096}) == VmUp(disk_size=4096)
    with pytest.raises(BadMessage):
        parse_request({"op": "down", "keep_upper": 1})


def test_records_of_earlier_versions_parse(tmp_path):
    rootfs = tmp_path / "rootfs"
    previous = old_record("s1", "sha256:" + "ab" * 32, rootfs)
    record = SandboxRecord.from_json(previous)
    assert (record.id, record.layers, record.rootfs, record.created) == (
        "s1", ["sha256:" + "ab" * 32], str(rootfs), 1764547200.25)
    assert record.to_json() == previous  # written back in the same shape
    lost = old_record("s2", "sha256:" + "cd" * 32, rootfs, state="lost", error="gone")
    assert SandboxRecord.from_json(lost).to_json() == lost
    before_image_configs = old_record("s3", "sha256:" + "ef" * 32, rootfs)
    del before_image_configs["config"]
    assert SandboxRecord.from_json(before_image_configs).config is None
    with pytest.raises(BadMessage, match="layers is missing"):
        SandboxRecord.from_json({"id": "s4", "rootfs": "/x", "state": "up"})


def test_ps_rows_keep_their_keys():
    record = SandboxRecord.from_json(old_record("s1", "sha256:" + "ab" * 32, Path("/r")))
    row = SandboxStatus(**vars(record), upper_bytes=4096, layer_bytes_read=65536)
    answer = PsAnswer.from_json({"sandboxes": [row.to_json()]})
    assert answer.sandboxes == [row]
    assert set(row.to_json()) == {"id", "env", "layer_refs", "layers", "config", "prefetch",
                                  "created", "state", "rootfs", "upper_bytes",
                                  "layer_bytes_read"}


def test_disk_and_vm_answers_are_typed_records_on_both_ends():
    """``disk ls`` rows are a disk or a broken one, told apart by their fields;
    a vm's drives keep Firecracker's keys; a drive of the wrong type is refused."""
    disk = DiskRecord(id="d1", size=1 << 20, path="/r/fuse/disks/d1", base=None,
                      base_ref=None, chain_depth=0, written_bytes=4096, uncommitted_entries=1)
    listing = DiskList([disk, BrokenDisk("d2", "no chain")], vms=["v1"])
    back = DiskList.from_json(listing.to_json())
    assert back == listing and isinstance(back.disks[1], BrokenDisk)
    assert back.to_json()["disks"][1] == {"id": "d2", "error": "no chain", "state": "broken"}
    wire = {"vm": {"id": "v1", "disk": "v1-rw", "blobs": ["sha256:" + "ab" * 32],
                   "layers": [{"ref": "t@1", "digest": "sha256:" + "ab" * 32,
                               "meta_drive": "layer0-meta", "device_drives": ["layer0-blob"]}],
                   "drives": [{"drive_id": "rw", "path_on_host": "/r/fuse/disks/v1-rw",
                               "is_read_only": False, "is_root_device": False}]}}
    vm = VmAnswer.from_json(wire).vm  # (as an earlier daemon answered: no role, no state)
    assert vm.drives[0].path_on_host == "/r/fuse/disks/v1-rw" and not vm.drives[0].is_read_only
    assert vm.layers[0].device_drives == ["layer0-blob"]
    assert (vm.state, vm.drives[0].role, vm.error) == ("up", "", None)
    wire["vm"]["drives"][0]["role"] = "disk"
    wire["vm"].update(state="up", created=0.0)
    assert VmAnswer(VmAnswer.from_json(wire).vm).to_json() == wire  # no error: none written
    broken = VmRecord.from_json({**wire["vm"], "state": "broken", "error": "disk gone"})
    assert VmList([broken]).to_json()["vms"][0]["error"] == "disk gone"
    wire["vm"]["drives"][0]["is_read_only"] = "no"
    with pytest.raises(BadMessage, match="is_read_only must be bool"):
        VmAnswer.from_json(wire)


@pytest.fixture
def layer_node(starts_a_server, tmp_path, store, store_location):
    """Layer t@1 (one file) and a daemon on its store."""
    need_root()
    src = tmp_path / "src"
    src.mkdir()
    (src / "hello").write_text("hello from t@1\n")
    digest = build(store, str(src)).digest
    daemon = NodeDaemon(tmp_path / "node", store_location.cli_args())
    daemon.digest = digest
    yield from serving(daemon)


def test_the_daemon_refuses_bad_fields_with_one_error(layer_node):
    layer_node.request("up", id="s1", layers=["t@1"])
    for op, fields in (("up", {"id": 5, "layers": ["t@1"]}),
                       ("down", {"id": "s1", "keep_upper": "no"}),
                       ("commit", {"id": "s1", "name": ["ws"], "version": "1"}),
                       ("disk-create", {"id": "d1", "size": "1G"})):
        with pytest.raises(RemoteError) as caught:
            layer_node.request(op, **fields)
        assert caught.value.exit_code == 2, caught.value
        assert str(caught.value).startswith(f"bad request {op}: "), caught.value
    assert "internal error" not in layer_node.log() and "Traceback" not in layer_node.log()
    rows = layer_node.request("ps")["sandboxes"]
    assert [r["id"] for r in rows] == ["s1"]  # the bad down took nothing down
    assert (layer_node.root / "sandboxes" / "s1" / "upper").is_dir()
    layer_node.request("down", id="s1")


def test_sandboxes_an_earlier_version_recorded_come_back_after_an_upgrade(layer_node):
    root, digest = layer_node.root, layer_node.digest
    layer_node.stop()
    replica = Replica(root)
    try:
        for sid in ("old", "older"):
            record = old_record(sid, digest, root / "sandboxes" / sid / "rootfs")
            if sid == "older":
                del record["config"]  # written before image configs were recorded
            os.makedirs(root / "sandboxes" / sid / "upper")
            (root / "sandboxes" / sid / "upper" / "kept").write_text(f"{sid}'s upper\n")
            replica.put_sandbox(sid, record)
    finally:
        replica.close()
    layer_node.start()
    rows = {r["id"]: r for r in layer_node.request("ps")["sandboxes"]}
    assert {sid: r["state"] for sid, r in rows.items()} == {"old": "up", "older": "up"}
    for sid in rows:
        rootfs = Path(rows[sid]["rootfs"])
        assert (rootfs / "hello").read_text() == "hello from t@1\n"
        assert (rootfs / "kept").read_text() == f"{sid}'s upper\n"
    assert rows["old"]["created"] == rows["older"]["created"] == 1764547200.25
    assert rows["old"]["layer_refs"] == ["t@1"] and rows["older"]["config"] is None
    for sid in rows:
        layer_node.request("down", id=sid)


def test_records_behave_as_dataclasses():
    """What the code relies on of a record (:mod:`layerfs.node.records`):
    defaults made per record, positional and keyword construction, equality
    by value, a repr, ``vars`` as the fields, a wrong field a TypeError."""
    a, b = Up(id="s1"), Up(id="s1")
    assert a == b and a.layers == [] and a.layers is not b.layers
    a.layers.append("t@1")
    assert a != b and b.layers == []
    assert Down("s1", True) == Down(id="s1", keep_upper=True)
    assert repr(Down("s1")) == "Down(id='s1', keep_upper=False, force=False)"
    record = SandboxRecord("s1", ["sha256:ab"], "/r", "up")
    assert vars(record) == {"id": "s1", "layers": ["sha256:ab"], "rootfs": "/r", "state": "up",
                            "env": None, "layer_refs": [], "config": None, "prefetch": "none",
                            "created": 0.0, "error": None, "limits": Limits(),
                            "offline": []}
    names = [f.name for f in records.fields(SandboxStatus)]
    assert names[-2:] == ["upper_bytes", "layer_bytes_read"]
    for bad in (lambda: Down(ident="s1"), lambda: SandboxRecord("s1"),
                lambda: Down("s1", False, False, "extra"), lambda: Down("s1", id="s2")):
        with pytest.raises(TypeError):
            bad()


def test_an_answer_may_carry_fields_a_request_may_not():
    wire = {"sandboxes": [{"id": "s1", "layers": [], "rootfs": "/r", "state": "up",
                           "upper_bytes": 1, "added_later": True}], "added_too": 1}
    with pytest.raises(BadMessage, match="unknown field 'added_too'"):
        PsAnswer.from_json(wire, "ps")
    answer = PsAnswer.from_json(wire, "ps", extra_fields=True)
    assert answer.sandboxes[0].upper_bytes == 1 and "added_later" not in vars(answer.sandboxes[0])
    with pytest.raises(BadMessage, match="unknown field 'verbose'"):
        parse_request({"op": "ps", "verbose": True})
