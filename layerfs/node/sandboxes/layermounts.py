"""Layer mounts: each layer mounted once per node, shared by the sandboxes on it.

A layer is mounted with kernel EROFS (file-backed: source = its local meta
image, ``device=`` its lazy FUSE blob file, or for a small layer its local
blob file, fetched whole: :mod:`.reads.localblobs`, or for a large one its
partial blob file, filled as it is read: :mod:`.reads.partialblobs`) at ``ROOT/layers/<hex>``,
``nosuid,nodev``, and reference-counted across the sandboxes that use it.
The last user's release saves the layer's access trace, unmounts it and only
then forgets it: an unmount that fails (``EBUSY``: a process has its working
directory or a file open in it) leaves the layer mounted and its user still
counted, so that the release can be asked again.

mount(2) and umount(2) run in worker threads: mounting an EROFS image whose
device lives on the daemon's own FUSE mount makes the kernel call back into
the daemon before the syscall returns.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from ...formats.chunktable import ChunkTable
from ...mounts import mount_erofs, umount
from ...refstore import RefStore
from ..reads.accesstraces import merge_traces
from ..reads.blobfiles import BlobDirectory, BlobFile
from ..reads.fetcher import ChunkFetcher
from ..reads.localblobs import LocalBlobs
from ..reads.partialblobs import PartialBlobs
from ..reads.tracereplay import TraceReplay
from ..replica.replica import Replica

log = logging.getLogger(__name__)


@dataclass
class MountedLayer:
    digest: str
    blob: BlobFile
    path: Path
    users: int = 0
    local: bool = False  # its device is a local blob file (the kernel serves every read)
    partial: bool = False  # its device is a partial blob file (filled as it is read)

    @property
    def table(self) -> ChunkTable:
        """The layer's chunk table (its blob file's)."""
        return self.blob.table


class LayerMounts:
    """Reference-counted EROFS mounts of layers, one per layer per node."""

    def __init__(self, root: Path, refstore: RefStore, replica: Replica, blobs: BlobDirectory,
                 fetcher: ChunkFetcher, readahead: int = 0,
                 local: LocalBlobs | None = None, kept: set[str] | None = None,
                 partial: PartialBlobs | None = None) -> None:
        """``kept``: the mounts an earlier daemon left on a taken-over FUSE
        connection, adopted, not redone."""
        self.root = root
        self.local = local  # small layers fetched whole into local files (None: never)
        self.partial = partial  # the others over partial files (None: over FUSE files)
        self.refstore = refstore
        self.replica = replica
        self.blobs = blobs
        self.fetcher = fetcher
        self.readahead = readahead
        self.mounted: dict[str, MountedLayer] = {}
        self._locks: dict[str, trio.Lock] = {}
        self.mount_limit = trio.CapacityLimiter(8)
        self.kept: set[str] = set(kept or ())

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

    def lock(self, digest: str) -> trio.Lock:
        """The layer's lock: held while it is fetched and mounted, or unmounted."""
        return self._lock(digest)

    async def acquire(self, digest: str, replay: TraceReplay | None = None,
                      may_mount: trio.Event | None = None) -> MountedLayer:
        """The layer, mounted (once per node); ``replay`` learns its chunk table
        as soon as it is known; a layer not mounted yet is fetched and checked
        at once, and mounted once ``may_mount`` is set."""
        async with self._lock(digest):
            layer = self.mounted.get(digest)
            if layer is None:
                layer = await self._mount(digest, replay, may_mount)
                self.mounted[digest] = layer
            elif replay is not None and not layer.local:
                replay.table_known(digest, layer.table)
            layer.users += 1
            return layer

    async def _mount(self, digest: str, replay: TraceReplay | None,
                     may_mount: trio.Event | None = None) -> MountedLayer:
        """Mount the layer from its meta image as checked just now: the open,
        hashed file itself (``/proc/self/fd/N``), never the name again."""
        start = time.perf_counter()
        meta = await trio.to_thread.run_sync(self.replica.checked_meta, self.refstore, digest)
        if replay is not None and not (self.local and self.local.wanted(meta.layer.table)):
            replay.table_known(digest, meta.layer.table)  # the up's own fetches went first
        log.debug("layer %s: meta image checked in %.1f ms", digest,
                  (time.perf_counter() - start) * 1000)
        local = None
        partial = None  # the partial file's device, once it is open and marked
        try:
            rl = meta.layer
            blob = self.blobs.add(digest, rl.table, self.fetcher)
            target = self.root / "layers" / rl.hex
            device = str(self.root / "fuse" / "blobs" / rl.hex)
            try:
                whole = self.local if self.local and self.local.wanted(rl.table) else None
                part = (self.partial if whole is None and rl.table.blob_size > 0
                        and self.partial is not None and self.partial.serving else None)
                if whole is not None and self.adopt(target):  # kept across a restart
                    on_file = await whole.adopt(rl.hex)
                    return MountedLayer(digest, blob, target, local=on_file)
                if whole is None:  # lazily read: its misses may follow the files' needs
                    blob.know_files(rl.meta_path)
                if part is not None and self.adopt(target):
                    on_file = await part.adopt(blob)
                    return MountedLayer(digest, blob, target, partial=on_file)
                if whole is not None:
                    local = await whole.open(rl.hex, rl.table)
                elif part is not None:
                    partial = await part.open(blob)
                if may_mount is not None:
                    await may_mount.wait()
                if self.adopt(target):
                    return MountedLayer(digest, blob, target)
                await trio.to_thread.run_sync(  # one thread job: each hop waits for the loop
                    functools.partial(mount_layer, meta.source,
                                      local.source if local else partial or device, target,
                                      self.readahead),
                    limiter=self.mount_limit)
            except BaseException:  # a failed mount, or cancelled before it
                self.blobs.remove(digest)
                if local is not None and self.local is not None:
                    await self.local.release(rl.hex)
                if partial is not None and self.partial is not None:
                    with trio.CancelScope(shield=True):
                        await self.partial.release(rl.hex)
                raise
        finally:
            meta.close()  # the mount keeps its own reference to the file
            if local is not None:
                local.close()
        return MountedLayer(digest, blob, target, local=local is not None,
                            partial=partial is not None)

    async def release(self, digest: str) -> None:
        """One user of the layer fewer. The last one's release unmounts it
        first and forgets it after: an unmount that fails (OSError) leaves
        the layer mounted and this user counted."""
        async with self._lock(digest):
            layer = self.mounted[digest]
            if layer.users == 1:
                await trio.to_thread.run_sync(self._unmount, layer, limiter=self.mount_limit)
                del self.mounted[digest]
                self.blobs.remove(digest)
                if layer.local and self.local is not None:
                    await self.local.release(layer.path.name)
                if layer.partial and self.partial is not None:
                    await self.partial.release(layer.path.name)
            layer.users -= 1

    def _unmount(self, layer: MountedLayer) -> None:
        """Worker thread: keep the layer's trace, unmount it, remove the mount point."""
        self.save_trace(layer.blob)
        unmount(layer.path)
        remove_mount_point(layer.path)

    def save_trace(self, blob: BlobFile) -> None:
        """Merge this mount's first-touch order into the layer's trace. A
        trace is a hint for later ``up``s: one that cannot be saved (an LMDB
        error) is logged and lost, and never keeps a layer mounted."""
        if not blob.trace:
            return
        try:
            kept = self.replica.trace(blob.digest)
            self.replica.put_trace(blob.digest, merge_traces(kept, list(blob.trace)))
        except Exception as exc:  # noqa: BLE001 - lmdb.Error and the like: logged, not fatal
            log.warning("access trace of layer %s not saved: %s", blob.digest, exc)

    async def unmount_all(self) -> None:
        """A stop: unmount every layer (its trace saved first), or detach it if
        it is busy. Nothing is left mounted below ``ROOT/layers``."""
        for digest in list(self.mounted):
            layer = self.mounted.pop(digest)
            await trio.to_thread.run_sync(self.save_trace, layer.blob)
            if layer.partial and self.partial is not None:
                await self._unmount_partial(layer)
            elif await unmount_or_detach(layer.path):
                await trio.to_thread.run_sync(remove_mount_point, layer.path)
            self.blobs.remove(digest)

    async def _unmount_partial(self, layer: MountedLayer) -> None:
        """A stop's unmount of a layer over a partial file. One a process keeps
        busy is detached only once its file is complete: its reads go on
        after this daemon and the keeper are gone, with no one to fill a
        hole (the kernel would return zeros)."""
        assert self.partial is not None
        hex_ = layer.path.name
        try:
            await trio.to_thread.run_sync(unmount, layer.path)
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                log.error("cannot unmount %s: %s", layer.path, exc)
                return
            log.warning("stopping: %s is busy (a process uses it): its partial blob file is "
                        "filled before it is detached", layer.path)
            if not await self.partial.complete(hex_):
                log.error("stopping: %s stays mounted: its data could not be fetched whole, "
                          "and without the daemon its reads would get zeros", layer.path)
                return
            if not await detach(str(layer.path)):
                return
        else:
            await trio.to_thread.run_sync(remove_mount_point, layer.path)
        await self.partial.release(hex_)


