"""containerd's snapshotter, served by the node daemon (a proxy plugin).

``layerfs daemon --containerd-snapshotter PATH`` serves containerd's
``containerd.services.snapshots.v1.Snapshots`` gRPC service on the unix
socket ``PATH`` (grpcio, its own threads; the generated code is in
:mod:`.containerd.api`). containerd's metadata store names every snapshot, keeps
its leases and collects its garbage; this backend keeps the snapshots
themselves (:mod:`.containerd.snapstore`: records in the replica) and their files:

* **lazy** — a Prepare whose ``containerd.io/snapshot.ref`` label (the chain
  ID the snapshot is to be committed as) names a chain ``layerfs import``
  indexed (:mod:`layerfs.builder.oci.chains`) becomes at once a committed
  snapshot of that chain's layer mounts (:mod:`.sandboxes.layermounts`, shared with the
  sandboxes; their pushed traces replayed meanwhile, as an ``up``'s default
  ``--prefetch auto`` does) and is answered ALREADY_EXISTS, as remote snapshotters do:
  containerd's unpacker then neither fetches nor applies the layer;
* **plain** — any other Prepare is a directory ``ROOT/snapshots/<n>/fs``
  that containerd's differ unpacks a layer into, committed as it is.

An active snapshot is mounted by containerd as an overlay of its parent's
chain (lazy layer mounts and plain directories, top first) with its own
``fs`` as upper, with the sandboxes' options (:data:`.sandboxes.manager.OVERLAY_OPTIONS`,
``nosuid,nodev``); one without a parent is a bind mount of ``fs``, and a view
is the chain read-only, both ``nosuid,nodev`` too. Errors are containerd's gRPC codes (NOT_FOUND,
ALREADY_EXISTS, FAILED_PRECONDITION, INVALID_ARGUMENT).

The gRPC threads never touch trio's state themselves: layer mounts are
acquired and released on the daemon's loop (``trio.from_thread.run``), which
they wait for without blocking it; records are read and written in LMDB
transactions, file work is done in the gRPC thread. A restarted daemon mounts
(or, after a live restart, adopts) the layers of every lazy snapshot before it
serves, so containers running on them go on reading.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import re
import shutil
import socket
import stat
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import trio
from google.protobuf import empty_pb2, timestamp_pb2
from google.protobuf.message import DecodeError

from ...builder.oci.chains import chain_env, chain_of
from ...errors import LayerfsError, RefNotFound, UsageError
from ...refstore import RefStore
from ...tasks import TaskGroup
from ..containers.bundle import UnsafeBundleDir, open_bundle_dir
from ..protocol import ContainerdSnapshot
from ..reads.prefetch import Prefetcher
from ..reads.tracereplay import TraceReplay
from ..replica.noderefs import NodeRefs
from ..sandboxes.layermounts import LayerMounts
from ..sandboxes.manager import OVERLAY_OPTIONS, distinct
from .api import mount_pb2, snapshots_pb2, snapshots_pb2_grpc
from .snapstore import (
    ACTIVE,
    COMMITTED,
    TARGET_LABEL,
    VIEW,
    SnapshotError,
    SnapshotExists,
    SnapshotInvalid,
    SnapshotPrecondition,
    SnapshotRecord,
    SnapshotStore,
    check_labels,
    check_name,
)

log = logging.getLogger(__name__)
WORKERS = 16  # gRPC threads: containerd unpacks layers and images in parallel
STOP_GRACE = 5.0  # seconds requests in flight get at a stop
KIND_OF = {VIEW: snapshots_pb2.VIEW, ACTIVE: snapshots_pb2.ACTIVE,
           COMMITTED: snapshots_pb2.COMMITTED}
SAFE_OPTIONS = ("nosuid", "nodev")
MAX_LOWERS = 500  # lower directories one overlay stacks (the kernel's OVL_MAX_STACK)
MOUNT_DATA = 4096  # bytes of mount(2) options containerd can pass (a page), its NUL included
UNCARRIED = ",:\\"  # what an overlay lowerdir option cannot carry unescaped
MAX_PS_ROWS = 1000  # snapshots ``ps`` lists (it counts them all)
T = TypeVar("T")


@dataclass(frozen=True)
class MountSpec:
    """A mount containerd makes: mount(2)'s type, source and options."""

    type: str
    source: str
    options: tuple[str, ...]


