"""Writable disks on the node.

``disk create`` makes an LSMT writable disk over an optional sealed chain
(fetched lazily, like EROFS layers); ``disk commit`` seals the writes made
since the last commit into a new layer whose parent is the previous one and
publishes it. A microVM's writable disk is one of these, owned by its vm
(:mod:`.vms.drivesets`) while the vm is up: ``disk rm`` refuses it. A disk whose chain
cannot be loaded fails alone, with a clear error; the others keep serving.
A base ref resolves as ``up``'s refs do (:class:`.replica.noderefs.NodeRefs`): through the
store, or while it is away through this node's last resolution (said in the
answer's ``offline``); a disk's base is kept as a digest, so a restart opens
the same chain, from the manifests the replica holds, with or without the
store.

What a command sets up before it can fail (blob files held open, a disk's
directory) is undone in one place: each step registers its undo on the
command's :meth:`DiskManager._rollback` stack, which runs them only if the
command does not complete.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import trio

from ...builder.disk import DiskResult, DiskSource, publish_disk
from ...errors import (
    DiskBroken,
    DiskBusy,
    DiskExists,
    DiskInUse,
    DiskNotFound,
    LayerfsError,
    UsageError,
)
from ...formats import lsmt
from ...formats.chunktable import ChunkTable
from ...names import check_node_id
from ...refstore import LAYERS, RefStore
from ..protocol import BrokenDisk, DiskCommitAnswer, DiskRecord, OfflineRef
from ..reads.blobfiles import DISK_KIND, BlobDirectory, BlobFile, stable_inode
from ..reads.fetcher import ChunkFetcher
from ..replica.noderefs import NodeRefs
from ..replica.replica import Replica
from .diskfiles import DATA_START, SECTOR, DiskState, SealedChain, SealedLayer, WritableDisk

log = logging.getLogger(__name__)
BASE_KEPT = "base-kept"  # in a disk's directory: its base's resolution is kept on the node


class DiskManager:
    def __init__(self, root: Path, refs: NodeRefs, replica: Replica, blobs: BlobDirectory,
                 fetcher: ChunkFetcher) -> None:
        self.root = root
        self.dir = root / "disks"
        self.refs = refs
        self.refstore: RefStore = refs.refstore
        self.replica = replica
        self.blobs = blobs
        self.fetcher = fetcher
        self.disks: dict[str, WritableDisk] = {}
        self.chain_digests: dict[str, list[str]] = {}
        self.by_inode: dict[int, WritableDisk] = {}
        self.owners: dict[str, str] = {}  # disk id -> the vm whose writable disk it is
        self.broken: dict[str, str] = {}
        self._busy: set[str] = set()

    # -- rollback --
    @asynccontextmanager
    async def _rollback(self) -> AsyncIterator[AsyncExitStack]:
        """A stack of undo steps, run (last first) only if the block raises."""
        async with AsyncExitStack() as undo:
            yield undo
            undo.pop_all()

    def _hold_blob(self, undo: AsyncExitStack, digest: str, table: ChunkTable) -> BlobFile:
        """Serve a layer's blob file, its chunks cached plain (a guest reads
        them in blocks); released again if the command fails."""
        blob = self.blobs.add(digest, table, self.fetcher)
        self.fetcher.keep_plain(table.entries)
        undo.callback(self._release_blob, digest)
        return blob

    def _release_blob(self, digest: str) -> None:
        blob = self.blobs.by_name.get(digest.removeprefix("sha256:"))
        if blob is not None:
            self.fetcher.forget_plain(blob.table.entries)
        self.blobs.remove(digest)

    async def _delete_dir(self, path: Path) -> None:
        with trio.CancelScope(shield=True):  # also when the command was cancelled
            await trio.to_thread.run_sync(shutil.rmtree, path, True)

    # -- chains --
    async def load_chain(self, digest: str,
                         undo: AsyncExitStack) -> tuple[SealedChain, list[str]]:
        """Load the sealed chain whose top layer is ``digest``, lazily."""
        chain = await trio.to_thread.run_sync(self.refstore.disk_chain, digest)
        layers, used = [], []
        for layer_digest, manifest in chain:
            table = await trio.to_thread.run_sync(
                self.replica.fetch_table, self.refstore, layer_digest, manifest.to_bytes(),
                manifest.chunk_table.digest)
            blob = self._hold_blob(undo, layer_digest, table)
            used.append(layer_digest)
            name = f"{manifest.name}@{manifest.version}"
            layers.append(await SealedLayer.load(name, blob))
        return SealedChain(layers), used

    def _register(self, disk: WritableDisk, used: list[str]) -> None:
        sid = disk.state.id
        inode = stable_inode(sid, DISK_KIND)
        self.disks[sid] = disk
        self.by_inode[inode] = disk
        self.chain_digests[sid] = used
        disk.inode = inode

    # -- commands --
    def check_free(self, sid: str) -> None:
        """DiskExists unless no disk ``sid`` is there or being made."""
        if sid in self.disks or sid in self._busy or (self.dir / sid).exists():
            raise DiskExists(sid)

    async def create(self, sid: str, size: int | None, base: str | None) -> DiskRecord:
        """Make disk ``sid``; its record, with the refs resolved without the store."""
        check_node_id("disk", sid)
        self.check_free(sid)
        if size is not None:
            check_disk_size(size)
        offline: list[OfflineRef] = []
        self._busy.add(sid)
        try:
            async with self._rollback() as undo:
                await self._create(sid, size, base, undo, offline)
        finally:
            self._busy.discard(sid)
        record = self.describe(sid)
        record.offline = offline
        return record

    async def _create(self, sid: str, size: int | None, base: str | None,
                      undo: AsyncExitStack, offline: list[OfflineRef]) -> None:
        chain: SealedChain | None = None
        used: list[str] = []
        base_digest: str | None = None
        if base:
            base_digest = await trio.to_thread.run_sync(self.refs.resolve, LAYERS, base, offline)
            chain, used = await self.load_chain(base_digest, undo)
        if size is None:
            size = chain.virtual_size if chain else 0
        if size <= 0 or size % SECTOR:
            raise UsageError(f"disk size {size} is not a positive multiple of 512")
        state = DiskState(sid, size, base_digest, base)
        undo.push_async_callback(self._delete_dir, self.dir / sid)
        await trio.to_thread.run_sync(WritableDisk.create, self.dir / sid, state)
        if base:  # its resolution kept by the resolve
            await trio.to_thread.run_sync((self.dir / sid / BASE_KEPT).touch)
        disk = WritableDisk(self.dir / sid, state, chain)
        await trio.to_thread.run_sync(disk.open_files)
        self._register(disk, used)

    async def restore(self) -> None:
        """Reopen the disks an earlier run left; a broken one is reported, not fatal."""
        if not self.dir.exists():
            return
        for path in sorted(self.dir.iterdir()):
            try:
                async with self._rollback() as undo:
                    await self._restore(path, undo)
            except (LayerfsError, OSError, ValueError, TypeError) as exc:
                self.broken[path.name] = str(exc)
                log.error("disk %s cannot be opened: %s", path.name, exc)

    async def _restore(self, path: Path, undo: AsyncExitStack) -> None:
        state = await trio.to_thread.run_sync(WritableDisk.load_state, path)
        chain, used = (await self.load_chain(state.base, undo)) if state.base else (None, [])
        disk = WritableDisk(path, state, chain)
        await trio.to_thread.run_sync(disk.open_files)
        self._register(disk, used)
        if state.base and state.base_ref and not (path / BASE_KEPT).exists():
            await trio.to_thread.run_sync(self._keep_base, path, state)

    def _keep_base(self, path: Path, state: DiskState) -> None:
        """Worker thread: a disk made before the node kept resolutions has its
        base's kept now, once (a resolution the store later forgets stays
        forgotten); a failure is one warning, the disk is served."""
        assert state.base and state.base_ref
        try:
            made = (path / "state.json").stat().st_mtime  # made, or last committed
            self.refs.remember(LAYERS, state.base_ref, state.base, made)
            (path / BASE_KEPT).touch()
        except Exception as exc:  # noqa: BLE001 - only a fallback for a store outage
            log.warning("disk %s: the resolution of its base %s is not kept (%s)",
                        state.id, state.base_ref, exc)

    async def remove(self, sid: str) -> None:
        disk = self._get(sid)
        if sid in self.owners:
            raise DiskInUse(sid, self.owners[sid])
        self._busy.add(sid)
        try:
            del self.disks[sid]
            self.by_inode.pop(disk.inode, None)
            await trio.to_thread.run_sync(disk.close_files)
            for d in self.chain_digests.pop(sid, []):
                self._release_blob(d)
            await trio.to_thread.run_sync(shutil.rmtree, disk.path, True)
        finally:
            self._busy.discard(sid)

    async def discard(self, sid: str) -> None:
        """Delete disk ``sid`` whatever it is: a disk served (as :meth:`remove`
        does), a broken one's directory, or nothing if there is none."""
        if sid in self.disks:
            await self.remove(sid)
        elif sid in self.broken:
            await self._delete_dir(self.dir / sid)
            del self.broken[sid]

    def _get(self, sid: str) -> WritableDisk:
        disk = self.disks.get(sid)
        if disk is None:
            if sid in self.broken:
                raise DiskBroken(sid, self.broken[sid])
            raise DiskNotFound(sid)
        if sid in self._busy:
            raise DiskBusy(sid)
        return disk

    async def commit(self, sid: str, name: str, version: str, chunk_size: int = 1 << 20,
                     max_depth: int = 0) -> DiskCommitAnswer:
        """Seal the writes since the last commit into layer ``name@version``
        over the previous commit (or the base). With ``max_depth``, a commit
        that would make the chain deeper than that merges it instead: the
        layer holds the whole disk (the chain's data and the writes, read
        through the disk; its chunks mostly the chain's, deduplicated) and
        has no parent, so a disk over it reads through one layer."""
        check_max_depth(max_depth)
        disk = self._get(sid)
        async with disk.lock:  # a consistent cut of the log; writes wait briefly
            await trio.to_thread.run_sync(disk.sync, limiter=disk.io)
            changes = disk.changes_since_commit()
            mark = len(disk.log)
        parent = disk.state.base_ref or disk.state.base
        below = [d for d, _ in await trio.to_thread.run_sync(
            self.refstore.disk_chain, disk.state.base)] if disk.state.base else []
        merge = bool(max_depth) and len(below) + 1 > max_depth
        if merge:
            source, parent, dedup = merged_source(disk), None, below
        else:
            source, dedup = commit_source(disk, changes), []
        result = await trio.to_thread.run_sync(
            lambda: publish_disk(self.refstore, source, name, version, parent,
                                 chunk_size=chunk_size, dedup_with=dedup))
        if merge:
            log.info("disk %s: %s merges its chain of %d layers into one", sid, result.ref,
                     len(below) + 1)
        disk.state.base, disk.state.base_ref, disk.state.commit_mark = (
            result.digest, result.ref, mark)
        await trio.to_thread.run_sync(WritableDisk.save_state, disk.path, disk.state)
        await self._keep_commit(sid, name, version, result)
        return DiskCommitAnswer(ref=result.ref, digest=result.digest,
                                published=result.published,
                                changed_bytes=sum(m.length for m in changes) * SECTOR,
                                stored_bytes=result.manifest.stats.stored_bytes,
                                uploaded_bytes=result.uploaded_bytes,
                                parent=parent, depth=1 if merge else len(below) + 1,
                                merged=len(below) + 1 if merge else 0)

    async def _keep_commit(self, sid: str, name: str, version: str,
                           result: DiskResult) -> None:
        """The committed layer's manifest, chunk table, resolution and index
        (the chunks its trailer and index are in) kept on the node, so that
        the disk, over it from now on, reopens while the store is away, and a
        disk over it can be made then (the commit's data chunks are fetched on
        first read, as any layer's). The commit stands if this fails (one
        warning)."""
        manifest = result.manifest.to_bytes()
        try:
            table = await trio.to_thread.run_sync(
                self.replica.fetch_table, self.refstore, result.digest, manifest,
                result.manifest.chunk_table.digest)
            async with AsyncExitStack() as held:  # the blob file only while its index is read
                await SealedLayer.load(result.ref, self._hold_blob(held, result.digest, table))
            # the node's own publication: it replaces what the node kept before
            await trio.to_thread.run_sync(self.replica.keep_resolution, LAYERS, name, version,
                                          result.digest, time.time(), manifest)
            await trio.to_thread.run_sync((self.dir / sid / BASE_KEPT).touch)
        except Exception as exc:  # noqa: BLE001 - the commit is published and recorded
            log.warning("disk %s: %s is committed, but not kept on the node (%s): "
                        "the disk reopens only with the store", sid, result.ref, exc)

    def describe(self, sid: str) -> DiskRecord:
        disk = self.disks[sid]
        return DiskRecord(id=sid, size=disk.size, path=str(self.root / "fuse" / "disks" / sid),
                          base=disk.state.base, base_ref=disk.state.base_ref,
                          chain_depth=len(disk.chain.layers) if disk.chain else 0,
                          written_bytes=(disk.data_end - DATA_START) * SECTOR,
                          uncommitted_entries=len(disk.log) - disk.state.commit_mark)

    def ls(self) -> list[DiskRecord | BrokenDisk]:
        rows: list[DiskRecord | BrokenDisk] = [self.describe(sid) for sid in sorted(self.disks)]
        rows += [BrokenDisk(sid, err) for sid, err in sorted(self.broken.items())]
        return rows

    async def close_all(self) -> None:
        for disk in list(self.disks.values()):
            try:
                await trio.to_thread.run_sync(disk.close_files)
            except OSError as exc:
                log.error("closing disk %s: %s", disk.state.id, exc)


