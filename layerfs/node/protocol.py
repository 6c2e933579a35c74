"""The control protocol's messages, for both ends: one dataclass per request
op and one per answer, with the one typed parse that turns JSON into them.

A request on the wire is ``{"op": OP, field: value, ...}``; a field left out
takes its default, and a field that is unknown or of the wrong type is
refused with one :class:`BadMessage`. Answers are the dataclasses' JSON
(:meth:`Message.to_json`); the same parse reads them back in the clients.
Sandbox records (:class:`SandboxRecord`) are also what ``replica.lmdb``
stores: a record written by an earlier version parses (fields added since
have defaults).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from ..errors import UsageError

DEFAULT_VM_DISK = 10 << 30
LAYER_ROLES = ("base", "toolchain", "workspace")  # what a committed upper may be

M = TypeVar("M", bound="Message")


class BadMessage(UsageError):
    """bad request {}: {}"""


@dataclass
class Message:
    """A record that goes over the control socket (or into the replica) as JSON."""

    def to_json(self) -> dict[str, Any]:
        return {f.name: to_json(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls: type[M], data: object, what: str = "") -> M:
        return parse_record(cls, data, what or cls.__name__)


def to_json(value: Any) -> Any:
    """A field's JSON value: messages as their own JSON, lists item by item."""
    if isinstance(value, Message):
        return value.to_json()
    if isinstance(value, list):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value


