"""The node daemon: owns ROOT, serves the FUSE mount and the control API.

Start-up: with ``--takeover``, stop the daemon serving ROOT without
unmounting anything (SIGUSR2) and wait until it has exited; without, refuse
to start next to one. Then take the FUSE connection from its keeper
(:mod:`.fuse.connection`, :mod:`.fuse.keeper`) if one still holds it: every mount under
ROOT is kept and adopted. Otherwise unmount whatever an earlier (crashed)
daemon left mounted under ROOT, and mount FUSE afresh with a new keeper.
Close ROOT to other users (:func:`secure_root`, on an existing ROOT too),
check that ROOT can host file-backed EROFS mounts at all
(:func:`probe_erofs_mounts`), keep the cache (its bound lowered to the room
ROOT's file system has, less a reserve, and the held space taken:
:mod:`.sandboxes.rootspace`) and the replica, bring back the
sandboxes that were up (adopting their mounts, or mounting them again, or
marking them lost), the writable disks and the microVM drive sets, then
accept requests. None of this waits for the store:
a node whose store is down starts and serves what its replica holds, and
:class:`.replica.storehealth.StoreHealth` probes the store in the background.
SIGTERM/SIGINT: stop accepting work, unmount overlays, then EROFS mounts,
then FUSE, end the keeper, and exit 0. SIGUSR2 (a successor's
``--takeover``), or a SIGTERM that is the stop half of a ``systemctl restart`` of the daemon's unit
(:func:`.daemon.systemd.restart_queued`): stop reading FUSE requests and exit 0
with every mount left in place; requests read and not answered are queued
again by the successor. Under systemd (``Type=notify``) the daemon reports
READY once it accepts requests, its sandbox count as STATUS, and STOPPING
(:class:`.daemon.systemd.Notifier`). A daemon that fails (an exception out of
its loop) leaves its mounts and the keeper as a crash does, for the next one.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from ... import fanotify
from ...errors import LayerfsError, RefNotFound, UsageError
from ...formats.erofs import write_meta_image
from ...leases import Holder
from ...mounts import (
    fs_type,
    mount_erofs,
    mounts_under,
    set_fuse_background,
    set_readahead,
    umount,
)
from ...refstore import LAYERS, RefStore
from ...sizes import NO_SPACE, mib
from ...store import open_store
from ...store.counting import CountingStore
from ...tasks import TaskGroup
from ...tree import FileTree
from .. import protocol
from ..containerd.snapstore import SnapshotStore
from ..control import DEFAULT_ROOT, DaemonNotRunning, call, socket_path
from ..fuse import connection as fuseconn
from ..fuse.keeperlink import KeeperLink
from ..reads.accesstraces import merge_traces, trace_bytes, trace_key
from ..reads.blobfiles import BlobDirectory
from ..reads.chunkcache import ChunkCache
from ..reads.fetcher import ChunkFetcher
from ..reads.fetcher import log as fetch_log
from ..reads.localblobs import LocalBlobs
from ..reads.partialblobs import PartialBlobs, reads_holes, unguarded_layers
from ..reads.prefetch import Prefetcher
from ..reads.tracereplay import pushed_trace
from ..replica.leaser import Leaser, node_holders, node_id
from ..replica.metacheck import MetaChecker
from ..replica.noderefs import NodeRefs
from ..replica.replica import Replica
from ..replica.storehealth import (
    DEFAULT_STORE_WAIT,
    PROBE_TIMEOUT,
    StoreHealth,
    control_store,
    probe_store,
)
from ..sandboxes.dataloss import DataLoss, NodeUsers
from ..sandboxes.layermounts import LayerMounts
from ..sandboxes.manager import Sandboxes
from ..sandboxes.rootspace import RootSpace, fs_usage, no_room_for
from ..vms.disks import DiskManager
from ..vms.drivesets import Vms
from ..vms.pmem import PmemDirectory
from . import events, systemd
from .controlserver import ControlServer
from .forget import LayerForgetter
from .metrics import (
    CountingLog,
    MeteredFS,
    MetricsAddress,
    MetricsServer,
    NodeMetrics,
    NodeReadings,
    listen,
)

log = logging.getLogger(__name__)
ROOT_ONLY_DIRS = ("blobs", "cache", "fuse", "layers", "sandboxes", "disks", "snapshots",
                  "replica.lmdb")
PROBE = ".mount-probe"
# allow_other: root's own mounts and loop devices are not the daemon's
# process; default_permissions: the kernel enforces NodeFS's modes
FUSE_OPTIONS = frozenset({*pyfuse3.default_options, "fsname=layerfs", "allow_other",
                          "default_permissions", "nosuid", "nodev"})
HANDOVER = signal.SIGUSR2  # a successor takes the FUSE connection: exit, unmount nothing
# the requests that change what the node holds: its lease is renewed after each
LEASE_CHANGES = frozenset({protocol.Up, protocol.Down, protocol.DiskCreate, protocol.DiskRm,
                           protocol.DiskCommit, protocol.VmUp, protocol.VmDown})
RETIRE_TIMEOUT = 60.0  # seconds a --takeover waits for the running daemon to exit
KEEPER_RESTART_INTERVAL = 10.0  # a keeper dying again this soon after a restart is left dead
RESTARTS = "restarts"  # the replica's counter of live restarts (a FUSE connection taken over)


class RootUnsuitable(LayerfsError):
    """ROOT {} ({}) cannot host file-backed EROFS mounts ({}): put it on a disk file system \
