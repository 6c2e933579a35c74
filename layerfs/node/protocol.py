"""The control protocol's messages, for both ends: one typed record
(:mod:`layerfs.records`: declared like a dataclass, defined without its per-class
code generation, so that a client starts fast) per request op and one per
answer, with the one typed parse that turns JSON into them.

A request on the wire is ``{"op": OP, field: value, ...}``; a field left out
takes its default, and a field that is unknown or of the wrong type is
refused with one :class:`BadMessage`: the rules of :mod:`layerfs.schema`,
the manifests' too (exact types, no int taken for a float or a bool for an
int, integers in [0, 2^63), strings and lists bounded). Answers are the records' JSON
(:meth:`Message.to_json`); the same parse reads them back in the clients,
which ignore fields they do not know (a newer daemon's answers may carry
more: a client keeps working across a daemon upgrade).
Sandbox records (:class:`SandboxRecord`) are also what ``replica.lmdb``
stores: a record written by an earlier version parses (fields added since
have defaults).
"""

from __future__ import annotations

from .. import schema
from ..errors import BadMessage, UsageError
from ..records import Record, field

TYPE_CHECKING = False  # typing is not imported at run time: a client starts faster
if TYPE_CHECKING:
    from typing import Any, ClassVar, TypeVar

    M = TypeVar("M", bound="Message")

DEFAULT_VM_DISK = 10 << 30
DEFAULT_SNAPSHOT_DEPTH = 8  # vm suspend: a chain deeper than this is merged into one layer
LAYER_ROLES = ("base", "toolchain", "workspace")  # what a committed upper may be


class Message(Record):
    """A record that goes over the control socket (or into the replica) as JSON."""

    def to_json(self) -> dict[str, Any]:
        return {f.name: to_json(getattr(self, f.name)) for f in self.__record_fields__}

    @classmethod
    def from_json(cls: type[M], data: object, what: str = "", *,
                  extra_fields: bool = False) -> M:
        """``data`` as a ``cls``; a field it does not know is refused, or with
        ``extra_fields`` (an answer from a newer daemon) ignored."""
        return parse_record(cls, data, what or cls.__name__, extra_fields)


def to_json(value: Any) -> Any:
    """A field's JSON value: messages as their own JSON, lists item by item."""
    if isinstance(value, Message):
        return value.to_json()
    if isinstance(value, list):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value


def parse_record(cls: type[M], data: object, what: str, extra_fields: bool = False) -> M:
    """``data`` (a JSON object) as a ``cls`` by the rules of :mod:`layerfs.schema`;
    a field ``cls`` lacks is refused unless ``extra_fields``."""
    if not isinstance(data, dict):
        raise BadMessage(what, "not a JSON object")
    try:
        return schema.parse(cls, data, extra_fields)
    except schema.SchemaError as exc:
        raise BadMessage(what, exc.text) from None


# -- requests --

class Request(Message):
    op: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, **super().to_json()}

    @classmethod
    def from_json(cls: type[M], data: object, what: str = "", *,
                  extra_fields: bool = False) -> M:
        """A request from its wire form (its ``op`` is the class's)."""
        if isinstance(data, dict) and "op" in data:
            data = {k: v for k, v in data.items() if k != "op"}
        return parse_record(cls, data, what or cls.__name__, extra_fields)


class Ping(Request):
    op = "ping"


class Limits(Message):
    """What a sandbox may use (None: unbounded): memory and its processes in
    bytes and a count, CPU time in CPUs, its writable layer in bytes."""

    memory: int | None = None
    cpus: float | None = None
    pids: int | None = None
    disk_quota: int | None = None

    def given(self) -> bool:
        return any(getattr(self, f.name) is not None for f in self.__record_fields__)


class Up(Request):
    op = "up"
    id: str = ""
    env: str | None = None
    layers: list[str] = field(default_factory=list)
    prefetch: str = "auto"
    limits: Limits = field(default_factory=Limits)


class Down(Request):
    op = "down"
    id: str = ""
    keep_upper: bool = False
    force: bool = False  # kill the containers that run in it first


class Ps(Request):
    op = "ps"
    id: str | None = None  # only this sandbox (its size counted alone)


class Commit(Request):
    op = "commit"
    id: str = ""
    name: str = ""
    version: str = ""
    role: str = "workspace"
    expire: float | None = None  # seconds after the commit its ref expires (None: never)


class Suspend(Request):
    op = "suspend"
    id: str = ""
    name: str = ""
    version: str = ""


class Stats(Request):
    op = "stats"


class TracePush(Request):
    op = "trace-push"
    ref: str = ""


class DiskCreate(Request):
    op = "disk-create"
    id: str = ""
    size: int | None = None
    base: str | None = None


class DiskLs(Request):
    op = "disk-ls"


class DiskRm(Request):
    op = "disk-rm"
    id: str = ""