def parse_record(cls: type[M], data: object, what: str) -> M:
    """``data`` (a JSON object) as a ``cls``, every field of its declared type."""
    if not isinstance(data, dict):
        raise BadMessage(what, "not a JSON object")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names - {"op"})
    if unknown:
        raise BadMessage(what, f"unknown field {unknown[0]!r}")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            values[f.name] = conform(data[f.name], hints[f.name], f"{what}: {f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise BadMessage(what, f"{f.name} is missing")
    return cls(**values)


def conform(value: object, hint: Any, where: str) -> Any:
    """``value`` if it is of type ``hint`` (JSON's types: str, int, float, bool,
    None, lists, string-keyed objects, messages), else a :class:`BadMessage`."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (types.UnionType, typing.Union):
        for option in typing.get_args(hint):
            try:
                return conform(value, option, where)
            except BadMessage:
                pass
        raise mismatch(where, hint, value)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise mismatch(where, hint, value)
        return [conform(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(hint)
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise mismatch(where, hint, value)
        return {k: conform(v, item, f"{where}.{k}") for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, Message):
        return parse_record(hint, value, where)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is type(None) and value is None:
        return None
    if isinstance(hint, type) and isinstance(value, hint) and (
            hint is bool or not isinstance(value, bool)):
        return value
    raise mismatch(where, hint, value)


def mismatch(where: str, hint: Any, value: object) -> BadMessage:
    what, _, name = where.partition(": ")
    expected = hint.__name__ if isinstance(hint, type) else str(hint)
    return BadMessage(what, f"{name} must be {expected}, not {value!r}"[:200])


# -- requests --

@dataclass
class Request(Message):
    op: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, **super().to_json()}


@dataclass
class Ping(Request):
    op = "ping"


@dataclass
class Up(Request):
    op = "up"
    id: str = ""
    env: str | None = None
    layers: list[str] = field(default_factory=list)
    prefetch: str = "auto"


@dataclass
class Down(Request):
    op = "down"
    id: str = ""
    keep_upper: bool = False


@dataclass
class Ps(Request):
    op = "ps"
    id: str | None = None  # only this sandbox (its size counted alone)


@dataclass
class Commit(Request):
    op = "commit"
    id: str = ""
    name: str = ""
    version: str = ""
    role: str = "workspace"


@dataclass
class Stats(Request):
    op = "stats"


@dataclass
class TracePush(Request):
    op = "trace-push"
    ref: str = ""


@dataclass
class DiskCreate(Request):
    op = "disk-create"
    id: str = ""
    size: int | None = None
    base: str | None = None


@dataclass
class DiskLs(Request):
    op = "disk-ls"


@dataclass
class DiskRm(Request):
    op = "disk-rm"
    id: str = ""


@dataclass
class DiskCommit(Request):
    op = "disk-commit"
    id: str = ""
    name: str = ""
    version: str = ""


@dataclass
class VmUp(Request):
    op = "vm-up"
    id: str = ""
    env: str | None = None
    layers: list[str] = field(default_factory=list)
    disk_size: int = DEFAULT_VM_DISK
    base_disk: str | None = None


@dataclass
class VmDown(Request):
    op = "vm-down"
    id: str = ""
    keep: bool = False


REQUESTS: dict[str, type[Request]] = {cls.op: cls for cls in (
    Ping, Up, Down, Ps, Commit, Stats, TracePush,
    DiskCreate, DiskLs, DiskRm, DiskCommit, VmUp, VmDown)}


def parse_request(data: object) -> Request:
    """A request from its JSON; one :class:`BadMessage` for anything amiss."""
    if not isinstance(data, dict):
        raise BadMessage("", "not a JSON object")
    op = data.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise UsageError(f"unknown request {op!r}")
    return cls.from_json(data, cls.op)


# -- answers --

@dataclass
class PingAnswer(Message):
    root: str
    store: str
    pid: int


@dataclass
class SandboxRecord(Message):
    """A sandbox as the daemon keeps it (in memory and in the replica)."""

    id: str
    layers: list[str]  # layer manifest digests, top first
    rootfs: str
    state: str  # starting, up, down or lost
    env: str | None = None
    layer_refs: list[str] = field(default_factory=list)
    config: dict[str, Any] | None = None  # the env's image config
    prefetch: str = "none"
    created: float = 0.0
    error: str | None = None  # why it is lost

    def to_json(self) -> dict[str, Any]:
        doc = super().to_json()
        if self.error is None:
            del doc["error"]
        return doc


@dataclass
class SandboxStatus(SandboxRecord):
    """A row of ``ps``: the record and what the sandbox used so far."""

    upper_bytes: int = 0
    layer_bytes_read: int = 0


@dataclass
class SandboxAnswer(Message):
    sandbox: SandboxRecord


@dataclass
class PsAnswer(Message):
    sandboxes: list[SandboxStatus]


@dataclass
class CommitAnswer(Message):
    ref: str
    digest: str
    published: bool
    id: str
    chunk_size: int
    files: int
    file_bytes: int
    stored_bytes: int
    uploaded_bytes: int
    unique_chunks: int
    reused_chunks: int
    dedup_sources: list[str]
    vanished: list[str]
    changed: list[str]


@dataclass
class LayerStats(Message):
    users: int
    bytes_read: int
    chunks_touched: int
    chunks: int
    blob_bytes: int


@dataclass
class StatsAnswer(Message):
    cache: dict[str, int]
    layers: dict[str, LayerStats]
    sandboxes: int
    store: dict[str, int] = field(default_factory=dict)  # requests sent, by kind


@dataclass
class TracePushAnswer(Message):
    ref: str
    digest: str
    chunks: int


@dataclass
class DiskRecord(Message):
    """A writable disk as ``disk create`` and ``disk ls`` show it."""

    id: str
    size: int
    path: str  # its file under ROOT/fuse/disks
    base: str | None  # the sealed layer (digest) it sits on
    base_ref: str | None
    chain_depth: int
    written_bytes: int
    uncommitted_entries: int  # log entries since the last commit


@dataclass
class BrokenDisk(Message):
    """A disk an earlier run left that cannot be opened (a row of ``disk ls``)."""

    id: str
    error: str
    state: str = "broken"


@dataclass
class DiskAnswer(Message):
    disk: DiskRecord


@dataclass
class DiskList(Message):
    disks: list[DiskRecord | BrokenDisk]
    vms: list[str]


@dataclass
class DiskRemoved(Message):
    id: str


@dataclass
class DiskCommitAnswer(Message):
    ref: str
    digest: str
    published: bool
    changed_bytes: int
    stored_bytes: int
    uploaded_bytes: int
    parent: str | None


@dataclass
class VmDrive(Message):
    """One drive of a microVM, as Firecracker's drive API names its fields."""

    drive_id: str
    path_on_host: str
    is_read_only: bool
    is_root_device: bool = False


@dataclass
class VmLayer(Message):
    """An env layer of a microVM: its meta image's drive and its blob's."""

    ref: str
    digest: str
    meta_drive: str
    device_drives: list[str]


@dataclass
class VmRecord(Message):
    """A microVM's drive set: the layers' drives, then its writable disk's."""

    id: str
    drives: list[VmDrive]
    layers: list[VmLayer]
    disk: str  # the writable disk's id
    blobs: list[str]  # layer digests whose blob files it holds open


@dataclass
class VmAnswer(Message):
    vm: VmRecord