such as ext4 or xfs"""

    exit_code = 2


class DaemonRunning(LayerfsError):
    """a layerfs daemon (pid {}) already serves {}: stop it first, or replace it with \
`layerfs daemon --takeover`"""

    exit_code = 2


class RetireFailed(LayerfsError):
    """the running daemon (pid {}) did not exit within {:.0f} s of the takeover signal"""

    exit_code = 1


@dataclass
class DaemonConfig:
    root: str = DEFAULT_ROOT
    store_url: str | None = None
    s3_endpoint: str | None = None
    cache_size: int = 20 << 30
    cache_form: str = "stored"  # a compressed chunk cached as its zstd frame, or "plain"
    read_timeout: float = 30.0
    store_wait: float = DEFAULT_STORE_WAIT  # seconds an up waits for the store before falling back
    lease_ttl: float = 600.0  # seconds the node's lease in the store outlives its last renewal
    fetch_parallel: int = 16
    fuse_background: int = 64  # background FUSE requests in flight (the kernel's default: 12)
    readahead: int = 4 << 20  # kernel readahead window of the blob and disk files
    layer_readahead: int = 1 << 20  # kernel readahead window of the EROFS layer mounts
    miss_span: int = 0  # a small chunk's miss fetches the chunks after it, up to this
    library_ahead: bool = True  # an ELF file's miss fetches the libraries it names, and theirs
    fetch_whole_below: int = 32 << 20  # a layer this small is fetched whole into a local file
    local_blobs: int = 4 << 30  # bound of those files (ROOT/blobs) no mount uses
    kernel_reads: bool = False  # larger layers over partial files (fanotify), where it can be
    fuse_group: int | None = None  # a gid that may open ROOT/fuse files besides root (a VMM's)
    takeover: bool = False  # replace the daemon serving ROOT, keeping its FUSE connection
    live_restart: bool = True  # keep the FUSE connection in a keeper (else libfuse mounts it)
    restart_grace: float = 60.0  # seconds the keeper waits for a next daemon after this one
    reserve: int | None = None  # bytes of ROOT's file system the cache leaves free (None: 5%)
    forget_after: float | None = None  # forget a layer no sandbox used for this long (seconds)
    metrics: MetricsAddress | None = None  # where /metrics is served (None: not served)
    containerd_snapshotter: str | None = None  # the socket of containerd's snapshots API
    containerd_prefetch: str = "auto"  # lazy snapshots replay pushed traces ("none": not)


def secure_root(root: Path, fuse_group: int | None, fuse_mounted: bool = False) -> None:
    """ROOT and its directories belong to root and are closed to other users,
    whatever modes an existing ROOT had. Nobody else needs to traverse ROOT:
    runtimes start as root and enter a sandbox's rootfs themselves, and the
    kernel's overlay and EROFS mounts reach their directories with the
    mounter's credentials. With a FUSE group, its members may traverse ROOT
    and ``meta/`` (0710) to open the meta images and FUSE files that
    ``vm up`` names, and nothing else. A FUSE mount taken over is left alone:
    nothing serves it yet (a chown would wait forever), and its root's modes
    are NodeFS's anyway."""
    group, traverse = (0, 0o700) if fuse_group is None else (fuse_group, 0o710)
    root.mkdir(parents=True, exist_ok=True)
    restrict(root, group, traverse)
    (root / "meta").mkdir(exist_ok=True)
    restrict(root / "meta", group, traverse)
    for name in ROOT_ONLY_DIRS:
        if fuse_mounted and name == "fuse":
            continue
        (root / name).mkdir(exist_ok=True)
        restrict(root / name, 0, 0o700)


def restrict(path: Path, gid: int, mode: int) -> None:
    os.chown(path, 0, gid)
    os.chmod(path, mode)


def probe_erofs_mounts(root: Path) -> None:
    """Mount a tiny EROFS image from ``ROOT/meta`` for real, then unmount it.
    Some file systems cannot back a file-backed EROFS mount: on tmpfs, every
    layer mount would fail with "Block device required" (its files have no
    page-cache read path the kernel's EROFS can use)."""
    image, target = root / "meta" / f"{PROBE}.erofs", root / "layers" / PROBE
    image.write_bytes(write_meta_image(FileTree(), 0, 20))  # an empty tree, 1 MiB chunks
    target.mkdir(exist_ok=True)
    try:
        mount_erofs(str(image), None, str(target))
    except OSError as exc:
        raise RootUnsuitable(root, fs_type(root / "meta"), os.strerror(exc.errno or 0)) from None
    else:
        umount(str(target))
    finally:
        image.unlink(missing_ok=True)
        target.rmdir()