class DiskCommit(Request):
    op = "disk-commit"
    id: str = ""
    name: str = ""
    version: str = ""
    max_depth: int = 0  # past this many layers the chain is merged into one (0: no bound)


class VmUp(Request):
    op = "vm-up"
    id: str = ""
    env: str | None = None
    layers: list[str] = field(default_factory=list)
    disk_size: int = DEFAULT_VM_DISK
    base_disk: str | None = None
    pmem: str = ""  # the layers as pmem drives: "shared" or "private" (VM_PMEM); "": block
    ram: int = 0  # bytes of guest RAM in a file the node keeps (what vm suspend needs)


class VmSuspend(Request):
    op = "vm-suspend"
    id: str = ""
    name: str = ""
    version: str = ""
    max_depth: int = DEFAULT_SNAPSHOT_DEPTH  # of the RAM's and the disk's chains


class VmResume(Request):
    op = "vm-resume"
    ref: str = ""
    id: str = ""


class VmPrefetch(Request):
    op = "vm-prefetch"
    ref: str = ""


class VmDown(Request):
    op = "vm-down"
    id: str = ""
    keep: bool = False


class VmPs(Request):
    op = "vm-ps"


REQUESTS: dict[str, type[Request]] = {cls.op: cls for cls in (
    Ping, Up, Down, Ps, Commit, Suspend, Stats, TracePush,
    DiskCreate, DiskLs, DiskRm, DiskCommit, VmUp, VmDown, VmPs, VmSuspend, VmResume,
    VmPrefetch)}


def parse_request(data: object) -> Request:
    """A request from its JSON; one :class:`BadMessage` for anything amiss."""
    if not isinstance(data, dict):
        raise BadMessage("", "not a JSON object")
    op = data.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise UsageError(f"unknown request {schema.shown(op)}")
    return cls.from_json(data, cls.op)


# -- answers --

class PingAnswer(Message):
    root: str
    store: str
    pid: int