def disk_usage(path: Path) -> tuple[int, int]:
    """Bytes (blocks) and inodes below ``path``, each inode once (worker thread)."""
    seen: set[int] = set()
    size = 0
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    size += st.st_blocks * 512
    return size, len(seen)


def check_root(root: Path) -> None:
    """Refuse a ROOT whose paths containerd's overlay options would split."""
    bad = sorted(set(str(root)) & set(UNCARRIED))
    if bad:
        raise UsageError(f"--containerd-snapshotter: ROOT {root} holds {''.join(bad)!r}, "
                         "which overlay mount options cannot carry; choose another --root")


def fits_a_page(options: tuple[str, ...]) -> bool:
    """Whether containerd can pass overlay ``options`` to mount(2): under a
    page, or under a page once it writes the lower directories relative to
    their common parent (containerd's ``compactLowerdirOption``)."""
    if sum(len(o) + 1 for o in options) < MOUNT_DATA:
        return True
    lower = next((o for o in options if o.startswith("lowerdir=")), None)
    if lower is None:
        return False
    dirs = lower.removeprefix("lowerdir=").split(":")
    common = posixpath.dirname(os.path.commonprefix(dirs))
    if common in ("", "/"):
        return False
    relative = "lowerdir=" + ":".join(d[len(common) + 1:] for d in dirs)
    return sum(len(o) + 1 for o in options if o != lower) + len(relative) + 1 < MOUNT_DATA


@dataclass
class Flight:
    """One lazy Prepare of a chain on a parent that others of the same wait for.
    ``lazy``: whether layerfs made (or had) the snapshot; None if the first
    failed (each of the others then tries again)."""

    done: threading.Event = field(default_factory=threading.Event)
    lazy: bool | None = None