def check_disk_size(size: object) -> int:
    """A disk size must be a whole, positive number of 512-byte sectors."""
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or size % SECTOR:
        raise UsageError(f"disk size {size!r} is not a positive multiple of 512")
    return size


def check_max_depth(depth: object) -> int:
    """A chain bound: 0 (none) or 1 to the LSMT limit of layers."""
    if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= lsmt.MAX_LAYERS:
        raise UsageError(f"max depth {depth!r} is not a number of layers from 1 to "
                         f"{lsmt.MAX_LAYERS} (0: no bound)")
    return depth


def merged_source(disk: WritableDisk) -> DiskSource:
    """The whole disk as one sealed layer's source: every sector the chain
    maps (its zeroed extents left as holes) or the disk wrote, read through
    the disk (the chain's chunks fetched as for any read) from the worker
    thread that builds the layer."""
    extents = lsmt.SegmentMap()
    for m in disk.chain.map.items if disk.chain is not None else []:
        if not m.zeroed:
            extents.insert(lsmt.Mapping(m.offset, m.length, 0))
    for m in disk.map.items:
        extents.insert(lsmt.Mapping(m.offset, m.length, 0))
    mappings = [lsmt.Mapping(m.offset, m.length, m.offset + DATA_START) for m in extents.items]

    def read(offset: int, length: int) -> bytes:
        return bytes(trio.from_thread.run(disk.read, offset, length))

    return DiskSource(disk.size, mappings, read)


def commit_source(disk: WritableDisk, changes: list[lsmt.Mapping]) -> DiskSource:
    """The changes as a sealed-layer source: data read back from the disk's data file."""
    index = lsmt.SegmentMap(changes)
    mappings = [lsmt.Mapping(m.offset, m.length, m.offset + DATA_START) for m in changes]

    def read(offset: int, length: int) -> bytes:
        assert offset % SECTOR == 0 and length % SECTOR == 0
        out = bytearray(length)
        first = offset // SECTOR
        for start, count, m in index.lookup(first, length // SECTOR):
            if m is not None:
                pos = (start - first) * SECTOR
                src = (m.moffset + start - m.offset) * SECTOR
                out[pos : pos + count * SECTOR] = os.pread(disk.data_fd, count * SECTOR, src)
        return bytes(out)

    return DiskSource(disk.size, mappings, read)
