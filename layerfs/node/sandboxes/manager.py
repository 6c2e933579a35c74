"""Sandboxes on one node, and their lifecycle (:mod:`.sandboxes.lifecycle`).

A sandbox is an overlayfs mount at ``ROOT/sandboxes/<id>/rootfs`` with its
layers' mounts (:mod:`.sandboxes.layermounts`) as lowerdirs (top first) and its own
``upper``/``work``, ``nosuid,nodev``; ``ROOT/sandboxes/<id>`` is root's alone
(0700), since its ``upper`` keeps the mode of the sandbox's ``/``.

Every step of an ``up`` or a ``down`` is recorded as it is done (the
record's state in the replica, the mounts each sandbox holds in memory), so
that a failed or cancelled ``up`` is rolled back completely, a ``down`` that
stopped half way can be asked again until it is done, and a stop unmounts
everything.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from ...builder.dirsource import UpperSource
from ...builder.layer import BuildOptions, build_layer
from ...builder.pipeline import DEFAULT_CHUNK_SIZE
from ...errors import (
    DownIncomplete,
    LayerfsError,
    MountBusy,
    SandboxBusy,
    SandboxExists,
    SandboxInUse,
    SandboxNotFound,
    UsageError,
)
from ...mounts import SAFE_FLAGS, Overlay, mount_overlay
from ...names import check_node_id
from ...refstore import LAYERS, RefStore
from ...retention import expires_at, set_expiry
from ...sizes import du
from ...tasks import TaskGroup
from ..containers import freezer, runner
from ..protocol import (
    LAYER_ROLES,
    BadMessage,
    CommitAnswer,
    Limits,
    OfflineRef,
    SandboxRecord,
    SandboxStatus,
    SuspendAnswer,
)
from ..reads.prefetch import Prefetcher
from ..reads.tracereplay import TraceReplay
from ..replica.noderefs import NodeRefs
from ..replica.replica import Replica
from . import limits as sandbox_limits
from . import quota, suspend
from .layermounts import LayerMounts, MountedLayer, detach, unmount, unmount_or_detach
from .lifecycle import SandboxState, move, state_of

log = logging.getLogger(__name__)
# auto: a layer's pushed trace if it has one; trace: its trace, local or pushed
PREFETCH = ("none", "full", "trace", "auto")
# A layer's own trusted.overlay.* xattrs never steer lookups into other
# directories (redirect) nor make a file's data come from elsewhere (metacopy),
# and the upper directory stays one a layer can hold (`commit`): no renamed
# lower directory kept as a redirect, no chown/chmod kept as metadata only.
OVERLAY_OPTIONS = (("redirect_dir", "nofollow"), ("metacopy", "off"))


def ready_record(sid: str, record: SandboxRecord | None, busy: set[str]) -> SandboxRecord:
    """The record of a sandbox a request needs; refused if it is not there or
    another request has it (an up, a down or a commit under way)."""
    if record is None:
        raise SandboxNotFound(sid)
    if sid in busy:
        raise SandboxInUse(sid)
    return record


@dataclass
class SandboxMounts:
    """What a sandbox holds mounted now: its rootfs, and the layers it counts as a user of."""

    rootfs: bool = False
    layers: list[str] = field(default_factory=list)


class Sandboxes:
    """Bring sandboxes up and down; their records live in the replica."""

    def __init__(self, root: Path, refs: NodeRefs, replica: Replica,
                 layers: LayerMounts, policy: Prefetcher,
                 tasks: TaskGroup | None = None) -> None:
        """``policy``: the node's prefetch policy (trace replays, ``--prefetch
        full``); ``tasks``: the daemon's task group, where trace replays run
        (none: no replay)."""
        self.root = root
        self.policy = policy
        self.tasks = tasks or TaskGroup()
        self.refs = refs
        self.refstore: RefStore = refs.refstore
        self.replica = replica
        self.layers = layers
        self.records: dict[str, SandboxRecord] = {}
        self.mounts: dict[str, SandboxMounts] = {}  # what each sandbox holds mounted
        self._busy: set[str] = set()
        self._ups: dict[str, trio.CancelScope] = {}  # ups in flight: a stop cancels them
        self._downs: set[str] = set()  # downs in flight: a stop waits for them
        self._settled = trio.lowlevel.ParkingLot()  # woken as each up or down ends
        self.closing = False  # a stop began: no more ups

    def _dir(self, sid: str) -> Path:
        return self.root / "sandboxes" / sid

    def _resolve(self, env: str | None,
                 layer_refs: list[str]) -> tuple[list[str], dict[str, Any] | None,
                                                 list[OfflineRef]]:
        """Worker thread: env or layer refs → layer manifest digests, top first,
        each once (its topmost place: :func:`distinct`), the env's image config
        (what ``up --bundle`` and ``run`` start), and the refs resolved by the
        node alone, the store not answering (:mod:`.replica.noderefs`)."""
        resolved = self.refs.up_layers(env, layer_refs)
        return distinct(resolved.layers), resolved.config, resolved.offline

    async def up(self, sid: str, env: str | None = None, layers: list[str] | None = None,
                 prefetch: str = "auto", limits: Limits | None = None) -> SandboxRecord:
        limits = limits or Limits()
        check_node_id("sandbox", sid)
        if prefetch not in PREFETCH:
            raise UsageError(f"invalid prefetch mode {prefetch!r}")
        if bool(env) == bool(layers):
            raise UsageError("give an env or --layer refs, not both or neither")
        if sid in self.records or sid in self._busy:
            raise SandboxExists(sid)
        sandbox_limits.validate(limits)
        if self.closing:
            raise UsageError("the daemon is stopping")
        self._busy.add(sid)
        try:
            with trio.CancelScope() as scope:  # a stop cancels it: rolled back, then
                self._ups[sid] = scope
                record = await self._up(sid, env, layers or [], prefetch, limits)
        finally:
            del self._ups[sid]
            self._busy.discard(sid)
            self._settled.unpark_all()
        if scope.cancelled_caught:
            raise UsageError("the daemon is stopping")
        return record

    async def _up(self, sid: str, env: str | None, layers: list[str], prefetch: str,
                  limits: Limits) -> SandboxRecord:
        """Record the sandbox as starting, mount it, record it as up (and with
        ``--prefetch full``, fetch it); anything that fails or is cancelled on
        the way is rolled back completely (:meth:`_take_down`)."""
        if limits.given():
            await trio.to_thread.run_sync(self._check_limits, limits)
        steps = StepTimes()
        digests, config, offline = await trio.to_thread.run_sync(self._resolve, env, layers)
        steps.done("resolved")
        record = SandboxRecord(id=sid, env=env, layer_refs=layers, layers=digests,
                               config=config, prefetch=prefetch, created=time.time(),
                               state=SandboxState.STARTING,
                               rootfs=str(self._dir(sid) / "rootfs"), limits=limits,
                               offline=offline)
        replay: TraceReplay | None = None
        try:
            self.records[sid] = record
            replay = self._replay(record)
            await self._save_and_start(record, replay, steps)
            steps.done("mounted")
            if replay is not None:
                replay.settle()  # every layer's table is in
            move(record, SandboxState.UP)
            await self._save(record)
            steps.done("recorded up")
            await self._prefetch(record)
            log.debug("up of %s: %s", sid, steps)
        except BaseException:
            if replay is not None:
                replay.cancel()
            with trio.CancelScope(shield=True):  # a failed up leaves nothing up
                await self._roll_back(record)
            raise
        return record

    async def _save_and_start(self, record: SandboxRecord, replay: TraceReplay | None,
                              steps: StepTimes) -> None:
        """Record the sandbox as starting while its layers are fetched and
        checked; nothing is mounted before the record is saved (from then on a
        crash is rolled back at the next start). The first failure is raised
        as itself, the other side cancelled."""
        recorded = trio.Event()  # the record is saved: mounts may begin
        failed: list[Exception] = []

        async def start() -> None:
            try:
                await self._start(record, fresh=True, replay=replay, recorded=recorded)
            except Exception as exc:  # noqa: BLE001 - raised below
                failed.append(exc)
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(start)
            try:
                await self._save(record)
            except Exception as exc:  # noqa: BLE001 - raised below
                failed.append(exc)
                nursery.cancel_scope.cancel()
            else:
                steps.done("recorded")
                recorded.set()
        if failed:
            raise failed[0]

    def _check_limits(self, limits: Limits) -> None:
        """Worker thread: refuse limits this node cannot enforce, before anything is up."""
        sandbox_limits.check_enforceable(limits)
        if limits.disk_quota is not None:
            parent = self.root / "sandboxes"
            parent.mkdir(parents=True, exist_ok=True)
            quota.check_supported(parent)

    async def _roll_back(self, record: SandboxRecord) -> None:
        """Take a failed ``up``'s sandbox down again; if even that fails, it
        stays ``down_failed`` (logged) for a ``down`` to finish."""
        try:
            await self._take_down(record, keep_upper=False)
        except LayerfsError as exc:
            log.error("rolling back the up of %s: %s", record.id, exc)

    def _replay(self, record: SandboxRecord) -> TraceReplay | None:
        """The sandbox's trace replay, started now, alongside its layers'
        fetches (``trace`` and ``auto`` only)."""
        if record.prefetch not in ("trace", "auto"):
            return None
        return TraceReplay.start_in(self.tasks, self.refstore.store, self.replica, self.policy,
                                    record.layers, pushed_only=record.prefetch == "auto")

    async def _save(self, record: SandboxRecord) -> None:
        await trio.to_thread.run_sync(self.replica.put_sandbox, record.id, record.to_json())

    async def _start(self, record: SandboxRecord, fresh: bool,
                     replay: TraceReplay | None = None,
                     recorded: trio.Event | None = None) -> None:
        """Mount the sandbox's layers and rootfs (``fresh``: its directories
        are new), each mount noted in :attr:`mounts` as soon as it is made;
        on failure, what was mounted stays noted for the caller to release.
        With ``recorded``, the layers are fetched and checked at once but
        nothing is mounted before it is set."""
        sdir = self._dir(record.id)
        held = self.mounts.setdefault(record.id, SandboxMounts())
        mounted = await self._acquire_all(record.layers, held.layers, replay, recorded)
        if recorded is not None:
            await recorded.wait()
        overlay = Overlay(distinct([str(m.path) for m in mounted]), str(sdir / "upper"),
                          str(sdir / "work"), OVERLAY_OPTIONS)
        self.layers.adopt(sdir)  # its quota's image, kept mounted across a live restart
        adopted = self.layers.adopt(sdir / "rootfs")
        try:
            await trio.to_thread.run_sync(make_rootfs, sdir, fresh,
                                          None if adopted else overlay,
                                          record.limits.disk_quota,
                                          limiter=self.layers.mount_limit)
        except BaseException:
            if adopted:  # detached now, or the layers under it stay busy
                with trio.CancelScope(shield=True):
                    await detach(str(sdir / "rootfs"))
            raise
        held.rootfs = True

    async def _unmount(self, sid: str) -> None:
        """Unmount what the sandbox holds: its rootfs, then its use of each
        layer; each step is noted as done, so that after a failure (OSError:
        a busy mount) this can be asked again and goes on where it stopped."""
        held = self.mounts.get(sid)
        if held is None:
            return
        if held.rootfs:
            rootfs = self._dir(sid) / "rootfs"
            with busy_mount(sid, rootfs):
                await trio.to_thread.run_sync(unmount, rootfs, limiter=self.layers.mount_limit)
            held.rootfs = False
        while held.layers:
            digest = held.layers[-1]
            with busy_mount(sid, self.layers.mounted[digest].path):
                await self.layers.release(digest)
            held.layers.pop()
        del self.mounts[sid]

    async def _acquire_all(self, digests: list[str], acquired: list[str],
                           replay: TraceReplay | None,
                           recorded: trio.Event | None = None) -> list[MountedLayer]:
        """The layers, in order, each fetched and mounted in a task of its own
        (a never-seen layer's objects cost one round trip for the lot, not one
        per layer); each acquired one is added to ``acquired``. The first
        failure is raised as itself once the others are done."""
        mounted: list[MountedLayer | None] = [None] * len(digests)
        failed: list[Exception] = []

        async def one(k: int) -> None:
            try:
                mounted[k] = await self.layers.acquire(digests[k], replay, recorded)
            except Exception as exc:  # noqa: BLE001 - raised below, the first one
                failed.append(exc)
                return
            acquired.append(digests[k])

        async with trio.open_nursery() as nursery:
            for k in range(len(digests)):
                nursery.start_soon(one, k)
        if failed:
            raise failed[0]
        return [m for m in mounted if m is not None]

    async def _prefetch(self, record: SandboxRecord) -> None:
        """An eager up's fetch of every chunk (``trace`` and ``auto`` replay
        from the start of the up: :meth:`_replay`)."""
        if record.prefetch == "full":
            entries = [e for d in record.layers if not (m := self.layers.mounted[d]).local
                       for e in m.table.entries]  # a local layer is all on the node
            await self.policy.fetch_all(entries)

    async def down(self, sid: str, keep_upper: bool = False,
                   force: bool = False) -> SandboxRecord:
        """Unmount the sandbox and delete its directory (``keep_upper``: not its
        upper). A sandbox a ``layerfs run`` container runs in is refused
        (:class:`SandboxBusy`), or with ``force`` the containers are killed first.
        A down that fails half way leaves the sandbox ``down_failed`` and can be
        asked again (:meth:`_take_down`)."""
        record = ready_record(sid, self.records.get(sid), self._busy)
        self._busy.add(sid)
        self._downs.add(sid)
        try:
            await self._stop_containers(sid, force)
            await self._take_down(record, keep_upper)
        except DownIncomplete as exc:
            log.error("%s", exc)  # the replica or the file system failed it, not the caller
            raise
        finally:
            self._downs.discard(sid)
            self._busy.discard(sid)
            self._settled.unpark_all()
        return record

    async def _take_down(self, record: SandboxRecord, keep_upper: bool) -> None:
        """The steps of a down, each idempotent, shielded from cancellation:
        record it as stopping, unmount its rootfs and release its layers,
        remove its directory (``keep_upper``: only its work directory), delete its
        record. A step that fails leaves it ``down_failed`` with the reason
        (:class:`MountBusy` for a busy mount, :class:`DownIncomplete` else),
        and the next down starts again from the first step not done."""
        sid = record.id
        move(record, SandboxState.STOPPING)
        step = "recording it as stopping"
        with trio.CancelScope(shield=True):
            try:
                await self._save(record)
                step = "unmounting it"
                await self._unmount(sid)
                step = "removing its directory"
                await trio.to_thread.run_sync(remove_sandbox_dir, self._dir(sid), keep_upper)
                step = "deleting its record"
                await trio.to_thread.run_sync(self.replica.delete_sandbox, sid)
            except Exception as exc:  # noqa: BLE001 - OSError, lmdb.Error: recorded, raised
                error = exc if isinstance(exc, LayerfsError) else DownIncomplete(sid, step, exc)
                move(record, SandboxState.DOWN_FAILED, str(error))
                await self._save_quietly(record)
                if error is exc:
                    raise
                raise error from exc
        del self.records[sid]
        move(record, SandboxState.DOWN)

    async def _save_quietly(self, record: SandboxRecord) -> None:
        """Save the record if the replica lets us (an error line if not)."""
        try:
            await self._save(record)
        except Exception as exc:  # noqa: BLE001 - the replica's own failure, logged
            log.error("sandbox %s: cannot save its record (%s): %s", record.id, record.state, exc)

    async def _stop_containers(self, sid: str, force: bool) -> None:
        """Refuse (:class:`SandboxBusy`) while a container runs in the sandbox,
        as its runtime reports now; with ``force``, kill each one first."""
        running = await trio.to_thread.run_sync(runner.running_containers, str(self.root), sid)
        if running and not force:
            raise SandboxBusy(sid, ", ".join(c.container_id for c in running))
        for container in running:
            if not await trio.to_thread.run_sync(runner.kill, container):
                raise SandboxBusy(sid, container.container_id)
            log.info("down --force of %s: killed container %s", sid, container.container_id)

    async def commit(self, sid: str, name: str, version: str, role: str = "workspace",
                     expire: float | None = None) -> CommitAnswer:
        """Build the sandbox's upper directory into layer ``name@version`` in a
        worker thread, chunks deduplicated against the sandbox's layers, and
        publish it; with ``expire``, its ref expires that many seconds after
        (recorded right after the ref, when this commit published it). The
        sandbox stays up and busy (no ``down``) meanwhile."""
        if role not in LAYER_ROLES:
            raise UsageError(f"invalid role {role!r} (expected one of {', '.join(LAYER_ROLES)})")
        if expire is not None and not expire > 0:
            raise UsageError(f"invalid expiry {expire!r} (expected seconds, more than 0)")
        record = ready_record(sid, self.records.get(sid), self._busy)
        self._busy.add(sid)
        try:
            return await self._commit(record, name, version, role, expire)
        finally:
            self._busy.discard(sid)

    async def _commit(self, record: SandboxRecord, name: str, version: str,
                      role: str = "workspace", expire: float | None = None) -> CommitAnswer:
        """:meth:`commit` of a sandbox the caller holds busy."""
        sid = record.id
        source = UpperSource(str(self._dir(sid) / "upper"))
        chunk_size = await trio.to_thread.run_sync(self._chunk_size, record.layers)
        opts = BuildOptions(name, version, role=role, chunk_size=chunk_size,
                            dedup_with=list(record.layers))
        result = await trio.to_thread.run_sync(functools.partial(
            build_layer, self.refstore, f"sandbox {sid}", opts, source=source))
        expires = None
        if expire is not None and result.published:
            expires = expires_at(expire)
            await trio.to_thread.run_sync(set_expiry, self.refstore, LAYERS, name, version,
                                          result.digest, expires)
        for path in source.vanished:
            log.warning("commit of %s: %s vanished during the walk, skipped", sid, path)
        for path in source.changed:
            log.warning("commit of %s: %s changed while it was read", sid, path)
        stats = result.manifest.stats
        return CommitAnswer(ref=result.ref, digest=result.digest, published=result.published,
                            id=sid, chunk_size=chunk_size, files=stats.files,
                            file_bytes=stats.file_bytes, stored_bytes=stats.stored_bytes,
                            uploaded_bytes=result.uploaded_bytes,
                            unique_chunks=stats.unique_chunks,
                            reused_chunks=stats.reused_chunks, dedup_sources=record.layers,
                            vanished=source.vanished, changed=source.changed,
                            expires=expires)

    async def suspend(self, sid: str, name: str, version: str) -> SuspendAnswer:
        """Freeze the sandbox's containers, commit its upper as layer
        ``name@version`` and publish env ``name@version`` over its layers
        (:mod:`.sandboxes.suspend`), then end it: its containers killed (still
        frozen), the sandbox taken down. An unknown id or a ref that exists
        is refused before anything is frozen; a failed commit thaws them and
        leaves the sandbox up."""
        record = ready_record(sid, self.records.get(sid), self._busy)
        await trio.to_thread.run_sync(suspend.check_free, self.refstore, name, version)
        self._busy.add(sid)
        try:
            containers = await trio.to_thread.run_sync(runner.running_containers,
                                                       str(self.root), sid)
            frozen = await trio.to_thread.run_sync(freezer.freeze_all, containers)
            started = time.monotonic()
            try:
                answer = await self._commit(record, name, version)
                env = await trio.to_thread.run_sync(suspend.publish_snapshot, self.refstore,
                                                    name, version, record, answer.digest)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(freezer.thaw_all, frozen)
                raise
        finally:
            self._busy.discard(sid)
        try:
            await self.down(sid, force=True)  # (a frozen process still dies of SIGKILL)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(freezer.thaw_all, frozen)
        held = time.monotonic() - started
        log.info("sandbox %s suspended as %s@%s (%d containers frozen for %.3f s)", sid, name,
                 version, len(frozen), held)
        return SuspendAnswer(id=sid, ref=f"{name}@{version}", digest=env, commit=answer,
                             frozen=[c.container_id for c in frozen], frozen_seconds=held)

    def _chunk_size(self, digests: list[str]) -> int:
        """Worker thread: the chunk size of the sandbox's top layer, so that a
        copied-up file's unchanged chunks are the lower file's chunks."""
        return self.refstore.layer(digests[0]).chunk_size if digests else DEFAULT_CHUNK_SIZE

    async def restore(self) -> None:
        """After a restart, each record by its state: an ``up`` or ``lost``
        sandbox is brought back (or marked lost); an up the last daemon did
        not finish (``starting``) is rolled back; a down it did not finish
        (``stopping``) is ``down_failed``, for a down to finish. Records an
        earlier version wrote load too; one that does not parse is logged and
        left in the replica."""
        stored = await trio.to_thread.run_sync(self.replica.sandboxes)
        for sid, data in stored.items():
            try:
                record = SandboxRecord.from_json(data, f"sandbox record {sid}")
                state = state_of(record)
            except (BadMessage, ValueError) as exc:
                log.error("sandbox %s not restored: %s", sid, exc)
                continue
            self.records[sid] = record
            if state is SandboxState.STARTING:
                log.info("sandbox %s: rolling back its unfinished up", sid)
                self.layers.adopt(self._dir(sid))  # its image: unmounted by the roll back
                if self.layers.adopt(self._dir(sid) / "rootfs"):
                    await detach(str(self._dir(sid) / "rootfs"))
                await self._roll_back(record)
            elif state is SandboxState.STOPPING:
                move(record, SandboxState.DOWN_FAILED, "the daemon stopped during its down")
                await self._save(record)
            elif state in (SandboxState.UP, SandboxState.LOST):
                await self._bring_back(record)

    async def _bring_back(self, record: SandboxRecord) -> None:
        """Mount a restored sandbox on its upper again (``up``), or mark it ``lost``."""
        try:
            await self._start(record, fresh=False)
        except (LayerfsError, OSError) as exc:
            with trio.CancelScope(shield=True):
                try:
                    await self._unmount(record.id)
                except (LayerfsError, OSError) as again:  # left for a stop to detach
                    log.error("sandbox %s: %s", record.id, again)
            if record.state != SandboxState.LOST:
                move(record, SandboxState.LOST)
            record.error = str(exc)
            log.error("sandbox %s lost: %s", record.id, exc)
        else:
            if record.state == SandboxState.LOST:
                move(record, SandboxState.UP)
        await self._save(record)

    async def stop(self) -> None:
        """A stop for good: ups in flight are cancelled (each rolled back
        completely, or done and recorded if it was that far), downs in flight
        finish; then every sandbox's rootfs is unmounted, or detached if it is
        busy. Records and upper directories stay for the next start; the
        layers are :meth:`LayerMounts.unmount_all`'s."""
        self.closing = True
        for scope in self._ups.values():
            scope.cancel()
        while self._ups or self._downs:
            await self._settled.park()
        for sid, held in list(self.mounts.items()):
            if held.rootfs and await unmount_or_detach(self._dir(sid) / "rootfs"):
                held.rootfs = False
        dirs = [self._dir(sid) for sid in self.records]  # quota images (a lost sandbox's too)
        for sdir in await trio.to_thread.run_sync(quota.mounted_among, dirs):
            await unmount_or_detach(sdir)

    async def ps(self, only: str | None = None) -> list[SandboxStatus]:
        """Every sandbox's status, or only sandbox ``only``'s (none if unknown)."""
        out = []
        for sid, record in sorted(self.records.items()):
            if only is not None and sid != only:
                continue
            blobs = [self.layers.mounted[d].blob for d in record.layers
                     if d in self.layers.mounted]
            upper = await trio.to_thread.run_sync(du, self._dir(sid) / "upper")
            out.append(SandboxStatus(**vars(record), upper_bytes=upper,
                                     layer_bytes_read=sum(b.bytes_read for b in blobs)))
        return out