class Snapshotter:
    """containerd's snapshotter semantics over the replica and the layer mounts.
    Its methods run in gRPC threads; :meth:`restore` on the daemon's loop."""

    def __init__(self, root: Path, store: SnapshotStore, layers: LayerMounts, refs: NodeRefs,
                 refstore: RefStore, policy: Prefetcher, prefetch: str = "auto",
                 tasks: TaskGroup | None = None) -> None:
        self.root = root
        self.policy = policy  # the node's prefetch policy: trace replays hand it their chunks
        self.tasks = tasks or TaskGroup()  # the daemon's: trace replays run in it
        self.dir = root / "snapshots"
        self.store = store
        self.layers = layers
        self.refs = refs
        self.refstore = refstore
        self.prefetch = prefetch  # "auto": pushed traces replayed; "none": lazy only
        self.token: trio.lowlevel.TrioToken | None = None  # the daemon's loop, once serving
        self.held: Counter[str] = Counter()  # layer digest -> lazy snapshots holding it
        self.flights: dict[tuple[str, str], Flight] = {}  # (chain, parent) -> the lazy Prepare
        self.flights_lock = threading.Lock()
        check_root(root)

    # -- on the daemon's loop --
    def _on_loop(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return trio.from_thread.run(fn, *args, trio_token=self.token)

    def _replay(self, digests: list[str]) -> TraceReplay | None:
        """The layers' pushed traces replayed while they are mounted, as an
        ``up``'s default ``--prefetch auto`` does (none pushed: nothing)."""
        if self.prefetch != "auto":
            return None
        return TraceReplay.start_in(self.tasks, self.refstore.store, self.store.replica,
                                    self.policy, digests, pushed_only=True)

    async def _acquire_all(self, digests: list[str], replay: bool = True) -> None:
        """Each layer mounted (in parallel) and held, its pushed trace replayed
        (``replay``); all or none."""
        got: list[str] = []
        failed: list[BaseException] = []
        replaying = self._replay(digests) if replay else None

        async def one(digest: str) -> None:
            try:
                await self.layers.acquire(digest, replaying)
            except Exception as exc:  # noqa: BLE001 - raised below, the first one
                failed.append(exc)
                return
            got.append(digest)
            self.held[digest] += 1

        async with trio.open_nursery() as nursery:
            for digest in digests:
                nursery.start_soon(one, digest)
        if failed:
            if replaying is not None:
                replaying.cancel()
            await self._release_all(got)
            raise failed[0]
        if replaying is not None:
            replaying.settle()  # every layer's table is in

    async def _release_all(self, digests: list[str]) -> None:
        """One hold fewer on each layer (one a failed restore never held: none)."""
        with trio.CancelScope(shield=True):
            for digest in digests:
                if self.held[digest] <= 0:
                    self.held.pop(digest, None)
                    continue
                self.held[digest] -= 1
                if self.held[digest] == 0:
                    del self.held[digest]
                try:
                    await self.layers.release(digest)
                except OSError as exc:
                    log.error("snapshot layer %s stays mounted: %s", digest, exc)

    async def restore(self) -> None:
        """After a (re)start: mount, or adopt, the layers of every lazy snapshot."""
        records = await trio.to_thread.run_sync(self.store.all)
        for record in records:
            if not record.layers:
                continue
            try:
                await self._acquire_all(distinct(record.layers), replay=False)
            except (LayerfsError, OSError) as exc:
                log.error("containerd snapshot %s: its layers cannot be mounted: %s",
                          record.name, exc)

    def ps_rows(self) -> tuple[int, list[ContainerdSnapshot]]:
        """How many snapshots there are, and the first ``MAX_PS_ROWS`` as
        ``ps`` shows them (worker thread); none while stopping."""
        try:
            records = self.store.all()
        except SnapshotError:
            return 0, []
        return len(records), [
            ContainerdSnapshot(r.name, r.kind, r.parent, r.chain, len(distinct(r.layers)),
                               r.created) for r in records[:MAX_PS_ROWS]]

    def in_use(self) -> list[str]:
        """The layers lazy snapshots hold (for the forgetter; on the loop)."""
        return list(self.held)

    # -- the service's operations (gRPC threads) --
    def _fs(self, record: SnapshotRecord) -> Path:
        return self.dir / str(record.id) / "fs"

    def _work(self, record: SnapshotRecord) -> Path:
        return self.dir / str(record.id) / "work"

    def create(self, key: str, parent: str, labels: dict[str, str],
               kind: str) -> list[MountSpec]:
        """Prepare (``active``) or View (``view``) ``key`` on ``parent``."""
        check_name(key)
        if parent:
            check_name(parent, "parent")
        labels = check_labels(labels)
        target = labels.get(TARGET_LABEL, "")
        if kind == ACTIVE and target:
            self._lazy(key, parent, labels, target)  # SnapshotExists if layerfs has it
        now = time.time()
        record = self.store.create(SnapshotRecord(key, kind, 0, parent, labels, now, now))
        try:  # the record first: a Cleanup meanwhile keeps these
            self._fs(record).mkdir(parents=True, exist_ok=True)
            self._work(record).mkdir(exist_ok=True)
            os.chmod(self._fs(record).parent, 0o700)
            return self.mounts_of(record)
        except BaseException:
            self.store.remove(key)
            shutil.rmtree(self._fs(record).parent, ignore_errors=True)
            raise

    def _lazy(self, key: str, parent: str, labels: dict[str, str], target: str) -> None:
        """If layerfs has the chain ``target``: a committed snapshot of its layers
        (or the one there is already for this target and parent), and
        ALREADY_EXISTS; else nothing. Concurrent Prepares of one chain on one
        parent wait for the first one's answer instead of each resolving and
        mounting the chain in turn."""
        while True:
            with self.flights_lock:
                flight = self.flights.get((target, parent))
                leading = flight is None
                if flight is None:
                    flight = self.flights[(target, parent)] = Flight()
            if leading:
                try:
                    flight.lazy = self._make_lazy(key, parent, labels, target)
                finally:
                    with self.flights_lock:
                        del self.flights[(target, parent)]
                    flight.done.set()
            else:
                flight.done.wait()
            if flight.lazy is not None:
                break
        if flight.lazy:
            raise SnapshotExists(f"target snapshot {target}: layerfs has it")

    def _make_lazy(self, key: str, parent: str, labels: dict[str, str], target: str) -> bool:
        """Whether layerfs has (now) a lazy snapshot of chain ``target`` on
        ``parent``: one it made before, or one made now, named ``key``, from
        the layers it verified make that chain."""
        started = time.monotonic()
        layers = self.chain_layers(target)
        if layers is None:
            return False
        if self.store.find_target(target, parent) is not None:
            return True
        wanted = distinct(layers)
        try:
            self._on_loop(self._acquire_all, wanted)
        except (LayerfsError, OSError) as exc:  # the store away, say: not fatal
            log.warning("chain %s: its layerfs layers cannot be mounted (%s); containerd "
                        "unpacks it", target, exc)
            return False
        now = time.time()
        record = SnapshotRecord(key, COMMITTED, 0, parent, labels, now, now, layers=layers,
                                chain=target)
        try:
            kept = self.store.create(record)
        except BaseException:
            self._on_loop(self._release_all, wanted)
            raise
        if kept is not record:
            self._on_loop(self._release_all, wanted)
        else:
            log.info("containerd snapshot %s: chain %s from %d layerfs layer(s), lazily, "
                     "in %.0f ms", key, target, len(wanted), (time.monotonic() - started) * 1000)
        return True

    def chain_layers(self, target: str) -> list[str] | None:
        """The layerfs layers (top first) of the chain ID ``target`` if the
        chain index has it and their recorded diff_ids make that chain; None
        for a chain layerfs has not imported."""
        try:
            env = chain_env(target)
        except ValueError:
            return None
        try:
            layers = self.refs.up_layers(env, []).layers
            chain = chain_of([self.refstore.layer(d) for d in layers])
        except RefNotFound:
            return None
        except (LayerfsError, OSError) as exc:
            log.warning("chain %s: the chain index cannot be read (%s); containerd unpacks it",
                        target, exc)
            return None
        if chain != target:
            log.warning("chain index entry %s holds the layers of chain %s: not used", env, chain)
            return None
        return layers

    def lowers(self, name: str) -> list[str]:
        """The directories of the committed snapshot ``name``'s tree, top
        first; a tree of more than overlayfs stacks is refused."""
        out: list[str] = []
        for record in self.store.lineage(name, MAX_LOWERS):
            if record.layers:
                out += [str(self.root / "layers" / d.removeprefix("sha256:"))
                        for d in distinct(record.layers)]
            else:
                out.append(str(self._fs(record)))
        out = list(dict.fromkeys(out))
        if len(out) > MAX_LOWERS:
            raise SnapshotInvalid(f"snapshot {name}: its tree is more than {MAX_LOWERS} "
                                  f"directories deep; overlayfs stacks at most {MAX_LOWERS}")
        return out

    def mounts_of(self, record: SnapshotRecord) -> list[MountSpec]:
        if record.kind == COMMITTED:
            raise SnapshotPrecondition(f"snapshot {record.name} is committed: it has no mounts")
        lowers = self.lowers(record.parent) if record.parent else []
        options = tuple(f"{k}={v}" for k, v in OVERLAY_OPTIONS) + SAFE_OPTIONS
        if record.kind == ACTIVE:
            if not lowers:
                return [MountSpec("bind", str(self._fs(record)), ("rbind", "rw", *SAFE_OPTIONS))]
            return [overlay(record.name, (
                f"lowerdir={':'.join(lowers)}", f"upperdir={self._fs(record)}",
                f"workdir={self._work(record)}", *options))]
        if not lowers:
            return [MountSpec("bind", str(self._fs(record)), ("rbind", "ro", *SAFE_OPTIONS))]
        if len(lowers) == 1:
            return [MountSpec("bind", lowers[0], ("rbind", "ro", *SAFE_OPTIONS))]
        return [overlay(record.name, (f"lowerdir={':'.join(lowers)}", *options))]

    def mounts(self, key: str) -> list[MountSpec]:
        return self.mounts_of(self.store.get(key))

    def commit(self, name: str, key: str, labels: dict[str, str]) -> None:
        check_name(name, "name")
        labels = check_labels(labels)
        record = self.store.get(key)
        if record.kind != ACTIVE:
            raise SnapshotPrecondition(f"snapshot {key} is not active")
        size, inodes = disk_usage(self._fs(record))
        self.store.commit(key, name, labels, size, inodes)

    def remove(self, key: str) -> None:
        record = self.store.remove(key)
        if record.layers:
            self._on_loop(self._release_all, distinct(record.layers))
        else:
            shutil.rmtree(self.dir / str(record.id), ignore_errors=True)

    def usage(self, key: str) -> tuple[int, int]:
        """A plain committed snapshot's usage as taken at its commit; an active
        one's or a view's now; a lazy one's nothing (its chunks are the node's
        shared cache)."""
        record = self.store.get(key)
        if record.kind == COMMITTED:
            return record.size, record.inodes
        return disk_usage(self._fs(record))

    def cleanup(self) -> int:
        """Remove the directories no snapshot record names (a crash's, a
        Remove's that failed half way); how many."""
        known = {str(n) for n in self.store.ids()}
        removed = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.dir):
                if entry.name not in known and entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed += 1
        return removed

    def list(self, filters: list[str]) -> list[SnapshotRecord]:
        """The snapshots ``filters`` match (any of them); containerd's look-up
        of a lazy chain (a chain and a parent) through the chain index."""
        matchers = [parse_filter(f) for f in filters]
        if len(filters) == 1 and (wanted := chain_wanted(filters[0])) is not None:
            found = self.store.find_target(*wanted)
            return [found] if found is not None and matchers[0](found) else []
        records = self.store.all()
        if not filters:
            return records
        return [r for r in records if any(m(r) for m in matchers)]