def utc_time(seconds: float, micros: bool = False) -> str:
    """``2026-01-01T12:00:00Z`` (ISO 8601, UTC) of a time in seconds since the
    epoch; with ``micros``, ``2026-12-02T03:04:05.123456Z`` (as the JSON output
    writes a sandbox's ``created``)."""
    import time

    whole = int(seconds // 1)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    if micros:
        text += f".{min(999_999, round((seconds - whole) * 1e6)):06d}"
    return text + "Z"


class OfflineRef(Message):
    """A ref an ``up`` resolved through the node's last resolution of it,
    because the store did not answer."""

    ref: str  # name@version as given
    digest: str  # what it resolved to
    made: float  # when the store gave that resolution (seconds since the epoch)
    reason: str = "store unreachable"

    def note(self) -> str:
        """The line the daemon logs and the CLI prints."""
        return f"using the resolution of {self.ref} from {utc_time(self.made)}; {self.reason}"


class SandboxRecord(Message):
    """A sandbox as the daemon keeps it (in memory and in the replica)."""

    id: str
    layers: list[str]  # layer manifest digests, top first
    rootfs: str
    state: str  # a lifecycle.SandboxState: starting, up, lost, stopping, down_failed, down
    env: str | None = None
    layer_refs: list[str] = field(default_factory=list)
    config: dict[str, Any] | None = None  # the env's image config
    prefetch: str = "none"
    created: float = 0.0
    error: str | None = None  # why it is lost, or why its down stopped
    limits: Limits = field(default_factory=Limits)  # enforced by `run` and the upper's quota
    offline: list[OfflineRef] = field(default_factory=list)  # refs the store did not resolve

    def to_json(self) -> dict[str, Any]:
        doc = super().to_json()
        if self.error is None:
            del doc["error"]
        if not self.limits.given():  # (as an earlier version wrote it)
            del doc["limits"]
        if not self.offline:
            del doc["offline"]
        return doc


class SandboxStatus(SandboxRecord):
    """A row of ``ps``: the record and what the sandbox used so far."""

    upper_bytes: int = 0
    layer_bytes_read: int = 0


class SandboxAnswer(Message):
    sandbox: SandboxRecord


class ContainerdSnapshot(Message):
    """A row of ``ps``'s containerd section: a snapshot of containerd's snapshotter."""

    name: str
    kind: str  # active, view or committed
    parent: str = ""
    chain: str = ""  # a lazy snapshot's chain ID, its layers layerfs's; "" for a plain one
    layers: int = 0  # a lazy snapshot's layerfs layers
    created: float = 0.0


class PsAnswer(Message):
    sandboxes: list[SandboxStatus]
    snapshots: list[ContainerdSnapshot] = field(default_factory=list)  # the first MAX_PS_ROWS
    snapshot_count: int = 0  # containerd's snapshots in all


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
    expires: float | None = None  # when its ref expires (seconds since the epoch)


class SuspendAnswer(Message):
    """A sandbox suspended into the store: ``ref`` (an env: the committed
    upper over the sandbox's layers) brings it up again with ``resume``."""

    id: str
    ref: str  # the env name@version
    digest: str  # its manifest's
    commit: CommitAnswer  # the upper, as layer name@version
    frozen: list[str] = field(default_factory=list)  # the containers frozen while it committed
    frozen_seconds: float = 0.0  # how long they were frozen before it ended


class LayerStats(Message):
    users: int
    bytes_read: int
    chunks_touched: int
    chunks: int
    blob_bytes: int
    local: bool = False  # fetched whole into a local file: the kernel serves its reads
    partial: bool = False  # over a partial file the daemon fills as the kernel reads it
    name: str = ""  # name@version, from the manifest the node holds ("" if none)


class StatsAnswer(Message):
    cache: dict[str, int]
    layers: dict[str, LayerStats]
    sandboxes: int
    store: dict[str, int] = field(default_factory=dict)  # requests sent, by kind


class TracePushAnswer(Message):
    ref: str
    digest: str
    chunks: int


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
    offline: list[OfflineRef] = field(default_factory=list)  # create's, resolved by the node

    def to_json(self) -> dict[str, Any]:
        doc = super().to_json()
        if not self.offline:
            del doc["offline"]
        return doc


class BrokenDisk(Message):
    """A disk an earlier run left that cannot be opened (a row of ``disk ls``)."""

    id: str
    error: str
    state: str = "broken"


class DiskAnswer(Message):
    disk: DiskRecord


class DiskList(Message):
    disks: list[DiskRecord | BrokenDisk]
    vms: list[str]


class DiskRemoved(Message):
    id: str


class DiskCommitAnswer(Message):
    ref: str
    digest: str
    published: bool
    changed_bytes: int
    stored_bytes: int
    uploaded_bytes: int
    parent: str | None
    depth: int = 0  # the layers a disk over this commit reads through
    merged: int = 0  # the layers this commit merged into one (0: it is only what changed)


VM_DRIVE_ROLES = ("meta", "device", "disk")
VM_PMEM = ("shared", "private")  # a vm's layers as pmem files other vms map too, or its own


class VmDrive(Message):
    """One drive of a microVM, as Firecracker's drive API names its fields,
    and its role (:data:`VM_DRIVE_ROLES`): ``meta``, a layer's EROFS meta
    image (the guest's mount source); ``device``, a layer's lazy blob file
    (the mount's ``device=``); ``disk``, the writable disk. ``kind`` ``pmem``:
    a file to map as a virtio-pmem device of ``size`` bytes (else a block
    drive; both left out of the JSON then)."""

    drive_id: str
    path_on_host: str
    is_read_only: bool
    is_root_device: bool = False
    role: str = ""
    kind: str = "block"
    size: int = 0

    def to_json(self) -> dict[str, Any]:
        doc = super().to_json()
        if self.kind == "block":
            del doc["kind"]
        if not self.size:
            del doc["size"]
        return doc


class VmLayer(Message):
    """An env layer of a microVM: its meta image's drive and its blob's."""

    ref: str
    digest: str
    meta_drive: str
    device_drives: list[str]


class VmRam(Message):
    """A vm's guest RAM as a file the VMM maps (``vm up --ram``): a local
    file mapped shared while it runs (what a suspend saves), or on a resumed
    vm the snapshot's RAM served lazily (``ROOT/fuse/disks/ID-ram``, a
    writable disk over it) and mapped shared too, with the device state to
    load (``incoming``). ``qmp``:
    the VMM's QMP socket, which ``vm suspend`` drives."""

    path: str
    size: int
    share: bool
    qmp: str
    incoming: str = ""


class VmRecord(Message):
    """A microVM's drive set: the layers' drives, then its writable disk's.
    Also what ``replica.lmdb`` keeps of it (``state`` starting or up)."""

    id: str
    drives: list[VmDrive]
    layers: list[VmLayer]
    disk: str  # the writable disk's id
    blobs: list[str]  # layer digests whose blob files it holds open
    state: str = "up"  # starting (an up under way), up; broken: not all restored
    created: float = 0.0
    error: str | None = None  # why it is broken
    offline: list[OfflineRef] = field(default_factory=list)  # refs the store did not resolve
    pmem: str = ""  # its layers as pmem drives: shared or private (VM_PMEM); "": block
    ram: VmRam | None = None  # its RAM file (vm up --ram, vm resume)
    snapshot: str = ""  # the ref a vm suspend saved it as (state suspended)

    def to_json(self) -> dict[str, Any]:
        doc = super().to_json()
        for key, empty in (("error", None), ("offline", []), ("pmem", ""), ("ram", None),
                           ("snapshot", "")):
            if doc[key] == empty:
                del doc[key]
        return doc


class VmAnswer(Message):
    vm: VmRecord


class VmPrefetchAnswer(Message):
    ref: str
    chunks: int  # the working set's chunks, now on the node
    bytes: int  # their bytes
    fetched_bytes: int  # of those, fetched from the store by this request


class VmList(Message):
    vms: list[VmRecord]
