"""Layer mounts and sandboxes on one node.

Each layer is mounted once per node with kernel EROFS (file-backed: source =
its local meta image, ``device=`` its lazy FUSE blob file) at
``ROOT/layers/<hex>``, reference-counted across the sandboxes that use it.
A sandbox is an overlayfs mount at ``ROOT/sandboxes/<id>/rootfs`` with the
layer mounts as lowerdirs (top first) and its own ``upper``/``work``. Both
kinds of mount are ``nosuid,nodev``; ``ROOT/sandboxes/<id>`` is root's alone
(0700), since its ``upper`` keeps the mode of the sandbox's ``/``.

mount(2) and umount(2) run in worker threads: mounting an EROFS image whose
device lives on the daemon's own FUSE mount makes the kernel call back into
the daemon before the syscall returns.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from ..builder.dirsource import UpperSource
from ..builder.layer import BuildOptions, build_layer
from ..builder.pipeline import DEFAULT_CHUNK_SIZE
from ..errors import LayerfsError, UsageError
from ..mounts import SAFE_FLAGS, Overlay, mount_erofs, mount_overlay, umount
from ..registry import Registry
from ..sizes import du
from . import runner
from .blobfiles import BlobDirectory, BlobFile
from .fetcher import ChunkFetcher
from .protocol import (
    LAYER_ROLES,
    BadMessage,
    CommitAnswer,
    OfflineRef,
    SandboxRecord,
    SandboxStatus,
)
from .refs import NodeRefs
from .replica import Replica
from .storehealth import StoreHealth
from .tracereplay import TraceReplay
from .traces import merge_traces

log = logging.getLogger(__name__)
SANDBOX_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# auto: a layer's pushed trace if it has one; trace: its trace, local or pushed
PREFETCH = ("none", "full", "trace", "auto")
# A layer's own trusted.overlay.* xattrs never steer lookups into other
# directories (redirect) nor make a file's data come from elsewhere (metacopy),
# and the upper directory stays one a layer can hold (`commit`): no renamed
# lower directory kept as a redirect, no chown/chmod kept as metadata only.
OVERLAY_OPTIONS = (("redirect_dir", "nofollow"), ("metacopy", "off"))


class SandboxError(LayerfsError):
    """sandbox {}: {}"""

    exit_code = 9


class SandboxBusy(SandboxError):
    """sandbox {}: container {} runs in it (stop it first, or `down --force` kills it)"""

    exit_code = 9  # the node's code for busy


@dataclass
class MountedLayer:
    digest: str
    blob: BlobFile
    path: Path
    users: int = 0


class LayerMounts:
    """Reference-counted EROFS mounts of layers, one per layer per node."""

    def __init__(self, root: Path, reg: Registry, replica: Replica, blobs: BlobDirectory,
                 fetcher: ChunkFetcher, readahead: int = 0) -> None:
        self.root = root
        self.reg = reg
        self.replica = replica
        self.blobs = blobs
        self.fetcher = fetcher
        self.readahead = readahead
        self.mounted: dict[str, MountedLayer] = {}
        self._locks: dict[str, trio.Lock] = {}
        self.mount_limit = trio.CapacityLimiter(8)
        # mounts an earlier daemon left on a taken-over FUSE connection: adopted, not redone
        self.kept: set[str] = set()

    def adopt(self, target: Path) -> bool:
        """Whether ``target`` is still mounted from before a live restart (and is now ours)."""
        if str(target) not in self.kept:
            return False
        self.kept.discard(str(target))
        return True

    async def drop_unadopted(self) -> None:
        """Detach the kept mounts no restored sandbox uses (deepest first)."""
        for point in sorted(self.kept, key=lambda p: -p.count("/")):
            if await detach(point):
                log.info("detached %s: no sandbox uses it", point)
        self.kept.clear()

    def _lock(self, digest: str) -> trio.Lock:
        return self._locks.setdefault(digest, trio.Lock())

    async def acquire(self, digest: str, replay: TraceReplay | None = None) -> MountedLayer:
        """The layer, mounted (once per node); ``replay`` learns its chunk table
        as soon as it is known."""
        async with self._lock(digest):
            layer = self.mounted.get(digest)
            if layer is None:
                layer = await self._mount(digest, replay)
                self.mounted[digest] = layer
            elif replay is not None:
                replay.table_known(digest, layer.blob.table)
            layer.users += 1
            return layer

    async def _mount(self, digest: str, replay: TraceReplay | None) -> MountedLayer:
        """Mount the layer from its meta image as checked just now: the open,
        hashed file itself (``/proc/self/fd/N``), never the name again."""
        reporter = replay.reporter(digest) if replay is not None else None
        meta = await trio.to_thread.run_sync(self.replica.checked_meta, self.reg, digest,
                                             reporter)
        try:
            rl = meta.layer
            blob = self.blobs.add(digest, rl.table, self.fetcher)
            target = self.root / "layers" / rl.hex
            device = self.root / "fuse" / "blobs" / rl.hex
            try:
                if self.adopt(target):
                    return MountedLayer(digest, blob, target)
                await trio.to_thread.run_sync(  # one thread job: each hop waits for the loop
                    functools.partial(mount_layer, meta.source, device, target, self.readahead),
                    limiter=self.mount_limit)
            except OSError:
                self.blobs.remove(digest)
                raise
        finally:
            meta.close()  # the mount keeps its own reference to the file
        return MountedLayer(digest, blob, target)

    async def release(self, digest: str) -> None:
        async with self._lock(digest):
            layer = self.mounted.get(digest)
            if layer is None:
                return
            layer.users -= 1
            if layer.users > 0:
                return
            del self.mounted[digest]
            await trio.to_thread.run_sync(self._unmount, layer, limiter=self.mount_limit)
            self.blobs.remove(digest)

    def _unmount(self, layer: MountedLayer) -> None:
        """Worker thread: keep the layer's trace, unmount it, remove the mount point."""
        self.save_trace(layer.blob)
        umount(str(layer.path))
        layer.path.rmdir()

    def save_trace(self, blob: BlobFile) -> None:
        """Merge this mount's first-touch order into the layer's trace."""
        if blob.trace:
            kept = self.replica.trace(blob.digest)
            self.replica.put_trace(blob.digest, merge_traces(kept, list(blob.trace)))

    async def unmount_all(self) -> None:
        for digest in list(self.mounted):
            layer = self.mounted.pop(digest)
            try:
                await trio.to_thread.run_sync(self._unmount, layer)
            except OSError as exc:
                log.error("unmount %s: %s", layer.path, exc)