def unmount(path: Path) -> None:
    """Worker thread: unmount ``path``; one not mounted (any more) is unmounted already."""
    try:
        umount(str(path))
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOENT) and not os.path.ismount(path):
            return
        raise


def remove_mount_point(path: Path) -> None:
    """Worker thread: the empty directory a mount was on, gone (or gone already)."""
    try:
        path.rmdir()
    except FileNotFoundError:
        pass


async def unmount_or_detach(path: Path) -> bool:
    """A stop's unmount: plain, or lazy (one warning) if ``path`` is busy;
    False, with an error line, if it cannot be done at all."""
    try:
        await trio.to_thread.run_sync(unmount, path)
        return True
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            log.error("cannot unmount %s: %s", path, exc)
            return False
    log.warning("stopping: %s is busy (a process uses it): detached, its reads fail "
                "from now on", path)
    return await detach(str(path))


async def detach(point: str) -> bool:
    """Detach a kept mount lazily (its users keep it); False, with an error
    line, if it cannot be."""
    try:
        await trio.to_thread.run_sync(functools.partial(umount, point, lazy=True))
    except OSError as exc:
        log.error("cannot detach %s: %s", point, exc)
        return False
    return True


def mount_layer(source: str, device: str, target: Path, readahead: int) -> None:
    """Worker thread: a layer's mount point, then its EROFS mount of ``source``
    (the checked meta image) over the blob file ``device``."""
    target.mkdir(parents=True, exist_ok=True)
    mount_erofs(source, device, str(target), directio=True, readahead=readahead)