def overlay(name: str, options: tuple[str, ...]) -> MountSpec:
    """An overlay mount with ``options``, if containerd can make it."""
    if not fits_a_page(options):
        raise SnapshotInvalid(f"snapshot {name}: its overlay options are more than containerd "
                              f"passes to mount(2) ({MOUNT_DATA} bytes) even with its lower "
                              "directories written relative")
    return MountSpec("overlay", "overlay", options)


# -- containerd's filter syntax, the part its callers use -----------------------------

FILTER_CLAUSE = re.compile(
    r'\s*(?P<field>labels\.(?:"(?:[^"\\]|\\.)*"|[\w./-]+)|name|parent|kind)\s*'
    r'(?P<op>==|!=)\s*(?P<value>"(?:[^"\\]|\\.)*"|[^,]*)\s*(?:,|$)')


def unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return re.sub(r"\\(.)", r"\1", text[1:-1])
    return text


def clauses_of(text: str) -> list[tuple[str, str, str]] | None:
    """A filter's ``(field, op, value)`` clauses, None if it is not of that form."""
    clauses = []
    pos = 0
    while pos < len(text):
        match = FILTER_CLAUSE.match(text, pos)
        if match is None or match.end() == pos:
            return None
        clauses.append((match["field"], match["op"], unquote(match["value"].strip())))
        pos = match.end()
    return clauses


