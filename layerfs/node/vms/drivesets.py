"""microVM drive sets on the node: node state, like sandboxes.

``vm up`` hands a VM, for each env layer, its local meta image and its lazy
blob file as read-only drives, plus one writable disk (``ID-rw``, a disk of
:mod:`.vms.disks`). The drive set is recorded in the replica before
anything is set up (state ``starting``) and again once it all is (``up``);
a failed or cancelled ``up`` undoes every step and deletes the record.
``vm down`` releases the blob files, deletes the writable disk (unless
``--keep``) and deletes the record last. With ``pmem`` (``vm up --pmem``)
the layers are pmem drives instead (:mod:`.vms.pmem`): a padded copy of each
meta image under ``ROOT/meta/pmem`` and a padded FUSE file over each blob
under ``ROOT/fuse/pmem``, named by the layer (``shared``: the files every
such vm maps) or by the vm and the layer (``private``).

A restarted daemon (a crash or ``kill -9``, a ``--takeover``, a stop and a
start) brings every ``up`` record back before it answers a FUSE request for
an inode it does not know yet (:attr:`.fuse.nodefs.NodeFS.restored`): the blob
files under the same names and inodes, the writable disk (restored by the
disk manager first). A VMM that kept its drive files open across a live
restart reads on, and the reads the dead daemon had taken are answered by the
next one (docs/dev/node.md, Live restart). An up the last daemon did not finish
is rolled back; a vm whose blob files or disk cannot be brought back, or
whose record does not parse, is ``broken``, listed by ``vm ps`` with the
reason (its record is kept, so the next start tries again), and ``vm down``
releases what it holds and deletes the record. ``vm up --ram`` gives a vm
a RAM file and a QMP socket (``ROOT/vms/ID``); ``vm suspend`` saves it into
the store and ``vm resume`` brings it back on any node (:mod:`.vms.snapshots`):
state ``suspended`` between. A record can only name its own disk
(``ID-rw``); one that names another (a tampered record) is broken and never
owns or deletes that disk.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import trio

from ...builder.disk import publish_disk
from ...errors import LayerfsError, UsageError, VmBusy, VmExists, VmNotFound
from ...formats.chunktable import ChunkEntry, ChunkTable
from ...formats.lsmt import HT_SPACE
from ...refstore import LAYERS
from ...tasks import TaskGroup
from ..protocol import (
    DEFAULT_SNAPSHOT_DEPTH,
    VM_PMEM,
    BadMessage,
    OfflineRef,
    VmDrive,
    VmLayer,
    VmPrefetchAnswer,
    VmRam,
    VmRecord,
)
from ..reads.accesstraces import trace_bytes, trace_key
from ..reads.blobfiles import BlobDirectory, BlobFile
from ..reads.fetcher import ChunkFetcher
from ..reads.tracereplay import pushed_trace
from ..replica.noderefs import NodeRefs
from ..replica.replica import Replica, ReplicaLayer
from .diskfiles import SECTOR, pwrite_all
from .disks import DiskManager, check_disk_size, check_max_depth
from .pmem import PmemDirectory, like_parent, padded_copy
from .ramwarm import WARM_TIMEOUT, RamWarmUp
from .residency import Process, resident_runs, touches
from .snapshots import (
    HEADER_BYTES,
    SnapshotHeader,
    StateLoaded,
    coalesce,
    flush_file,
    load_state,
    new_private_file,
    read_state,
    save_state,
    snapshot_source,
)

log = logging.getLogger(__name__)
VM_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,124}")  # ID-rw is still a disk id
STARTING, UP, BROKEN, SUSPENDED = "starting", "up", "broken", "suspended"
RAM_ALIGN = 2 << 20  # a RAM size is a whole number of 2 MiB
RAM_CHUNK = 256 << 10  # a snapshot's chunks: a resume fetches what the guest touches
INCOMING_WAIT = 600.0  # seconds a resumed vm's state waits for its VMM
STATE_PIECE = 1 << 20  # the device state is read from a snapshot this much at a time
PAGE_TABLES_WAIT = 10.0  # seconds the VMM's page tables are read for at most
WORKING_SET_SECONDS = 5.0  # a resume's first seconds: the chunks touched are its working set
HOLD_WRITES = 30.0  # seconds a resume's warm-up may hold the node's cache writes at most


def touched_chunk(entry: ChunkEntry, ram_size: int, touched: list[tuple[int, int]]) -> bool:
    """Whether a chunk of a snapshot layer meets ``touched`` (runs of the RAM
    file; a chunk past the RAM, the device state's or the header's, always)."""
    start = entry.blob_offset - HT_SPACE  # (a snapshot's RAM at its own offsets)
    return start + entry.length > ram_size or touches(touched, start, entry.length)


def disk_of(vid: str) -> str:
    """The id of vm ``vid``'s writable disk."""
    return f"{vid}-rw"


