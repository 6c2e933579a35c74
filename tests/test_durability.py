"""Nothing acknowledged is lost: gc racing a push that reuses old blobs (a retried
build, dedup with another layer), temporaries of killed file-store writes, and a
writable disk on a full ROOT; on both store backends where a store is involved.

The gc races are interleaved deterministically with hooks: gc runs inside the
push (between its reuse of a blob and its ref write) or the push runs inside gc
(between gc's reachability pass and its deletes). Blobs count as "old" for a gc
with GRACE seconds of grace once AGE_WAIT seconds have passed (S3 stamps
objects to the second, hence the margin).
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
from support import ManifestPutFails, build, need_root, small_ext4
from support.nodes import NodeDaemon

import layerfs.gc as gcmod
import layerfs.node.vms.diskfiles as disks_mod
from harness.daemonproc import LAYERFS
from layerfs.errors import BlobVanished, StoreError
from layerfs.gc import collect
from layerfs.node.vms.diskfiles import DiskState, WritableDisk
from layerfs.refstore import LAYERS, RefStore, ref_key
from layerfs.store.base import BLOB_PREFIX, TEMP_MARK, blob_key
from layerfs.store.file import FileStore
from layerfs.verify import verify_layer

pytestmark = pytest.mark.end_to_end  # the CLI and outside tools, end to end

GRACE = 1.5
AGE_WAIT = 2.1
HOUR = 3600


def write_tree(root, seed: int, files: int = 12, size: int = 60_000) -> None:
    rng = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    for i in range(files):
        with open(os.path.join(root, f"f{i:03d}"), "wb") as f:
            f.write(rng.randbytes(rng.randrange(size // 2, size * 2)))


def failed_push(store, src) -> set[str]:
    """A push that uploads its packs, chunk table and meta image, then fails; the
    blobs it left, once they are older than GRACE."""
    before = {o.key for o in store.list(BLOB_PREFIX)}
    with pytest.raises(StoreError):
        build(ManifestPutFails(store), str(src), name="app", chunk_size=16384, pack_size=65536)
    left = {o.key for o in store.list(BLOB_PREFIX)} - before
    assert len(left) >= 4  # several packs, a chunk table, a meta image
    time.sleep(AGE_WAIT)
    return left


def assert_complete(store, digest: str) -> None:
    report = verify_layer(RefStore(store), digest)
    assert report.ok, report.problems


def test_retry_survives_gc_between_reachability_and_delete(tmp_path, store, monkeypatch):
    """gc computes what is reachable; the retry reuses the old packs and writes its
    ref; gc then deletes what it thought unreachable and old."""
    write_tree(tmp_path / "src", 1)
    left = failed_push(store, tmp_path / "src")
    retried = {}
    real_reachable = gcmod.reachable_blobs

    def reachable_then_retry(refstore):
        live = real_reachable(refstore)
        retried["result"] = build(store, str(tmp_path / "src"), name="app", chunk_size=16384,
                                  pack_size=65536)
        return live

    monkeypatch.setattr(gcmod, "reachable_blobs", reachable_then_retry)
    report = collect(RefStore(store), dry_run=False, grace=GRACE)
    assert retried["result"].manifest.stats.uploaded_packs == 0  # every pack was reused
    assert_complete(store, retried["result"].digest)
    assert report.deleted == 0 and report.kept_young >= len(left)


def test_retry_survives_gc_between_reuse_and_ref(tmp_path, store, monkeypatch):
    """The retry finds its old packs stored and reuses them; a full gc runs before
    its ref is written."""
    write_tree(tmp_path / "src", 2)
    failed_push(store, tmp_path / "src")
    reports = []
    real_publish = RefStore.publish

    def gc_then_publish(self, kind, name, version, digest, same=None):
        reports.append(collect(RefStore(store), dry_run=False, grace=GRACE))
        return real_publish(self, kind, name, version, digest, same)

    monkeypatch.setattr(RefStore, "publish", gc_then_publish)
    result = build(store, str(tmp_path / "src"), name="app", chunk_size=16384, pack_size=65536)
    assert_complete(store, result.digest)
    assert reports and reports[0].deleted == 0


def test_dedup_with_a_layer_whose_ref_is_deleted_during_the_push(tmp_path, store, monkeypatch):
    """`--dedup-with base@1` references base's packs; base's ref is deleted and gc
    runs while the push is under way."""
    write_tree(tmp_path / "base", 3)
    build(store, str(tmp_path / "base"), name="base", chunk_size=16384, pack_size=65536)
    write_tree(tmp_path / "app", 3, files=14)  # base's 12 files and two more
    time.sleep(AGE_WAIT)
    reports = []
    real_publish = RefStore.publish

    def drop_base_gc_then_publish(self, kind, name, version, digest, same=None):
        if name == "app":
            store.delete(ref_key(LAYERS, "base", "1"))
            reports.append(collect(RefStore(store), dry_run=False, grace=GRACE))
        return real_publish(self, kind, name, version, digest, same)

    monkeypatch.setattr(RefStore, "publish", drop_base_gc_then_publish)
    result = build(store, str(tmp_path / "app"), name="app", chunk_size=16384, pack_size=65536,
                   dedup_with=["base@1"])
    assert result.manifest.stats.reused_chunks > 0
    assert reports and reports[0].deleted > 0  # base's own meta image and chunk table went
    assert_complete(store, result.digest)


def test_reused_pack_lost_after_the_ref_fails_the_push_and_takes_the_ref_back(
        tmp_path, store, monkeypatch):
    """A gc that looked at a reused pack before the push refreshed it may delete it
    after; the push's check after its ref catches that and publishes nothing."""
    write_tree(tmp_path / "base", 4)
    base = build(store, str(tmp_path / "base"), name="base", chunk_size=16384,
                 pack_size=65536)
    write_tree(tmp_path / "app", 4, files=14)
    real_publish = RefStore.publish
    pack = RefStore(store).chunk_table(base.manifest).packs()[0]

    def publish_then_lose_pack(self, kind, name, version, digest, same=None):
        written = real_publish(self, kind, name, version, digest, same)
        if name == "app":
            store.delete(blob_key(pack))  # what a gc in its head-to-delete window does
        return written

    monkeypatch.setattr(RefStore, "publish", publish_then_lose_pack)
    with pytest.raises(BlobVanished) as info:
        build(store, str(tmp_path / "app"), name="app", chunk_size=16384, pack_size=65536,
              dedup_with=["base@1"])
    assert pack in str(info.value) and "nothing was published" in str(info.value)
    assert RefStore(store).read_ref(LAYERS, "app", "1") is None