def chain_wanted(text: str) -> tuple[str, str] | None:
    """The chain and parent a filter asks for (containerd's look-up after a
    lazy ALREADY_EXISTS: ``labels."containerd.io/snapshot.ref"==C,parent==P``),
    None for another filter."""
    clauses = clauses_of(text) or []
    equal = {name: value for name, op, value in clauses if op == "=="}
    target = next((v for n, v in equal.items() if n.startswith("labels.")
                   and unquote(n.removeprefix("labels.")) == TARGET_LABEL), None)
    if target is None or "parent" not in equal:
        return None
    return target, equal["parent"]


def parse_filter(text: str) -> Callable[[SnapshotRecord], bool]:
    """A filter (``field==value`` clauses joined by commas, all to hold) as a
    predicate; one that is not of that form matches everything (containerd
    checks what it asked for again). The label ``containerd.io/snapshot.ref``
    is matched against the chain layerfs verified a lazy snapshot holds, never
    against a label a caller set: a snapshot is no chain's because it says so."""
    clauses = clauses_of(text)
    if clauses is None:
        return lambda record: True

    def field_of(record: SnapshotRecord, name: str) -> str | None:
        if name.startswith("labels."):
            label = unquote(name.removeprefix("labels."))
            if label == TARGET_LABEL:
                return record.chain or None
            return record.labels.get(label)
        return {"name": record.name, "parent": record.parent, "kind": record.kind}[name]

    def matches(record: SnapshotRecord) -> bool:
        return all((field_of(record, name) == value) == (op == "==")
                   for name, op, value in clauses)
    return matches