class Sandboxes:
    """Bring sandboxes up and down; their records live in the replica."""

    def __init__(self, root: Path, reg: Registry, replica: Replica, layers: LayerMounts,
                 health: StoreHealth | None = None) -> None:
        self.root = root
        self.reg = reg
        self.replica = replica
        self.layers = layers
        self.refs = NodeRefs(reg, replica, health)
        self.records: dict[str, SandboxRecord] = {}
        self._busy: set[str] = set()

    def _dir(self, sid: str) -> Path:
        return self.root / "sandboxes" / sid

    def _resolve(self, env: str | None,
                 layer_refs: list[str]) -> tuple[list[str], dict[str, Any] | None,
                                                 list[OfflineRef]]:
        """Worker thread: env or layer refs → layer manifest digests, top first,
        each once (its topmost place: :func:`distinct`), the env's image config
        (what ``up --bundle`` and ``run`` start), and the refs resolved by the
        node alone, the store not answering (:mod:`.refs`)."""
        resolved = self.refs.up_layers(env, layer_refs)
        return distinct(resolved.layers), resolved.config, resolved.offline

    async def up(self, sid: str, env: str | None = None, layers: list[str] | None = None,
                 prefetch: str = "auto") -> SandboxRecord:
        if not SANDBOX_ID.fullmatch(sid or ""):
            raise UsageError(f"invalid sandbox id {sid!r} (expected [A-Za-z0-9][A-Za-z0-9._-]*)")
        if prefetch not in PREFETCH:
            raise UsageError(f"invalid prefetch mode {prefetch!r}")
        if bool(env) == bool(layers):
            raise UsageError("give an env or --layer refs, not both or neither")
        if sid in self.records or sid in self._busy:
            raise SandboxError(sid, "already exists")
        self._busy.add(sid)
        replay: TraceReplay | None = None
        try:
            digests, config, offline = await trio.to_thread.run_sync(self._resolve, env,
                                                                     layers or [])
            record = SandboxRecord(id=sid, env=env, layer_refs=layers or [], layers=digests,
                                   config=config, prefetch=prefetch, created=time.time(),
                                   state="starting", rootfs=str(self._dir(sid) / "rootfs"),
                                   offline=offline)
            replay = self._replay(record)
            await self._start(record, fresh=True, replay=replay)
            if replay is not None:
                replay.settle()  # every layer's table is in
            self.records[sid] = record
            await self._save(record)
        except BaseException:
            if replay is not None:
                replay.cancel()
            raise
        finally:
            self._busy.discard(sid)
        try:
            await self._prefetch(record)
        except BaseException:
            with trio.CancelScope(shield=True):  # a failed eager up leaves nothing up
                await self.down(sid)
            raise
        return record

    def _replay(self, record: SandboxRecord) -> TraceReplay | None:
        """The sandbox's trace replay, started now, alongside its layers'
        fetches (``trace`` and ``auto`` only)."""
        nursery = self.layers.fetcher.nursery
        if record.prefetch not in ("trace", "auto") or nursery is None:
            return None
        replay = TraceReplay(self.reg.store, self.replica, self.layers.fetcher, record.layers,
                             pushed_only=record.prefetch == "auto")
        nursery.start_soon(replay.run)
        return replay

    async def _save(self, record: SandboxRecord) -> None:
        await trio.to_thread.run_sync(self.replica.put_sandbox, record.id, record.to_json())

    async def _start(self, record: SandboxRecord, fresh: bool,
                     replay: TraceReplay | None = None) -> None:
        sdir = self._dir(record.id)
        acquired: list[str] = []
        try:
            mounted = await self._acquire_all(record.layers, acquired, replay)
            overlay = Overlay(distinct([str(m.path) for m in mounted]), str(sdir / "upper"),
                              str(sdir / "work"), OVERLAY_OPTIONS)
            adopted = self.layers.adopt(sdir / "rootfs")
            try:
                await trio.to_thread.run_sync(make_rootfs, sdir, fresh,
                                              None if adopted else overlay,
                                              limiter=self.layers.mount_limit)
            except BaseException:
                if adopted:  # detached now, or the layers under it stay busy
                    with trio.CancelScope(shield=True):
                        await detach(str(sdir / "rootfs"))
                raise
        except BaseException:
            for digest in acquired:
                await self.layers.release(digest)
            if fresh:
                await trio.to_thread.run_sync(shutil.rmtree, sdir, True)
            raise
        record.state = "up"

    async def _acquire_all(self, digests: list[str], acquired: list[str],
                           replay: TraceReplay | None) -> list[MountedLayer]:
        """The layers, in order, each fetched and mounted in a task of its own
        (a never-seen layer's objects cost one round trip for the lot, not one
        per layer); each acquired one is added to ``acquired``. The first
        failure is raised as itself once the others are done."""
        mounted: list[MountedLayer | None] = [None] * len(digests)
        failed: list[Exception] = []

        async def one(k: int) -> None:
            try:
                mounted[k] = await self.layers.acquire(digests[k], replay)
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
            fetcher = self.layers.fetcher
            entries = [e for d in record.layers for e in self.layers.mounted[d].blob.table.entries]
            # half the fetch slots, so that sandboxes already up still get theirs
            await fetcher.fetch_all(entries, workers=max(1, fetcher.parallel // 2))

    async def down(self, sid: str, keep_upper: bool = False,
                   force: bool = False) -> SandboxRecord:
        """Unmount the sandbox and delete its directory (``keep_upper``: not its
        upper). A sandbox a ``layerfs run`` container runs in is refused
        (:class:`SandboxBusy`), or with ``force`` the containers are killed first."""
        record = self.records.get(sid)
        if record is None or sid in self._busy:
            raise SandboxError(sid, "no such sandbox" if record is None else "busy")
        self._busy.add(sid)
        try:
            await self._stop_containers(sid, force)
            sdir = self._dir(sid)
            if record.state == "up":
                await trio.to_thread.run_sync(umount, str(sdir / "rootfs"),
                                              limiter=self.layers.mount_limit)
                for digest in record.layers:
                    await self.layers.release(digest)
            if keep_upper:
                await trio.to_thread.run_sync(shutil.rmtree, sdir / "work", True)
            else:
                await trio.to_thread.run_sync(shutil.rmtree, sdir, True)
            del self.records[sid]
            await trio.to_thread.run_sync(self.replica.delete_sandbox, sid)
        finally:
            self._busy.discard(sid)
        record.state = "down"
        return record

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

    async def commit(self, sid: str, name: str, version: str,
                     role: str = "workspace") -> CommitAnswer:
        """Build the sandbox's upper directory into layer ``name@version`` in a
        worker thread, chunks deduplicated against the sandbox's layers, and
        publish it. The sandbox stays up and busy (no ``down``) meanwhile."""
        if role not in LAYER_ROLES:
            raise UsageError(f"invalid role {role!r} (expected one of {', '.join(LAYER_ROLES)})")
        record = self.records.get(sid)
        if record is None or sid in self._busy:
            raise SandboxError(sid, "no such sandbox" if record is None else "busy")
        self._busy.add(sid)
        try:
            source = UpperSource(str(self._dir(sid) / "upper"))
            chunk_size = await trio.to_thread.run_sync(self._chunk_size, record.layers)
            opts = BuildOptions(name, version, role=role, chunk_size=chunk_size,
                                dedup_with=list(record.layers))
            result = await trio.to_thread.run_sync(functools.partial(
                build_layer, self.reg, f"sandbox {sid}", opts, source=source))
        finally:
            self._busy.discard(sid)
        for path in source.vanished:
            log.warning("commit of %s: %s vanished during the walk, skipped", sid, path)
        for path in source.changed:
            log.warning("commit of %s: %s changed while it was read", sid, path)
        stats = result.manifest.stats
        return CommitAnswer(ref=result.ref, digest=result.digest, published=result.published,
                            id=sid, chunk_size=chunk_size, files=stats.files,
                            file_bytes=stats.file_bytes, stored_bytes=stats.stored_bytes,
                            uploaded_bytes=stats.uploaded_bytes,
                            unique_chunks=stats.unique_chunks,
                            reused_chunks=stats.reused_chunks, dedup_sources=record.layers,
                            vanished=source.vanished, changed=source.changed)

    def _chunk_size(self, digests: list[str]) -> int:
        """Worker thread: the chunk size of the sandbox's top layer, so that a
        copied-up file's unchanged chunks are the lower file's chunks."""
        return self.reg.layer(digests[0]).chunk_size if digests else DEFAULT_CHUNK_SIZE

    async def restore(self) -> None:
        """After a restart: bring back the sandboxes that were up, or mark them lost.
        Records an earlier version wrote load too; one that does not parse is
        logged and left in the replica."""
        stored = await trio.to_thread.run_sync(self.replica.sandboxes)
        for sid, data in stored.items():
            try:
                record = SandboxRecord.from_json(data, f"sandbox record {sid}")
            except BadMessage as exc:
                log.error("sandbox %s not restored: %s", sid, exc)
                continue
            try:
                await self._start(record, fresh=False)
            except (LayerfsError, OSError) as exc:
                record.state = "lost"
                record.error = str(exc)
                log.error("sandbox %s lost: %s", sid, exc)
            self.records[sid] = record
            await self._save(record)

    async def down_all(self) -> None:
        """Shutdown: unmount every sandbox, keep its records and upper dirs."""
        for sid, record in list(self.records.items()):
            if record.state != "up":
                continue
            try:
                await trio.to_thread.run_sync(umount, str(self._dir(sid) / "rootfs"))
            except OSError as exc:
                log.error("unmount sandbox %s: %s", sid, exc)

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


async def detach(point: str) -> bool:
    """Detach a kept mount lazily (its users keep it); False, with an error
    line, if it cannot be."""
    try:
        await trio.to_thread.run_sync(functools.partial(umount, point, lazy=True))
    except OSError as exc:
        log.error("cannot detach %s: %s", point, exc)
        return False
    return True


def mount_layer(source: str, device: Path, target: Path, readahead: int) -> None:
    """Worker thread: a layer's mount point, then its EROFS mount of ``source``
    (the checked meta image) over the blob file ``device``."""
    target.mkdir(parents=True, exist_ok=True)
    mount_erofs(source, str(device), str(target), directio=True, readahead=readahead)


def make_rootfs(sdir: Path, fresh: bool, overlay: Overlay | None) -> None:
    """Worker thread: the sandbox's directories, then ``overlay`` on its rootfs
    (None: the overlay is mounted already, kept across a live restart)."""
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