class StepTimes:
    """Milliseconds from the start of a request to each of its steps (a debug line's)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.steps: list[tuple[str, float]] = []

    def done(self, step: str) -> None:
        self.steps.append((step, (time.perf_counter() - self.start) * 1000))

    def __str__(self) -> str:
        return ", ".join(f"{step} {ms:.1f} ms" for step, ms in self.steps)


@contextmanager
def busy_mount(sid: str, path: Path) -> Iterator[None]:
    """An unmount of ``path`` that fails because it is busy (EBUSY) as :class:`MountBusy`."""
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            raise MountBusy(sid, path) from None
        raise


def remove_sandbox_dir(sdir: Path, keep_upper: bool) -> None:
    """Worker thread: the sandbox's directory gone (``keep_upper``: all but
    upper and rootfs, or its quota's image, the upper inside), or gone
    already; never while its rootfs is mounted. A quota's image is unmounted
    first (EBUSY while a process uses it)."""
    if os.path.ismount(sdir / "rootfs"):
        raise OSError(errno.EBUSY, f"{sdir / 'rootfs'} is still mounted")
    if keep_upper:
        shutil.rmtree(sdir / "work", ignore_errors=True)
    quota.unmount_image(sdir)
    if not keep_upper:
        shutil.rmtree(sdir, ignore_errors=True)


def make_rootfs(sdir: Path, fresh: bool, overlay: Overlay | None,
                disk_quota: int | None = None) -> None:
    """Worker thread: the sandbox's directories (a fresh one with a
    ``disk_quota``: a quota-limited subvolume or file system, :mod:`.sandboxes.quota`;
    a restored one's file system mounted again), then ``overlay`` on its
    rootfs (None: the overlay is mounted already, kept across a live restart)."""
    if fresh and disk_quota is not None:
        sdir.parent.mkdir(parents=True, exist_ok=True)
        quota.make_quota_dir(sdir, disk_quota)
    elif not fresh:
        quota.remount(sdir)
    make_dirs(sdir, fresh)
    if overlay is not None:
        mount_overlay(overlay, str(sdir / "rootfs"), SAFE_FLAGS)


def distinct(layers: list[str]) -> list[str]:
    """``layers`` (top first) without their lower repeats. A layer listed twice
    is the same tree twice: its upper copy shows every name its lower copy
    would, so the lower copy changes nothing, and overlayfs refuses a layer
    listed twice (ELOOP)."""
    return list(dict.fromkeys(layers))


def make_dirs(sdir: Path, fresh: bool) -> None:
    """The sandbox's directories, closed to everyone but root (the parent is:
    ``upper``'s own mode is what the sandbox sees as the mode of ``/``)."""
    sdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(sdir, 0o700)
    for sub in ("upper", "work", "rootfs"):
        (sdir / sub).mkdir(exist_ok=not fresh)