def test_retry_puts_back_its_own_blobs_lost_after_the_ref(tmp_path, store, monkeypatch):
    """The chunk table, meta image and manifest the push holds are written again if
    a gc took them between the push's reuse and its check."""
    write_tree(tmp_path / "src", 5)
    failed_push(store, tmp_path / "src")
    real_publish = RefStore.publish

    def publish_then_lose_table(self, kind, name, version, digest, same=None):
        written = real_publish(self, kind, name, version, digest, same)
        manifest = self.layer(digest)
        store.delete(blob_key(manifest.chunk_table.digest))
        store.delete(blob_key(manifest.meta.digest))
        return written

    monkeypatch.setattr(RefStore, "publish", publish_then_lose_table)
    result = build(store, str(tmp_path / "src"), name="app", chunk_size=16384, pack_size=65536)
    assert_complete(store, result.digest)


# -- temporaries of interrupted file-store writes --

KILLED_PUT = """
import os, sys
import layerfs.store.file as file_store

def half_then_wait(fd, data):
    os.write(fd, bytes(data[: len(data) // 2]))
    print("half", flush=True)
    sys.stdin.read()  # until killed

file_store._write_all = half_then_wait
file_store.FileStore(sys.argv[1]).put_blob(os.urandom(1 << 20))
"""