# -- the gRPC service ------------------------------------------------------------------

def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def info_of(record: SnapshotRecord) -> snapshots_pb2.Info:
    return snapshots_pb2.Info(name=record.name, parent=record.parent, kind=KIND_OF[record.kind],
                              created_at=timestamp(record.created),
                              updated_at=timestamp(record.updated), labels=record.labels)


def mounts_pb(mounts: list[MountSpec]) -> list[mount_pb2.Mount]:
    return [mount_pb2.Mount(type=m.type, source=m.source, options=list(m.options))
            for m in mounts]


@dataclass(frozen=True)
class Undecodable:
    """A request protobuf refused (a string field that is not UTF-8, say)."""

    error: str


def decoder(message: Any) -> Callable[[bytes], Any]:
    """``message``'s parser, answering :class:`Undecodable` instead of raising
    (gRPC would log a traceback and answer INTERNAL)."""
    def decode(raw: bytes) -> Any:
        try:
            return message.FromString(raw)
        except DecodeError as exc:
            return Undecodable(str(exc))
    return decode


def add_service(service: SnapshotService, server: grpc.Server) -> None:
    """The Snapshots service's methods on ``server``, as the generated
    ``add_SnapshotsServicer_to_server`` adds them, with :func:`decoder`'s parsers."""
    described = snapshots_pb2.DESCRIPTOR.services_by_name["Snapshots"]
    handlers = {}
    for method in described.methods:
        request = getattr(snapshots_pb2, method.input_type.name)
        reply = (empty_pb2.Empty if method.output_type.full_name == "google.protobuf.Empty"
                 else getattr(snapshots_pb2, method.output_type.name))
        make = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = make(getattr(service, method.name),
                                     request_deserializer=decoder(request),
                                     response_serializer=reply.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        described.full_name, handlers),))