def ram_disk_of(vid: str) -> str:
    """The id of the disk that serves a resumed vm ``vid``'s RAM."""
    return f"{vid}-ram"


@dataclass
class Warming:
    """A resumed vm's working set on its way into its RAM file's page cache
    (:class:`.ramwarm.RamWarmUp`), and the release of the hold it put on the
    node's cache writes meanwhile (``ChunkFetcher.hold_writes``)."""
    warm: RamWarmUp
    release_writes: Callable[[], None]


@dataclass
class Resuming:
    """What a resume hands ``_up``: the snapshot's header, its RAM disk, the
    state file written from it."""

    header: SnapshotHeader
    ram_path: str
    state: Path
    ref: str


class Vms:
    """Bring microVM drive sets up and down; their records live in the replica."""

    def __init__(self, root: Path, refs: NodeRefs, replica: Replica, blobs: BlobDirectory,
                 fetcher: ChunkFetcher, disks: DiskManager,
                 pmem: PmemDirectory | None = None, tasks: TaskGroup | None = None) -> None:
        self.root = root
        self.refs = refs  # the sandboxes' resolution: through the store or, away, the node's
        self.refstore = refs.refstore
        self.replica = replica
        self.blobs = blobs
        self.fetcher = fetcher
        self.disks = disks
        self.pmem = pmem or PmemDirectory()
        self.records: dict[str, VmRecord] = {}
        self.held: dict[str, list[str]] = {}  # the blob files each vm holds served
        self.held_pmem: dict[str, list[str]] = {}  # the pmem files (and meta copies) it holds
        self.meta_users: dict[str, int] = {}  # pmem meta copy name -> vms holding it
        self._busy: set[str] = set()  # an up or a down under way
        self._warming: dict[str, Warming] = {}  # a resumed vm's working set read ahead
        # the read of a VMM's page tables: one at a time, held by an abandoned thread
        self._page_tables = trio.CapacityLimiter(1)
        self.tasks = tasks or TaskGroup()  # the daemon's: resumed vms' state loads in it

    async def _save(self, record: VmRecord) -> None:
        await trio.to_thread.run_sync(self.replica.put_vm, record.id, record.to_json())

    async def _release(self, vid: str, disk: str | None) -> None:
        """Let go of the blob files vm ``vid`` holds and, if ``disk``, delete
        that writable disk (registered or broken), the vm's RAM disk and its
        directory (RAM file, state, QMP socket)."""
        for name in self.held_pmem.pop(vid, []):
            self.pmem.remove(name)
            await self._drop_meta_copy(name)
        for digest in self.held.pop(vid, []):
            self.blobs.remove(digest)
        if disk:  # (a damaged record names none)
            for sid in (disk, ram_disk_of(vid)):
                self.disks.owners.pop(sid, None)
                await self.disks.discard(sid)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(shutil.rmtree, self.vm_dir(vid), True)

    def vm_dir(self, vid: str) -> Path:
        """``ROOT/vms/ID``: a vm's RAM file, device state and QMP socket."""
        return self.root / "vms" / vid

    # -- commands --
    async def up(self, vid: str, env: str | None, layer_refs: list[str], disk_size: int,
                 base_disk: str | None, pmem: str = "", ram: int = 0) -> VmRecord:
        self._check_new(vid)
        if env and layer_refs or not (env or layer_refs or base_disk):
            raise UsageError("give an env or --layer refs (not both), or --base-disk alone")
        if pmem and pmem not in VM_PMEM:
            raise UsageError(f"pmem {pmem!r}: expected one of {', '.join(VM_PMEM)}")
        if ram < 0 or ram % RAM_ALIGN:
            raise UsageError(f"RAM size {ram} is not a whole number of 2 MiB")
        check_disk_size(disk_size)
        self._busy.add(vid)
        try:
            return await self._up(vid, env, layer_refs, disk_size, base_disk, pmem, ram)
        finally:
            self._busy.discard(vid)

    def _check_new(self, vid: str) -> None:
        """UsageError or VmExists unless ``vid`` is a free, valid vm id."""
        if not VM_ID.fullmatch(vid or ""):
            raise UsageError(f"invalid vm id {vid!r} (expected [A-Za-z0-9][A-Za-z0-9._-]*, "
                             "at most 125 characters)")
        if vid in self.records or vid in self._busy:
            raise VmExists(vid)
        self.disks.check_free(disk_of(vid))
        self.disks.check_free(ram_disk_of(vid))

    async def _up(self, vid: str, env: str | None, layer_refs: list[str], disk_size: int,
                  base_disk: str | None, pmem: str, ram: int = 0,
                  resuming: Resuming | None = None) -> VmRecord:
        """Record the vm as starting, hold its layers' blob files, make its
        disk, record it as up; anything that fails or is cancelled on the
        way is undone and the record deleted."""
        def resolve() -> tuple[list[str], list[OfflineRef]]:  # (none: a vm of its disk alone)
            if not env and not layer_refs:
                return [], []
            resolved = self.refs.up_layers(env, layer_refs)
            return resolved.layers, resolved.offline

        digests, offline = await trio.to_thread.run_sync(resolve)
        record = VmRecord(vid, [], [], disk=disk_of(vid), blobs=digests, state=STARTING,
                          created=time.time(), offline=offline, pmem=pmem)
        held: list[str] = []
        self.held[vid] = held
        self.held_pmem[vid] = []
        made_disk = False
        try:
            await self._save(record)  # from here a crash is rolled back at the next start
            drives: list[VmDrive] = []
            layers: list[VmLayer] = []
            for i, digest in enumerate(digests):
                rl = await trio.to_thread.run_sync(self.replica.verified_layer, self.refstore,
                                                   digest)
                self.blobs.add(digest, rl.table, self.fetcher)
                held.append(digest)
                layer_drives = await (self._pmem_drives(record, i, rl) if pmem else
                                      self._block_drives(i, rl))
                drives += layer_drives
                layers.append(VmLayer(f"{rl.manifest.name}@{rl.manifest.version}", digest,
                                      meta_drive=layer_drives[0].drive_id,
                                      device_drives=[layer_drives[1].drive_id]))
            disk = await self.disks.create(record.disk, None if base_disk else disk_size,
                                           base_disk)
            made_disk = True
            record.offline += disk.offline
            self.disks.owners[record.disk] = vid
            drives.append(VmDrive("rw", disk.path, is_read_only=False, role="disk"))
            if ram or resuming:
                record.ram = await self._ram(vid, ram, resuming)
            record.drives, record.layers, record.state = drives, layers, UP
            await self._save(record)
        except BaseException:
            with trio.CancelScope(shield=True):  # a failed up leaves nothing behind
                await self._release(vid, record.disk if made_disk else None)
                try:
                    await trio.to_thread.run_sync(self.replica.delete_vm, vid)
                except Exception as exc:  # rolled back at the next start instead
                    log.error("vm %s: cannot delete its record: %s", vid, exc)
            raise
        self.records[vid] = record
        return record

    async def _ram(self, vid: str, size: int, resuming: Resuming | None) -> VmRam:
        """A new vm's RAM file (sparse, in ``ROOT/vms/ID``, mapped shared), or
        a resumed one's RAM disk (mapped shared too) and its state file."""
        home = self.vm_dir(vid)
        qmp = str(home / "qmp")
        if resuming is not None:  # (its writes reach the disk: a next suspend commits them)
            return VmRam(resuming.ram_path, resuming.header.ram_size, share=True, qmp=qmp,
                         incoming=str(resuming.state))

        def make() -> str:
            self.vm_home(vid)
            path = home / "ram"
            fd = new_private_file(path, 0o660)
            try:
                os.ftruncate(fd, size)
                os.fchown(fd, 0, home.stat().st_gid)
                os.fchmod(fd, 0o660)
            finally:
                os.close(fd)
            return str(path)

        return VmRam(await trio.to_thread.run_sync(make), size, share=True, qmp=qmp)

    def vm_home(self, vid: str) -> Path:
        """Worker thread: ``ROOT/vms/ID`` made, writable by the FUSE group
        (the VMM makes its QMP socket there)."""
        like_parent(self.root / "vms")
        home = self.vm_dir(vid)
        home.mkdir(exist_ok=True)
        gid = home.parent.stat().st_gid
        os.chown(home, 0, gid)
        os.chmod(home, 0o770 if gid else 0o700)
        return home

    # -- suspend and resume --
    async def suspend(self, vid: str, name: str, version: str,
                      max_depth: int = DEFAULT_SNAPSHOT_DEPTH) -> VmRecord:
        """Save vm ``vid`` (its VMM running on the drive set with its RAM
        file) into the store as ``name@version``: device state through QMP,
        the writable disk committed (``name-disk@version``), RAM, state and a
        header sealed into one layer. The VMM ends; the vm is ``suspended``
        (its drive set kept until ``vm down``). A RAM or disk chain that
        would grow past ``max_depth`` layers is merged into one
        (:meth:`.vms.disks.DiskManager.commit`)."""
        check_max_depth(max_depth)
        record = self.records.get(vid)
        if record is None:
            raise VmNotFound(vid)
        if vid in self._busy:
            raise VmBusy(vid)
        if record.state != UP or record.ram is None:
            raise UsageError(f"vm {vid}: only an up vm with a RAM file (vm up --ram, or a "
                             "resumed vm) can be suspended")
        ram = record.ram
        self._busy.add(vid)
        try:
            state = await trio.to_thread.run_sync(self.vm_home, vid) / "state.out"
            await trio.to_thread.run_sync(save_state, ram.qmp, state)
            disk = await self.disks.commit(record.disk, f"{name}-disk", version,
                                           max_depth=max_depth)
            raw_state = await trio.to_thread.run_sync(read_state, state)
            header = SnapshotHeader(ram.size, len(raw_state), record.blobs, disk.digest,
                                    record.pmem, drives=[d.drive_id for d in record.drives])
            if ram_disk_of(vid) in self.disks.disks:  # resumed: its RAM is that disk
                ref = await self._commit_ram(vid, ram, raw_state, header, name, version,
                                             max_depth)
            else:
                source = snapshot_source(Path(ram.path), ram.size, raw_state, header)
                ref = (await trio.to_thread.run_sync(
                    lambda: publish_disk(self.refstore, source, name, version,
                                         chunk_size=RAM_CHUNK))).ref
            record.state, record.snapshot = SUSPENDED, ref
            await self._save(record)
        finally:
            self._busy.discard(vid)
        log.info("vm %s suspended as %s (%d bytes of device state)", vid, ref, len(raw_state))
        return record

    async def _commit_ram(self, vid: str, ram: VmRam, state: bytes, header: SnapshotHeader,
                          name: str, version: str, max_depth: int) -> str:
        """A resumed vm's snapshot: what its VMM wrote to the RAM disk (flushed
        from the page cache first), the state and the header written to the
        disk, committed over the snapshot it resumed from: only the pages
        written since, the state and the header are stored."""
        sid = ram_disk_of(vid)
        disk = self.disks.disks[sid]
        if ram.size + len(state) + HEADER_BYTES > disk.size:
            raise UsageError(f"vm {vid}: its device state ({len(state)} bytes) does not fit "
                             "the snapshot's state area")
        await trio.to_thread.run_sync(flush_file, ram.path)  # (dirty pages: FUSE writes)
        padded = state.ljust(-(-len(state) // SECTOR) * SECTOR, b"\0")
        await disk.write(ram.size, padded)
        await disk.write(disk.size - HEADER_BYTES, header.pack())
        return (await self.disks.commit(sid, name, version, RAM_CHUNK, max_depth)).ref

    async def resume(self, ref: str, vid: str) -> VmRecord:
        """Vm ``vid`` from snapshot ``ref``: its RAM a disk over the snapshot
        (read lazily), its device state a local file, its layers and a
        writable disk over the snapshot's commit, as ``vm up`` makes them."""
        self._check_new(vid)
        self._busy.add(vid)
        try:
            ram_disk = await self.disks.create(ram_disk_of(vid), None, ref)
            try:
                header, state = await self._read_snapshot(vid, ref)
                record = await self._up(vid, None, header.layers, 0, header.disk, header.pmem,
                                        resuming=Resuming(header, ram_disk.path, state, ref))
            except BaseException:
                with trio.CancelScope(shield=True):  # (_up undid its own part)
                    self.disks.owners.pop(ram_disk_of(vid), None)
                    await self.disks.discard(ram_disk_of(vid))
                    await trio.to_thread.run_sync(shutil.rmtree, self.vm_dir(vid), True)
                raise
            # only now: what the answer needs (the header, the state, the drives'
            # indexes and meta images) waited behind the working set's fetches
            working = await self._prefetch_working_set(vid)
            if working:
                log.info("vm %s: prefetching the working set of %s", vid, ref)
                self._warm_up(vid, record, working)
        finally:
            self._busy.discard(vid)
        if self.tasks.nursery is not None:
            self.tasks.nursery.start_soon(self._load_state, vid, record)
        return record

    async def _load_state(self, vid: str, record: VmRecord) -> None:
        """Once the VMM of resumed vm ``vid`` listens on its QMP socket (it
        was started with ``-incoming defer``), load the device state; the
        guest goes on. Gives up when the vm goes down or after
        :data:`INCOMING_WAIT` seconds."""
        assert record.ram is not None
        qmp, state = record.ram.qmp, record.ram.incoming
        deadline = trio.current_time() + INCOMING_WAIT
        warming = self._warming.get(vid)
        while not os.path.exists(qmp):
            if self.records.get(vid) is not record:
                log.info("vm %s went down before a VMM came for its device state", vid)
                await self._stop_warming(vid, warming)
                return
            if trio.current_time() > deadline:
                log.warning("vm %s: no VMM came for its device state", vid)
                await self._stop_warming(vid, warming)
                return
            await trio.sleep(0.02)
        loaded: StateLoaded | None = None
        try:
            if warming is not None:  # the guest goes on once its working set is in
                with trio.move_on_after(WARM_TIMEOUT):
                    await warming.warm.done.wait()
                await warming.warm.stopped()  # (from here on only the guest writes its RAM)
                if self.records.get(vid) is not record:
                    log.info("vm %s went down before its device state was loaded", vid)
                    return
            try:
                loaded = await trio.to_thread.run_sync(load_state, qmp, state)
            except (LayerfsError, OSError, ValueError) as exc:
                log.error("vm %s: its device state did not load: %s", vid, exc)
                return
            log.info("vm %s resumed from its snapshot (device state loaded in %.3f s)", vid,
                     loaded.seconds)
            await trio.sleep(WORKING_SET_SECONDS)  # (the node's cache writes wait meanwhile)
        finally:
            with trio.CancelScope(shield=True):
                await self._stop_warming(vid, warming)
        if loaded is not None and self.records.get(vid) is record:
            await self._push_working_set(vid, record, loaded.vmm)

    def _warm_up(self, vid: str, record: VmRecord, ranges: list[tuple[int, int]]) -> None:
        """Start putting resumed vm ``vid``'s working set (``ranges`` of its RAM
        file) into the file's page cache (:mod:`.ramwarm`), from the resume's
        answer on, before its VMM starts; the node's cache writes wait until
        the guest's first seconds are over (``_load_state``), at most
        :data:`HOLD_WRITES` seconds: the guest waits for this warm-up, which
        wants the cores and the disk."""
        if record.ram is None or self.tasks.nursery is None:
            return  # (no task group: the guest faults its working set in)
        warm = RamWarmUp()
        release = self.fetcher.hold_writes(self.tasks.nursery, HOLD_WRITES)
        self._warming[vid] = Warming(warm, release)
        self.tasks.nursery.start_soon(warm.run, vid, self.disks.disks[ram_disk_of(vid)],
                                      record.ram.path, coalesce(ranges, record.ram.size))

    async def _stop_warming(self, vid: str, warming: Warming | None = None) -> None:
        """End vm ``vid``'s warm-up (``warming``, if given: only that one), if
        one is on: no more stores, the cache writes let go."""
        if warming is None:
            warming = self._warming.get(vid)
        if warming is None or self._warming.get(vid) is not warming:
            return
        del self._warming[vid]
        warming.release_writes()
        await warming.warm.stopped()

    def _ram_blobs(self, vid: str) -> list[tuple[str, BlobFile]]:
        """The blob files of resumed vm ``vid``'s RAM disk chain (top first)."""
        digests = self.disks.chain_digests.get(ram_disk_of(vid), [])
        return [(d, b) for d in digests if (b := self.blobs.by_name.get(d.removeprefix(
            "sha256:"))) is not None]

    async def _push_working_set(self, vid: str, record: VmRecord, vmm: Process | None) -> None:
        """The chunks of the snapshot the resume touched so far (loading the
        state, the guest's first seconds), in first-touch order, pushed as
        the snapshot's working set where none is pushed yet: the next resume
        of it anywhere fetches them before the guest asks. Of the RAM's
        chunks the node read, only those with a page the VMM (``vmm``) has
        mapped: the kernel reads 4 MiB around each fault of a VMM that asks
        for huge pages (:mod:`.residency`); all of them where its page tables
        cannot be read."""
        assert record.ram is not None
        ram = record.ram
        reads = [(digest, blob.table.entries, list(blob.trace))
                 for digest, blob in self._ram_blobs(vid)]  # (before any await)
        touched = await self._touched_ram(vid, ram, vmm)
        if self.records.get(vid) is not record:
            return  # (went down meanwhile: its id may be another vm's now)
        store = self.refstore.store
        for digest, entries, read in reads:
            order = read if touched is None else [
                i for i in read if touched_chunk(entries[i], ram.size, touched)]
            try:
                pushed = await trio.to_thread.run_sync(pushed_trace, store, digest)
                if not order or pushed:
                    continue
                await trio.to_thread.run_sync(store.put, trace_key(digest), trace_bytes(order))
            except (LayerfsError, OSError) as exc:
                log.warning("vm %s: its working set of %s is not pushed: %s", vid, digest, exc)
                continue
            log.info("vm %s: working set of %s pushed (%d chunks; %d read)", vid, digest,
                     len(order), len(read))

    async def _touched_ram(self, vid: str, ram: VmRam,
                           vmm: Process | None) -> list[tuple[int, int]] | None:
        """The runs of resumed vm ``vid``'s RAM file its VMM has in its page
        tables (None: not known, with a line why). One read at a time on the
        node (the process is the VMM's user's): while one is under way, or a
        thread abandoned at its deadline still runs, not known."""
        deadline = time.monotonic() + PAGE_TABLES_WAIT

        def runs() -> list[tuple[int, int]]:
            st = os.stat(ram.path)  # (a request this daemon answers: never on its loop)
            assert vmm is not None
            return resident_runs(vmm, st.st_dev, st.st_ino, ram.size, deadline)

        if vmm is None:
            why = "its QMP socket's peer is not known"
        elif self._page_tables.available_tokens == 0:
            why = "another vm's are being read"
        else:
            why = f"no answer from /proc/{vmm.pid} within {PAGE_TABLES_WAIT:.0f} s"
            with trio.move_on_after(PAGE_TABLES_WAIT + 1):  # (the thread checks the deadline)
                try:
                    found = await trio.to_thread.run_sync(
                        runs, abandon_on_cancel=True, limiter=self._page_tables)
                except Exception as exc:  # noqa: BLE001 - not known: every chunk read counts
                    why = str(exc) or type(exc).__name__
                else:
                    if found:
                        return found
                    why = f"process {vmm.pid} maps none of it"
        log.info("vm %s: its VMM's pages are not known (%s): the working set is every chunk its "
                 "resume read", vid, why)
        return None

    async def prefetch(self, ref: str) -> VmPrefetchAnswer:
        """The working set pushed for snapshot ``ref`` (its RAM layers') in the
        node's cache now, ahead of a resume here (a scheduler that knows where
        it will resume a snapshot stages it there): the resume then reads it
        from the node, not the store. Its chunks are cached plain (a guest's
        RAM is read in pages). A snapshot no resume has pushed a working set
        for yet brings nothing (0 chunks); a chunk the store cannot give
        fails the request (FetchError)."""
        offline: list[OfflineRef] = []
        digest = await trio.to_thread.run_sync(self.refs.resolve, LAYERS, ref, offline)
        async with AsyncExitStack() as held:
            _, used = await self.disks.load_chain(digest, held)
            wanted: list[ChunkEntry] = []
            for layer in used:
                wanted += await self._working_set_of(
                    layer, self.blobs.by_name[layer.removeprefix("sha256:")])
            absent = list({e.sha256: e for e in wanted if self.fetcher.absent(e.sha256)}.values())
            await self.blobs.prefetcher.fetch_all(absent)  # (written plain: the chain is held)
        log.info("vm snapshot %s: working set on the node (%d chunks, %d fetched)", ref,
                 len(wanted), len(absent))
        return VmPrefetchAnswer(ref, len(wanted), sum(e.length for e in wanted),
                                sum(e.length for e in absent))

    async def _prefetch_working_set(self, vid: str) -> list[tuple[int, int]]:
        """Start fetching, in the background, the working set pushed for the
        layers of resumed vm ``vid``'s RAM; its ranges of the RAM file (none
        where none was pushed)."""
        ranges: list[tuple[int, int]] = []
        for digest, blob in self._ram_blobs(vid):
            try:
                wanted = await self._working_set_of(digest, blob)
            except OSError as exc:  # (pushed_trace's own: LayerfsError is a miss)
                log.warning("vm %s: the working set of %s is not read (%s)", vid, digest, exc)
                continue
            if wanted:
                self.blobs.prefetcher.fetch_ahead(wanted)
                ranges.extend((e.blob_offset - HT_SPACE, e.length)  # (RAM at its own offsets)
                              for e in wanted)
        return ranges

    async def _working_set_of(self, digest: str, blob: BlobFile) -> list[ChunkEntry]:
        """The chunks of snapshot layer ``digest`` its pushed working set names,
        in first-touch order (none pushed: none)."""
        order = await trio.to_thread.run_sync(pushed_trace, self.refstore.store, digest)
        entries = blob.table.entries
        return [entries[i] for i in order or [] if 0 <= i < len(entries)]

    async def _read_snapshot(self, vid: str, ref: str) -> tuple[SnapshotHeader, Path]:
        """The header and the device state of snapshot ``ref`` (through the
        RAM disk just made over it); the state written to ``ROOT/vms/ID``."""
        disk = self.disks.disks[ram_disk_of(vid)]
        if disk.size < HEADER_BYTES:
            raise UsageError(f"{ref} is not a vm snapshot")
        header = SnapshotHeader.unpack(bytes(await disk.read(disk.size - HEADER_BYTES,
                                                             HEADER_BYTES)), ref)
        if header.ram_size + header.state_bytes + HEADER_BYTES > disk.size:
            raise UsageError(f"{ref}: its header does not fit the snapshot")
        home = await trio.to_thread.run_sync(self.vm_home, vid)
        fd = await trio.to_thread.run_sync(new_private_file, home / "state", 0o640)
        try:
            for pos in range(0, header.state_bytes, STATE_PIECE):
                piece = await disk.read(header.ram_size + pos,
                                        min(STATE_PIECE, header.state_bytes - pos))
                await trio.to_thread.run_sync(pwrite_all, fd, bytes(piece), pos)
        finally:
            os.close(fd)
        self.disks.owners[ram_disk_of(vid)] = vid
        return header, home / "state"

    async def _block_drives(self, i: int, rl: ReplicaLayer) -> list[VmDrive]:
        """Layer ``i``'s meta image and lazy blob file as read-only block drives."""
        return [VmDrive(f"layer{i}-meta", str(rl.meta_path), is_read_only=True, role="meta"),
                VmDrive(f"layer{i}-blob", str(self.root / "fuse" / "blobs" / rl.hex),
                        is_read_only=True, role="device")]

    async def _pmem_drives(self, record: VmRecord, i: int, rl: ReplicaLayer) -> list[VmDrive]:
        """Layer ``i``'s meta image (a padded copy) and its lazy blob (a padded
        FUSE file over it) as pmem drives; shared: the files every vm with
        shared pmem maps, private: files of this vm's own."""
        name = rl.hex if record.pmem == "shared" else f"{record.id}.{rl.hex}"
        meta = self.pmem_meta(name)
        self.meta_users[name] = self.meta_users.get(name, 0) + 1  # (before: a down keeps it)
        try:
            meta_size = await trio.to_thread.run_sync(padded_copy, rl.meta_path, meta)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._drop_meta_copy(name)
            raise
        pm = self.pmem.add(name, self.blobs.by_name[rl.hex])
        self.held_pmem[record.id].append(name)
        return [VmDrive(f"layer{i}-meta", str(meta), is_read_only=True, role="meta",
                        kind="pmem", size=meta_size),
                VmDrive(f"layer{i}-blob", str(self.root / "fuse" / "pmem" / name),
                        is_read_only=True, role="device", kind="pmem", size=pm.size)]

    def pmem_meta(self, name: str) -> Path:
        """Where pmem name ``name``'s meta image copy is."""
        return self.root / "meta" / "pmem" / f"{name}.erofs"

    async def _drop_meta_copy(self, name: str) -> None:
        """One vm less holds pmem meta copy ``name``: deleted with its last."""
        left = self.meta_users.get(name, 0) - 1
        if left > 0:
            self.meta_users[name] = left
            return
        self.meta_users.pop(name, None)
        await trio.to_thread.run_sync(lambda: self.pmem_meta(name).unlink(missing_ok=True))

    async def down(self, vid: str, keep: bool) -> VmRecord:
        record = self.records.get(vid)
        if record is None:
            raise VmNotFound(vid)
        if vid in self._busy:
            raise VmBusy(vid)
        self._busy.add(vid)
        try:
            await self._stop_warming(vid)
            own = record.disk == disk_of(vid)  # (a tampered record may name another's)
            await self._release(vid, record.disk if own and not keep else None)
            if keep and own:
                self.disks.owners.pop(record.disk, None)
            await trio.to_thread.run_sync(self.replica.delete_vm, vid)
            del self.records[vid]
        finally:
            self._busy.discard(vid)
        return record

    def ps(self) -> list[VmRecord]:
        return [self.records[vid] for vid in sorted(self.records)]

    # -- a restart --
    async def restore(self) -> None:
        """The records an earlier daemon left, each by its state: an up it
        did not finish is rolled back; an up vm gets its blob files served
        again and its disk's owner set, or is marked broken. Run after the
        disks' restore, before the FUSE requests for unknown inodes are let
        through. A record that does not parse is logged and listed broken."""
        stored = await trio.to_thread.run_sync(self.replica.vms)
        for vid, data in sorted(stored.items()):
            try:
                record = VmRecord.from_json(data, f"vm record {vid}", extra_fields=True)
                if record.id != vid or record.state not in (STARTING, UP, SUSPENDED):
                    raise ValueError(f"id {record.id!r}, state {record.state!r}")
            except (BadMessage, ValueError) as exc:
                log.error("vm %s not restored: its record is damaged: %s", vid, exc)
                self.records[vid] = VmRecord(vid, [], [], disk="", blobs=[], state=BROKEN,
                                             error=f"its record is damaged: {exc}")
                continue
            if record.state == STARTING:
                log.info("vm %s: rolling back its unfinished up", vid)
                await self._release(vid, record.disk if record.disk == disk_of(vid) else None)
                await trio.to_thread.run_sync(self.replica.delete_vm, vid)
                continue
            await self._bring_back(record)

    async def _bring_back(self, record: VmRecord) -> None:
        vid, problems = record.id, []
        held: list[str] = []
        self.held[vid] = held
        for digest in record.blobs:
            served = self.blobs.by_name.get(digest.removeprefix("sha256:"))
            try:  # a blob served already (a layer mount's, another vm's): its table
                table = served.table if served else await trio.to_thread.run_sync(
                    self._table, digest)
            except (LayerfsError, OSError, ValueError) as exc:
                problems.append(f"layer {digest}: {exc}")
                continue
            self.blobs.add(digest, table, self.fetcher)
            held.append(digest)
        await self._bring_back_pmem(record, problems)
        if record.disk != disk_of(vid):  # only a tampered record names another's disk
            problems.append(f"its record names disk {record.disk!r}, not its own "
                            f"{disk_of(vid)!r} (left alone)")
        elif record.disk in self.disks.disks:
            self.disks.owners[record.disk] = vid
            if ram_disk_of(vid) in self.disks.disks:
                self.disks.owners[ram_disk_of(vid)] = vid
        else:
            why = self.disks.broken.get(record.disk, "it is gone")
            problems.append(f"disk {record.disk}: {why}")
        if problems:
            record.state, record.error = BROKEN, "; ".join(problems)
            log.error("vm %s restored broken: %s", vid, record.error)
        self.records[vid] = record

    async def _bring_back_pmem(self, record: VmRecord, problems: list[str]) -> None:
        """A vm's pmem files served again under the same names (and inodes),
        and its meta copies made again where they are gone."""
        by_id = {d.drive_id: d for d in record.drives}
        held = self.held_pmem.setdefault(record.id, [])
        for layer in record.layers:
            meta, device = by_id.get(layer.meta_drive), by_id.get(layer.device_drives[0])
            if not (meta and device and meta.kind == device.kind == "pmem"):
                continue
            name = Path(device.path_on_host).name
            blob = self.blobs.by_name.get(layer.digest.removeprefix("sha256:"))
            if blob is None or layer.digest not in self.held[record.id]:
                continue  # (its blob's problem is reported)
            self.meta_users[name] = self.meta_users.get(name, 0) + 1
            try:
                source = await trio.to_thread.run_sync(self.replica.layer, layer.digest)
                if source is None:
                    raise ValueError("the node does not hold the layer any more")
                await trio.to_thread.run_sync(padded_copy, source.meta_path,
                                              self.pmem_meta(name))
            except (LayerfsError, OSError, ValueError) as exc:
                problems.append(f"layer {layer.digest}: its pmem meta image: {exc}")
                await self._drop_meta_copy(name)
                continue
            self.pmem.add(name, blob)
            held.append(name)

    def _table(self, digest: str) -> ChunkTable:
        """Worker thread: a held layer's chunk table from the replica (its
        meta image was checked when ``vm up`` handed it out, and the VMM
        holds it open), else the layer fetched and checked again."""
        layer = self.replica.layer(digest)
        if layer is None:
            layer = self.replica.verified_layer(self.refstore, digest)
        return layer.table