def clean_stale_mounts(root: Path) -> int:
    """Detach what an earlier daemon left mounted below ROOT; ROOT itself may be
    a mount point (a file system of its own) and stays."""
    count = 0
    for point in mounts_under(root):
        if point == str(root.resolve()):
            continue
        try:
            umount(point, lazy=True)
            count += 1
            log.warning("unmounted stale %s", point)
        except OSError as exc:
            log.error("cannot unmount stale %s: %s", point, exc)
    return count


def retire_running(root: Path, takeover: bool) -> None:
    """With ``takeover``, make the daemon serving ``root`` exit without
    unmounting anything and wait until it has; without, refuse to start next
    to one. Nothing to do when none answers."""
    try:
        pid = call(root, protocol.Ping(), protocol.PingAnswer, timeout=10).pid
    except (DaemonNotRunning, OSError):
        return
    if not takeover:
        raise DaemonRunning(pid, root)
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        log.info("taking over from the running daemon (pid %d)", pid)
        signal.pidfd_send_signal(pidfd, HANDOVER)
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        if not poller.poll(RETIRE_TIMEOUT * 1000):
            raise RetireFailed(pid, RETIRE_TIMEOUT)
    finally:
        os.close(pidfd)


def cap_cache(cache: ChunkCache, space: RootSpace) -> None:
    """Lower the cache's bound to what ROOT's file system has room for (its
    free space and the cache's own files, less the reserve), in one warning
    (the node caches less than its operator asked for)."""
    wanted, cached = cache.limit, cache.stats.size
    room = space.cache_room(cached)
    if room >= wanted:
        return
    cache.cap(room)
    usage = fs_usage(space.root)
    log.warning("cache bound lowered from %s (--cache-size) to %s: ROOT's file system has %s "
                "free of %s and the cache %s, less a reserve of %s (--reserve)", mib(wanted),
                mib(cache.limit), mib(usage.free), mib(usage.total), mib(cached),
                mib(space.reserve))


def kept_mounts(root: Path) -> set[str]:
    """What a taken-over connection keeps mounted below ROOT (besides FUSE)."""
    return set(mounts_under(root)) - {str(root), str(root / "fuse")}


# botocore's INFO line at every start with the credentials in the environment
# ("Found credentials in environment variables"): kept for --log-level debug
QUIET_LOGGERS = ("botocore.credentials",)