class SnapshotService(snapshots_pb2_grpc.SnapshotsServicer):
    """The gRPC face of :class:`Snapshotter`: requests in, answers or status codes out.
    Every call holds the records' gate (:class:`.containerd.snapstore.Gate`) while it runs."""

    def __init__(self, snapshotter: Snapshotter) -> None:
        self.sn = snapshotter

    @contextlib.contextmanager
    def answering(self, context: grpc.ServicerContext, what: str,
                  request: Any) -> Iterator[None]:
        started = time.time()
        try:
            with self._answering(context, what, request):
                yield
        finally:
            log.debug("containerd %s: answered in %.1f ms (asked at %.6f)", what,
                      (time.time() - started) * 1000, started)

    @contextlib.contextmanager
    def _answering(self, context: grpc.ServicerContext, what: str,
                   request: Any) -> Iterator[None]:
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request: "
                          f"{request.error}")
        try:
            with self.sn.store.gate:
                yield
        except SnapshotError as exc:
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        except trio.RunFinishedError:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the layerfs daemon is stopping")
        except (LayerfsError, OSError, ValueError) as exc:
            if self.sn.store.gate.closed:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the layerfs daemon is stopping")
            log.error("containerd %s failed: %s", what, exc)
            context.abort(grpc.StatusCode.UNKNOWN, f"{what}: {exc}")

    def Prepare(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        with self.answering(context, f"prepare {getattr(request, 'key', '')}", request):
            mounts = self.sn.create(request.key, request.parent, dict(request.labels), ACTIVE)
            return snapshots_pb2.PrepareSnapshotResponse(mounts=mounts_pb(mounts))

    def View(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        with self.answering(context, f"view {getattr(request, 'key', '')}", request):
            mounts = self.sn.create(request.key, request.parent, dict(request.labels), VIEW)
            return snapshots_pb2.ViewSnapshotResponse(mounts=mounts_pb(mounts))

    def Mounts(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        with self.answering(context, f"mounts of {getattr(request, 'key', '')}", request):
            return snapshots_pb2.MountsResponse(mounts=mounts_pb(self.sn.mounts(request.key)))

    def Commit(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        with self.answering(context, f"commit {getattr(request, 'key', '')}", request):
            self.sn.commit(request.name, request.key, dict(request.labels))
            return empty_pb2.Empty()

    def Remove(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        with self.answering(context, f"remove {getattr(request, 'key', '')}", request):
            self.sn.remove(request.key)
            return empty_pb2.Empty()

    def Stat(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        with self.answering(context, f"stat {getattr(request, 'key', '')}", request):
            return snapshots_pb2.StatSnapshotResponse(
                info=info_of(self.sn.store.get(request.key)))

    def Update(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        info = getattr(request, "info", None)
        with self.answering(context, f"update {getattr(info, 'name', '')}", request):
            record = self.sn.store.update_labels(request.info.name, dict(request.info.labels),
                                                 list(request.update_mask.paths))
            return snapshots_pb2.UpdateSnapshotResponse(info=info_of(record))

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        with self.answering(context, "list", request):
            records = self.sn.list(list(request.filters))
        for start in range(0, len(records), 100):  # containerd's own batches
            yield snapshots_pb2.ListSnapshotsResponse(
                info=[info_of(r) for r in records[start:start + 100]])

    def Usage(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        with self.answering(context, f"usage of {getattr(request, 'key', '')}", request):
            size, inodes = self.sn.usage(request.key)
            return snapshots_pb2.UsageResponse(size=size, inodes=inodes)

    def Cleanup(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        with self.answering(context, "cleanup", request):
            removed = self.sn.cleanup()
            if removed:
                log.info("containerd cleanup: %d snapshot director(ies) removed", removed)
            return empty_pb2.Empty()


def answers(path: Path) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


class SnapshotServer:
    """The service on its unix socket, in gRPC's threads."""

    def __init__(self, snapshotter: Snapshotter, path: Path) -> None:
        self.snapshotter = snapshotter
        self.path = path
        self.server: grpc.Server | None = None

    def bind(self) -> None:
        """Listen at ``path`` (a stale socket there replaced), answering
        nothing until :meth:`start`; a path it cannot listen at is a
        UsageError, before the daemon serves anything."""
        server = grpc.server(ThreadPoolExecutor(WORKERS, thread_name_prefix="snapshots"))
        add_service(SnapshotService(self.snapshotter), server)
        self._check_place()
        try:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                    if answers(self.path):
                        raise UsageError(f"--containerd-snapshotter {self.path}: another "
                                         "process serves it")
                    self.path.unlink()  # a crashed daemon's
            bound = server.add_insecure_port(f"unix:{self.path}")
        except (OSError, RuntimeError) as exc:
            raise UsageError(f"--containerd-snapshotter {self.path}: cannot listen there "
                             f"({exc})") from None
        if not bound:
            raise UsageError(f"--containerd-snapshotter {self.path}: cannot listen there")
        os.chmod(self.path, 0o600)  # containerd runs as root; nobody else, from the bind on
        self.server = server

    def _check_place(self) -> None:
        """The socket's directory made (0700) where missing, and refused where
        a user other than root could change it (rename the socket and bind
        one of their own there): as ``up --bundle`` checks its directory."""
        try:
            fd = open_bundle_dir(str(self.path.parent))
        except UnsafeBundleDir as exc:
            raise UsageError(f"--containerd-snapshotter {self.path}: cannot listen there: "
                             f"{exc.args[1]} (the directories above a socket root trusts "
                             "must be root's alone)") from None
        except OSError as exc:
            raise UsageError(f"--containerd-snapshotter {self.path}: cannot listen there "
                             f"({exc.strerror or exc})") from None
        if fd is not None:
            os.close(fd)

    def start(self, token: trio.lowlevel.TrioToken) -> None:
        """Answer containerd, calling into the daemon's loop ``token`` (worker thread)."""
        assert self.server is not None
        self.snapshotter.token = token
        self.server.start()
        log.info("containerd snapshotter at %s", self.path)

    def stop(self) -> None:
        """Stop answering (requests in flight get ``STOP_GRACE``, then as long
        again to leave the records: none is read or written after), socket
        removed."""
        if self.server is None:
            return
        self.server.stop(STOP_GRACE).wait()
        self.server = None
        left = self.snapshotter.store.gate.close(STOP_GRACE)
        if left:
            log.warning("containerd snapshotter stopped with %d call(s) still running", left)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