def killed_put(root) -> None:
    """A real put_blob killed with SIGKILL half-way through writing its pack."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_PUT, str(root)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "half\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def gc_cli(root, *args: str) -> dict:
    proc = subprocess.run([*LAYERFS, "gc", "--store", f"file://{root}", "--json", *args],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def test_gc_removes_temporaries_of_killed_puts_after_the_grace(tmp_path):
    root = tmp_path / "store"
    killed_put(root)
    [old] = FileStore(root).list_temporaries()
    assert old.key.startswith(BLOB_PREFIX + TEMP_MARK) and old.size == 1 << 19
    assert gc_cli(root, "--dry-run")["temporaries"][0]["young"]  # a put may still be writing
    past = time.time() - 2 * HOUR
    os.utime(root / old.key, (past, past))
    killed_put(root)  # a second one, young
    [young] = [t for t in FileStore(root).list_temporaries() if t.key != old.key]
    dry = gc_cli(root, "--dry-run")
    assert {t["key"]: t["young"] for t in dry["temporaries"]} == {old.key: False,
                                                                   young.key: True}
    assert (root / old.key).exists()
    done = gc_cli(root)
    assert done["deleted_temporaries"] == 1 and not (root / old.key).exists()
    assert [t.key for t in FileStore(root).list_temporaries()] == [young.key]


# -- writable disks on a full ROOT --

MiB = 1 << 20
WRITE = 128 << 10


def fill(fd: int, model: bytearray, rng: random.Random) -> list[int]:
    """Write the disk front to back until ROOT is full, then a few more writes
    (new data and overwrites); the model holds what was acknowledged. The
    errnos of the writes that failed."""
    errors: list[int] = []
    offsets = list(range(0, len(model), WRITE))
    for off in offsets:
        data = rng.randbytes(WRITE)
        try:
            done = os.pwrite(fd, data, off)
        except OSError as exc:
            errors.append(exc.errno or 0)
            if len(errors) >= 8:
                break
            continue
        model[off : off + done] = data[:done]
    for off in rng.sample(offsets[:16], 4):  # overwrites of acknowledged data
        data = rng.randbytes(WRITE)
        try:
            model[off : off + os.pwrite(fd, data, off)] = data
        except OSError as exc:
            errors.append(exc.errno or 0)
    return errors


def read_all(path: Path, size: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(size)


@pytest.mark.daemon_log(
    r"write of \d+ bytes failed: \[Errno 28\]",
    r"ERROR layerfs\.node\.fuse\.nodefs: write: \[Errno 28\]",
    r"WARNING layerfs\.node\.daemon\.service: cache bound lowered from ",  # a 24 MiB ROOT
)
def test_writable_disk_on_a_full_root_fails_writes_and_keeps_what_it_acknowledged(tmp_path):
    need_root()
    size = 64 * MiB  # more than ROOT can hold
    (tmp_path / "store").mkdir()  # an empty store (a missing one is unreachable)
    with small_ext4(tmp_path) as small:
        node = NodeDaemon(small / "node", ["--store", f"file://{tmp_path}/store"])
        node.log_path = tmp_path / "daemon.log"
        node.start()
        try:
            node.cli("disk", "create", "w", "--size", str(size))
            path = node.root / "fuse" / "disks" / "w"
            model = bytearray(size)
            fd = os.open(path, os.O_RDWR)
            try:
                errors = fill(fd, model, random.Random(7))
                os.fsync(fd)  # every write either failed or is stored
            finally:
                os.close(fd)
            assert errors and set(errors) <= {errno.ENOSPC, errno.EIO}
            assert read_all(path, size) == model
            node.kill()
            node.start()
            assert read_all(path, size) == model
            assert "index log cut" not in node.log()
        finally:
            node.cleanup()


def run_disk(tmp_path, steps, create: bool = True) -> None:
    """Run ``steps(disk)`` on the 32 MiB WritableDisk in tmp_path (a fresh one,
    unless ``create`` is False: then as a restarted daemon opens it)."""
    if create:
        WritableDisk.create(tmp_path / "u", DiskState("u", 32 * MiB))

    async def main() -> None:
        disk = WritableDisk(tmp_path / "u", WritableDisk.load_state(tmp_path / "u"), None)
        disk.open_files()
        try:
            await steps(disk)
        finally:
            disk.close_files()

    trio.run(main)


@pytest.mark.daemon_log(r"disk u: write of \d+ bytes failed: \[Errno 28\]")
def test_short_index_write_fails_the_write_and_leaves_no_entry(tmp_path, monkeypatch):
    """A 9 MiB write has two index entries; ROOT fills up after the first one is
    stored (a short write, then ENOSPC). The write must fail, and a later write
    must read back right, before and after a restart."""
    model = bytearray(32 * MiB)
    first, big, small = b"a" * MiB, b"b" * (9 * MiB), b"c" * MiB

    def index_full_after_one_entry(real):
        def pwrite(fd, data, offset):
            if len(data) == 32:  # the two index entries of the big write
                return real(fd, bytes(data[:16]), offset)
            if len(data) == 16 and fd == state["index_fd"]:  # the rest of them
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, data, offset)
        return pwrite

    state: dict[str, int] = {}

    async def steps(disk):
        await disk.write(0, first)
        model[0 : MiB] = first
        state["index_fd"] = disk.index_fd
        with monkeypatch.context() as patch:
            patch.setattr(disks_mod.os, "pwrite", index_full_after_one_entry(os.pwrite))
            with pytest.raises(OSError) as info:
                await disk.write(0, big)
            assert info.value.errno == errno.ENOSPC
        await disk.write(20 * MiB, small)
        model[20 * MiB : 21 * MiB] = small
        assert bytes(await disk.read(0, disk.size)) == model
        await disk.flush()

    run_disk(tmp_path, steps)
    reopened = {}

    async def read(disk):
        reopened["data"] = bytes(await disk.read(0, disk.size))

    run_disk(tmp_path, read, create=False)
    assert reopened["data"] == model


@pytest.mark.daemon_log(r"disk u: fsync failed")
def test_failed_fsync_fails_every_later_fsync_and_write(tmp_path, monkeypatch):
    """Linux reports a lost writeback once; the disk must keep saying so."""
    async def steps(disk):
        await disk.write(0, b"x" * 4096)

        def eio(fd):
            raise OSError(errno.EIO, "Input/output error")

        with monkeypatch.context() as patch:
            patch.setattr(disks_mod.os, "fsync", eio)
            with pytest.raises(OSError):
                await disk.flush()
        for attempt in (disk.flush(), disk.write(4096, b"y" * 4096)):
            with pytest.raises(OSError) as info:
                await attempt
            assert info.value.errno == errno.EIO

    run_disk(tmp_path, steps)