class Daemon:
    @classmethod
    def start(cls, cfg: DaemonConfig) -> Daemon:
        """The host's steps of a start, in order, then the daemon composed on
        them: retire the daemon serving ROOT (``--takeover``) or refuse to start
        next to one; take the FUSE connection from its keeper, or else unmount
        what a crashed daemon left; close ROOT to others; check that it can
        host EROFS mounts."""
        if not logging.getLogger().isEnabledFor(logging.DEBUG):
            for name in QUIET_LOGGERS:
                logging.getLogger(name).setLevel(logging.WARNING)
        root = Path(cfg.root).resolve()
        retire_running(root, cfg.takeover)
        # the keeper's, if a daemon died or retired
        taken = fuseconn.take_over(root, cfg.restart_grace) if cfg.live_restart else None
        group = taken.fd if isinstance(taken, fuseconn.KeptGroup) else None
        conn = taken if isinstance(taken, fuseconn.FuseConnection) else None
        unguarded = {}
        if conn is None:
            if group is None:  # a crashed daemon's partial layers lost their group too
                unguarded = unguarded_layers(root, mounts_under(root))
            clean_stale_mounts(root)  # a crashed daemon's mounts (dead FUSE included)
        secure_root(root, cfg.fuse_group, fuse_mounted=conn is not None)
        probe_erofs_mounts(root)
        return cls(cfg, root, conn, group, unguarded)

    def __init__(self, cfg: DaemonConfig, root: Path,
                 conn: fuseconn.FuseConnection | None, group: int | None = None,
                 unguarded: dict[str, list[tuple[int, int]]] | None = None) -> None:
        """The daemon's parts, each given what it needs when it is made, in
        order (nothing is set on a part afterwards), on a ROOT made ready by
        :meth:`start` (``conn``: the FUSE connection it took over, if any;
        ``group``: a lingering keeper's pre-content group, if any;
        ``unguarded``: the layers a crashed daemon's mounts read unguarded)."""
        self.cfg = cfg
        self.root = root
        self.conn = conn
        self.unguarded = unguarded or {}
        self.tasks = TaskGroup()  # opened by the loop (_main): background work runs in it
        self.metrics = NodeMetrics()
        self.store = CountingStore(open_store(cfg.store_url, s3_endpoint=cfg.s3_endpoint,
                                              must_exist=True))
        self.checker = MetaChecker()  # meta images are checked in processes of their own
        self.space = RootSpace(self.root, cfg.reserve)
        self.replica = Replica(self.root, check_meta=self.checker.check,
                               make_room=self.space.release)
        # manifests held: no store
        self.refstore = RefStore(self.store, local=self.replica.manifest)
        self.health = StoreHealth(self.store.url, lambda: probe_store(open_store(
            cfg.store_url, s3_endpoint=cfg.s3_endpoint, timeout=PROBE_TIMEOUT, must_exist=True)))
        self.cache = ChunkCache(self.root / "cache", cfg.cache_size,
                                compressed=cfg.cache_form == "stored")
        cap_cache(self.cache, self.space)
        self.space.take()
        metered = cfg.metrics is not None  # what has no counter of its own is observed
        # sandboxes and vms whose layer data the store lost (the parts it asks are made below)
        self.dataloss = DataLoss(NodeUsers(
            tables=lambda: [(b.digest, b.table.packs()) for b in self.blobs.by_name.values()],
            sandboxes=lambda: self.sandboxes.records.values(),
            vms=lambda: self.vms.records.values()),
            counted=lambda layer: self.metrics.data_lost.labels(layer).inc(),
            replica=self.replica)
        self.fetcher = ChunkFetcher(
            self.store, self.cache, timeout=cfg.read_timeout, parallel=cfg.fetch_parallel,
            tasks=self.tasks,
            store_log=CountingLog(fetch_log, self.metrics.store_errors) if metered else None,
            fetch_timed=self.metrics.fetch_seconds.observe if metered else None,
            pack_missing=self.dataloss.pack_missing)
        # the core never calls it
        self.policy = Prefetcher(self.fetcher, cfg.miss_span, self.tasks, cfg.library_ahead)
        self.blobs = BlobDirectory(self.policy)
        # refs resolved through the store or, while it is away, the node's last resolution
        control = control_store(CountingStore(open_store(
            cfg.store_url, s3_endpoint=cfg.s3_endpoint, must_exist=True), self.store),
            cfg.store_wait)
        self.refs = NodeRefs(self.refstore, self.replica, self.health,
                             RefStore(control, local=self.replica.manifest), cfg.store_wait)
        self.disks = DiskManager(self.root, self.refs, self.replica, self.blobs, self.fetcher)
        self.pmem = PmemDirectory()  # blobs padded for a VMM to map (vm up --pmem)
        # (counting the reads it answers with an error, for the metrics)
        self.fs = MeteredFS(self.blobs, self.disks, cfg.fuse_group, self.pmem)
        self.local_blobs = LocalBlobs(self.root, self.fetcher, cfg.fetch_whole_below,
                                      cfg.local_blobs)
        self.local_blobs.prepare()
        self.partial_blobs = self._partial_blobs(conn, group)
        self.layers = LayerMounts(
            self.root, self.refstore, self.replica, self.blobs, self.fetcher,
            readahead=cfg.layer_readahead, local=self.local_blobs, partial=self.partial_blobs,
            kept=kept_mounts(self.root) if self.conn is not None else None)
        self.sandboxes = Sandboxes(self.root, self.refs, self.replica, self.layers, self.policy,
                                   self.tasks)
        self.vms = Vms(self.root, self.refs, self.replica, self.blobs, self.fetcher,
                       self.disks, self.pmem, self.tasks)
        self.snapshots: SnapshotServer | None = None
        if cfg.containerd_snapshotter:
            # grpcio (1.81 and later) restarts its poller in a forked child, and a
            # child that closes its descriptors before exec (subprocess's
            # close_fds) can then abort on EBADF before its program runs
            # (grpc/grpc#43055; seen once in this suite). This daemon forks
            # (meta checkers, runc, mounts) while it serves gRPC.
            os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
            from ..containerd.snapshotter import (  # grpc: only when served
                SnapshotServer,
                Snapshotter,
            )

            snapshotter = Snapshotter(self.root, SnapshotStore(self.replica), self.layers,
                                      self.refs, self.refstore, self.policy,
                                      cfg.containerd_prefetch, self.tasks)
            self.snapshots = SnapshotServer(snapshotter,
                                            Path(cfg.containerd_snapshotter).absolute())
            self.snapshots.bind()
        self.handlers = self._handlers()
        # (a store of its own: its requests are not the up's, not counted in stats)
        self.leaser = Leaser(control_store(open_store(cfg.store_url, s3_endpoint=cfg.s3_endpoint,
                                                      must_exist=True), cfg.store_wait),
                             self.replica, node_id(self.root), cfg.lease_ttl, self._holders)
        # live restarts so far, this one included (a crashed or retired daemon's connection)
        self.restarts = (self.replica.count(RESTARTS) if self.conn is not None
                         else self.replica.counter(RESTARTS))
        self.metrics_server: MetricsServer | None = None
        if cfg.metrics is not None:
            self._serve_metrics(cfg.metrics)
        self.notifier = systemd.Notifier()  # READY, STATUS, STOPPING for systemd (Type=notify)
        self.accepting = False
        # a SIGTERM/SIGINT stop: FUSE unmounted and the keeper let go at the end; a
        # handover, or a daemon that fails, leaves both to the next daemon (as a crash does)
        self.stopping = False

    def _partial_blobs(self, conn: fuseconn.FuseConnection | None,
                       kept: int | None) -> PartialBlobs | None:
        """Partial files for larger layers, with the pre-content group the
        keeper keeps (a taken-over connection's, a lingering keeper's, or a
        new one); None without live restart (no keeper would outlive a
        crash), with ``--no-kernel-reads`` (unless a group was kept: its marked
        files may still be read, and its events are answered), or where the
        kernel has no such group."""
        if not self.cfg.live_restart:
            return None
        if conn is not None:
            group = conn.group
        elif kept is not None:
            group = kept  # (kept and read even with --no-kernel-reads: marked files are read)
        elif not self.cfg.kernel_reads:
            return None
        else:
            try:
                group = fanotify.new_group()
            except OSError as exc:
                log.info("larger layers are read through FUSE files: %s", exc)
                return None
        if group is None:
            return None
        partial = PartialBlobs(self.root, self.fetcher, group, self.cfg.cache_size, self.tasks,
                               make_room=self._make_room)
        partial.prepare()
        return partial

    def _read_holes(self) -> list[str]:
        """The layers a crashed daemon's mounts read unguarded where the node
        held no data (their sandboxes restored: their tables known)."""
        blobs = [(self.blobs.by_name.get(hex_), holes) for hex_, holes in self.unguarded.items()]
        return [blob.digest for blob, holes in blobs
                if blob is not None and reads_holes(blob, holes)]

    def _make_room(self, nbytes: int) -> bool:
        """Worker thread: room on a full ROOT for a partial file's fill: the
        chunk cache's least recently used files, else the held space."""
        return self.cache.make_room(nbytes) or self.space.release()

    def _serve_metrics(self, address: MetricsAddress) -> None:
        """Serve /metrics in a thread."""
        self.metrics.read_from(NodeReadings(
            cache=self.cache.snapshot,
            sandboxes=lambda: len(self.sandboxes.records),
            restarts=lambda: self.restarts,
            layer_bytes_read=lambda: {d: m.blob.bytes_read
                                      for d, m in dict(self.layers.mounted).items()},
            sandbox_states=lambda: events.count_states(list(self.sandboxes.records.values())),
            store_reachable=lambda: self.health.reachable,
            read_errors=lambda: dict(self.fs.read_errors)))
        try:
            self.metrics_server = MetricsServer(listen(address), self.metrics.text)
        except OSError as exc:
            raise UsageError(f"--metrics {address.host}:{address.port}: cannot listen there "
                             f"({exc.strerror or exc})") from None
        log.info("metrics at http://%s:%d/metrics", address.host, address.port)

    def run(self) -> None:
        if not self.cfg.live_restart:  # libfuse mounts and unmounts; no keeper
            pyfuse3.init(self.fs, str(self.root / "fuse"), set(FUSE_OPTIONS))
            trio.run(self._main)
            return
        conn = self.conn or fuseconn.mount_fresh(self.root / "fuse")
        if self.partial_blobs is not None:
            conn.group = self.partial_blobs.group  # the keeper keeps it with the connection
        try:
            fuseconn.attach(self.fs, conn, set(FUSE_OPTIONS))
        except BaseException:
            umount(str(self.root / "fuse"), lazy=True)
            raise
        self.conn = conn
        trio.run(self._main)

    async def _keep_connection(self, conn: fuseconn.FuseConnection) -> bool:
        """Requests a dead predecessor had read are queued again (before the
        first await: before the FUSE loop reads anything), and a fresh
        connection gets a keeper; False if live restart is unavailable (this
        kernel cannot resend: a restart detaches the sandboxes as before)."""
        if not fuseconn.resend_pending(conn):
            log.warning("live restart unavailable: this kernel has no FUSE_NOTIFY_RESEND "
                        "(Linux 6.9); a daemon restart detaches and remounts the sandboxes")
            return False
        if conn.taken_over:
            log.info("took over the FUSE connection; its pending requests are queued again")
            kept = True
        else:
            kept = await self._start_keeper(conn)
        if kept and self.partial_blobs is not None and self.cfg.kernel_reads:
            self.partial_blobs.serve()
        return kept

    async def _start_keeper(self, conn: fuseconn.FuseConnection) -> bool:
        """A keeper of ``conn`` holding this daemon's lease (started in a
        thread: it waits until the keeper listens)."""
        try:
            scope = systemd.keeper_command if systemd.in_service() else None
            keeper = await trio.to_thread.run_sync(fuseconn.start_keeper, self.root, conn,
                                                   self.cfg.restart_grace, scope)
        except OSError as exc:
            log.warning("live restart unavailable: cannot start the FUSE keeper: %s", exc)
            return False
        log.info("live restart: the FUSE connection is kept by pid %d", keeper.pid)
        return True

    async def _replace_dead_keepers(self, conn: fuseconn.FuseConnection) -> None:
        """For the daemon's life: a keeper that dies (its lease reads end of
        file: killed, say, by the OOM killer) is replaced by a new one holding
        the same open file, so that the next crash is survived too; one that
        dies again within KEEPER_RESTART_INTERVAL is not (the connection
        itself may be gone)."""
        replaced = -KEEPER_RESTART_INTERVAL
        link = KeeperLink(conn, self.partial_blobs, self.tasks)  # and its pre-content events
        while conn.lease is not None:
            await trio.lowlevel.wait_readable(conn.lease)
            if conn.lease is None:
                return
            if link.read() or conn.lease is None:
                continue
            if self.stopping:
                return
            conn.lease.close()
            conn.lease = None
            failed = await link.forget_keeper()
            lost = f" ({failed} reads it had not answered failed: EIO)" if failed else ""
            if trio.current_time() - replaced < KEEPER_RESTART_INTERVAL:
                log.error("the FUSE keeper exited again: live restart is unavailable until "
                          "this daemon restarts%s", lost)
                return
            replaced = trio.current_time()
            log.warning("the FUSE keeper exited; starting another%s", lost)
            await self._start_keeper(conn)

    def _forgetter(self, forget_after: float) -> LayerForgetter:
        """Forgets the layers no sandbox, and no vm or disk, used for ``forget_after``
        (while a vm is up, nothing)."""
        def in_use() -> list[str]:
            named = [d for r in self.sandboxes.records.values() for d in r.layers]
            if self.snapshots is not None:  # containerd's lazy snapshots'
                named += self.snapshots.snapshotter.in_use()
            return named + ["sha256:" + name for name in self.blobs.users]  # (vms', disks')
        return LayerForgetter(self.replica, self.cache, self.layers, in_use, forget_after,
                              paused=lambda: bool(self.vms.records))

    async def _main(self) -> None:
        started = time.monotonic()
        ending, kept = events.FAILED, (0, 0)  # how it ends, and the (sandboxes, vms) then
        try:
            async with self.tasks.open() as nursery:
                nursery.start_soon(self._serve_fuse)
                nursery.start_soon(self.health.watch)  # never waited for: serve without it
                if self.metrics_server is not None:
                    nursery.start_soon(self.metrics_server.serve)
                if self.conn is not None and await self._keep_connection(self.conn):
                    nursery.start_soon(self._replace_dead_keepers, self.conn)
                await self._set_readahead()
                await trio.to_thread.run_sync(self.checker.start)
                await self.sandboxes.restore()
                self.dataloss.read_unguarded(self._read_holes())
                if self.snapshots is not None:
                    await self.snapshots.snapshotter.restore()
                await self.layers.drop_unadopted()
                await self.disks.restore()
                await self.vms.restore()  # after the disks: a vm's writable disk is one
                self.fs.restored.set()
                if self.partial_blobs is not None:
                    self.partial_blobs.restored.set()
                nursery.start_soon(self.leaser.run)  # (what was restored is held)
                if self.cfg.forget_after is not None:
                    nursery.start_soon(self._forgetter(self.cfg.forget_after).run)
                await nursery.start(ControlServer(self.root, self.handle).serve)
                if self.snapshots is not None:
                    await trio.to_thread.run_sync(self.snapshots.start,
                                                  trio.lowlevel.current_trio_token())
                self.accepting = True
                events.ready(str(self.root), self.store.url, self.sandboxes.records.values(),
                             len(self.vms.records), time.monotonic() - started)
                self.notifier.ready(self._status())
                signum = await wait_for_signal()
                self.accepting = False
                kept = (len(self.sandboxes.records), len(self.vms.records))
                self.notifier.stopping("stopping")
                if signum == signal.SIGTERM and await trio.to_thread.run_sync(
                        systemd.restart_queued):
                    log.info("systemd restarts the daemon: the next one takes the FUSE "
                             "connection over")
                    signum = HANDOVER
                await self._stop_snapshots()
                ending = events.HANDED_OVER if signum == HANDOVER else events.UNMOUNTED
                if signum == HANDOVER:
                    log.info("handing the FUSE connection over: exiting, nothing unmounted")
                    self.notifier.set_status("handing the FUSE connection over")
                else:
                    self.notifier.set_status("stopping: unmounting sandboxes and layers")
                    self.stopping = True
                    log.info("stopping: unmounting sandboxes and layers")
                    await self.sandboxes.stop()
                    await self.layers.unmount_all()
                    await self.disks.close_all()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._stop_snapshots()
            pyfuse3.close(unmount=self.conn is None)
            if self.conn is not None and self.stopping:
                self._unmount_fuse()
                fuseconn.let_go(self.conn)
            Path(socket_path(self.root)).unlink(missing_ok=True)
            self.checker.close()
            self.replica.close()
            self.store.close()
            self.refs.control.store.close()
            self.leaser.store.close()
            if ending == events.FAILED:
                kept = (len(self.sandboxes.records), len(self.vms.records))
            events.stopped(ending, *kept)

    async def _stop_snapshots(self) -> None:
        """containerd's snapshotter stops answering (before anything is unmounted)."""
        if self.snapshots is not None:
            await trio.to_thread.run_sync(self.snapshots.stop)

    def _unmount_fuse(self) -> None:
        """The mount is ours (see :mod:`.fuse.connection`), so libfuse does not
        unmount it; detaching it ends the connection, and its keeper exits."""
        try:
            umount(str(self.root / "fuse"), lazy=True)
        except OSError as exc:
            log.error("cannot unmount %s: %s", self.root / "fuse", exc)

    async def _set_readahead(self) -> None:
        """Before any EROFS mount or loop device opens a blob or disk file: the
        kernel's default 128 KiB window means one FUSE request per 128 KiB, and
        a wider one lets it send 1 MiB requests, several at a time. The answer
        to the kernel's FUSE_INIT resets the window, so it is set once a first
        request (this stat, in a thread) has been served."""
        await trio.to_thread.run_sync(os.stat, self.root / "fuse")
        try:
            set_readahead(str(self.root / "fuse"), self.cfg.readahead)
        except OSError as exc:
            log.warning("cannot set the FUSE readahead window: %s", exc)
        try:
            await trio.to_thread.run_sync(set_fuse_background, str(self.root / "fuse"),
                                          self.cfg.fuse_background)
        except OSError as exc:  # no fusectl here (a container's /sys): a tuning, not a fault
            log.info("the FUSE connection keeps the kernel's 12 background requests: %s", exc)

    async def _serve_fuse(self) -> None:
        await pyfuse3.main()
        if self.accepting:  # the FUSE loop must only end when we stop: fail loudly
            log.critical("the FUSE request loop ended unexpectedly; stopping")
            raise RuntimeError("FUSE request loop ended")

    async def handle(self, request: protocol.Request) -> protocol.Message:
        if not self.accepting:
            raise UsageError("the daemon is stopping")
        try:
            return await self.handlers[type(request)](request)
        finally:
            if type(request) in LEASE_CHANGES:
                self.leaser.changed()
            if self.accepting:  # (a stop's status stays)
                self.notifier.set_status(self._status())

    def _holders(self) -> list[Holder]:
        return node_holders(self.sandboxes.records.values(), self.vms.records.values(),
                            self.disks.ls(), self.snapshots.snapshotter.in_use()
                            if self.snapshots is not None else [])

    def _status(self) -> str:
        """The service's STATUS= line (``systemctl status``): the sandbox count."""
        return systemd.sandboxes_status(len(self.sandboxes.records), self.store.url)

    def _handlers(self) -> dict[type[protocol.Request], Callable[[Any], Awaitable[Any]]]:
        """Each request type's handler: the control API."""
        return {
            protocol.Ping: self.ping,
            protocol.Up: self.up,
            protocol.Down: self.down,
            protocol.Ps: self.ps,
            protocol.Commit: self.commit,
            protocol.Suspend: self.suspend,
            protocol.Stats: self.stats,
            protocol.TracePush: self.trace_push,
            protocol.DiskCreate: self.disk_create,
            protocol.DiskLs: self.disk_ls,
            protocol.DiskRm: self.disk_rm,
            protocol.DiskCommit: self.disk_commit,
            protocol.VmUp: self.vm_up,
            protocol.VmDown: self.vm_down,
            protocol.VmPs: self.vm_ps,
            protocol.VmSuspend: self.vm_suspend,
            protocol.VmResume: self.vm_resume,
            protocol.VmPrefetch: self.vm_prefetch,
        }

    async def up(self, r: protocol.Up) -> protocol.SandboxAnswer:
        what, started = f"sandbox {r.id}", time.monotonic()
        await trio.to_thread.run_sync(self.space.check_room, what)
        try:
            record = await self.sandboxes.up(r.id, r.env, r.layers, r.prefetch, r.limits)
            self.metrics.up_seconds.observe(time.monotonic() - started)
            names = await trio.to_thread.run_sync(events.layer_names, self.replica,
                                                  record.layers)
            events.sandbox_up(record, names, time.monotonic() - started)
            return protocol.SandboxAnswer(record)
        except OSError as exc:
            if exc.errno in NO_SPACE:
                raise await trio.to_thread.run_sync(no_room_for, self.root, what) from None
            raise

    async def down(self, r: protocol.Down) -> protocol.SandboxAnswer:
        started = time.monotonic()
        try:
            record = await self.sandboxes.down(r.id, r.keep_upper, r.force)
            self.dataloss.forget(r.id)
            names = await trio.to_thread.run_sync(events.layer_names, self.replica,
                                                  record.layers)
            events.sandbox_down(record, names, time.monotonic() - started)
            return protocol.SandboxAnswer(record)
        finally:
            await trio.to_thread.run_sync(self.space.retake)

    async def ps(self, r: protocol.Ps) -> protocol.PsAnswer:
        sandboxes = await self.sandboxes.ps(r.id)
        for row in sandboxes:
            row.state = self.dataloss.state(row.id, row.state)
        if self.snapshots is None or r.id is not None:
            return protocol.PsAnswer(sandboxes)
        count, rows = await trio.to_thread.run_sync(self.snapshots.snapshotter.ps_rows)
        return protocol.PsAnswer(sandboxes, rows, count)

    async def commit(self, r: protocol.Commit) -> protocol.CommitAnswer:
        started = time.monotonic()
        answer = await self.sandboxes.commit(r.id, r.name, r.version, r.role, r.expire)
        events.sandbox_committed(answer, time.monotonic() - started)
        return answer

    async def suspend(self, r: protocol.Suspend) -> protocol.SuspendAnswer:
        answer = await self.sandboxes.suspend(r.id, r.name, r.version)
        self.dataloss.forget(r.id)
        return answer

    async def disk_create(self, r: protocol.DiskCreate) -> protocol.DiskAnswer:
        return protocol.DiskAnswer(await self.disks.create(r.id, r.size, r.base))

    async def disk_ls(self, _: protocol.DiskLs) -> protocol.DiskList:
        return protocol.DiskList(self.disks.ls(), sorted(self.vms.records))

    async def disk_rm(self, r: protocol.DiskRm) -> protocol.DiskRemoved:
        await self.disks.remove(r.id)
        return protocol.DiskRemoved(r.id)

    async def disk_commit(self, r: protocol.DiskCommit) -> protocol.DiskCommitAnswer:
        return await self.disks.commit(r.id, r.name, r.version, max_depth=r.max_depth)

    async def vm_up(self, r: protocol.VmUp) -> protocol.VmAnswer:
        started = time.monotonic()
        record = await self.vms.up(r.id, r.env, r.layers, r.disk_size, r.base_disk, r.pmem,
                                   r.ram)
        events.vm_up(record, time.monotonic() - started)
        return protocol.VmAnswer(record)

    async def vm_suspend(self, r: protocol.VmSuspend) -> protocol.VmAnswer:
        return protocol.VmAnswer(await self.vms.suspend(r.id, r.name, r.version,
                                                        r.max_depth))

    async def vm_resume(self, r: protocol.VmResume) -> protocol.VmAnswer:
        return protocol.VmAnswer(await self.vms.resume(r.ref, r.id))

    async def vm_prefetch(self, r: protocol.VmPrefetch) -> protocol.VmPrefetchAnswer:
        return await self.vms.prefetch(r.ref)

    async def vm_down(self, r: protocol.VmDown) -> protocol.VmAnswer:
        started = time.monotonic()
        record = await self.vms.down(r.id, r.keep)
        self.dataloss.forget(r.id)
        events.vm_down(record, time.monotonic() - started)
        return protocol.VmAnswer(record)

    async def vm_ps(self, _: protocol.VmPs) -> protocol.VmList:
        return protocol.VmList(self.vms.ps())

    async def ping(self, _: protocol.Ping) -> protocol.PingAnswer:
        return protocol.PingAnswer(str(self.root), self.store.url, os.getpid())

    async def stats(self, _: protocol.Stats) -> protocol.StatsAnswer:
        mounted = dict(self.layers.mounted)
        names = await trio.to_thread.run_sync(events.layer_names, self.replica, list(mounted))
        layers = {d: protocol.LayerStats(users=m.users, bytes_read=m.blob.bytes_read,
                                         chunks_touched=len(m.blob.touched),
                                         chunks=len(m.blob.table), blob_bytes=m.blob.size,
                                         local=m.local, partial=m.partial, name=name)
                  for (d, m), name in zip(mounted.items(), names, strict=True)}
        return protocol.StatsAnswer(self.cache.snapshot(), layers, len(self.sandboxes.records),
                                    self.store.requests())

    async def trace_push(self, request: protocol.TracePush) -> protocol.TracePushAnswer:
        ref = request.ref
        digest = await trio.to_thread.run_sync(self.refstore.resolve, LAYERS, ref)
        mounted = self.layers.mounted.get(digest)
        order = await trio.to_thread.run_sync(self.replica.trace, digest)
        order = merge_traces(order, list(mounted.blob.trace) if mounted else [])
        if not order:
            raise RefNotFound("access trace", f"{ref} (none recorded on this node)")
        pushed = await trio.to_thread.run_sync(pushed_trace, self.store, digest)
        order = merge_traces(pushed or [], order)  # other nodes' runs stay in it
        await trio.to_thread.run_sync(self.store.put, trace_key(digest), trace_bytes(order))
        return protocol.TracePushAnswer(ref, digest, len(order))


async def wait_for_signal() -> int:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, HANDOVER) as signals:
        async for signum in signals:
            return signum
    raise AssertionError("signal receiver ended")
