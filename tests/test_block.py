"""The microVM block path: sealed LSMT layers, writable disks through real loop
devices, commit and resume on another node root, qemu-img as a VMM-side
reader, VM drive sets, a snapshot's working set prefetched onto a node,
and bad LSMT input; on both store backends."""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import random
import shutil
import struct
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
from support import build, need_root
from support.nodes import LAYERFS, NodeDaemon, serving
from support.treecmp import diff_trees

from layerfs.builder.disk import build_disk
from layerfs.builder.pipeline import ChunkPipeline, DedupIndex
from layerfs.chunks import materialize_blob
from layerfs.formats import lsmt
from layerfs.manifest import BlobRef, DiskManifest
from layerfs.node.reads.accesstraces import trace_bytes, trace_key
from layerfs.refstore import LAYERS, RefStore
from layerfs.store.base import blob_key

MiB = 1 << 20

libc = ctypes.CDLL(None, use_errno=True)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(4 * MiB):
            h.update(block)
    return h.hexdigest()


def make_image(path: Path, size: int, seed: int) -> Path:
    """A sparse raw image with a few data extents at odd sector offsets."""
    rng = random.Random(seed)
    with open(path, "wb") as f:
        f.truncate(size)
        for _ in range(12):
            f.seek(rng.randrange(0, size - 300_000) // 512 * 512)
            f.write(rng.randbytes(rng.randrange(1, 250_000) // 512 * 512 + 512))
    return path


@contextmanager
def loop(path: Path | str, read_only: bool = False):
    args = ["losetup", "-f", "--show"] + (["-r"] if read_only else []) + [str(path)]
    dev = subprocess.run(args, check=True, capture_output=True, text=True).stdout.strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


@contextmanager
def mounted(dev: str, target: Path, *opts: str):
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", *opts, dev, str(target)], check=True)
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


@pytest.fixture
def node(starts_a_server, tmp_path, store, store_location):
    need_root()
    daemon = NodeDaemon(tmp_path / "node1", store_location.cli_args())
    daemon.location = store_location
    yield from serving(daemon)


@pytest.fixture
def node2(starts_a_server, tmp_path, store_location):
    """A second node root on the same store."""
    yield from serving(NodeDaemon(tmp_path / "node2", store_location.cli_args()))


def disk_path(node: NodeDaemon, sid: str) -> Path:
    return node.root / "fuse" / "disks" / sid


def page_cached(path: Path, length: int) -> int:
    """Pages of the file's first ``length`` bytes in the page cache (mincore)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        with mmap.mmap(fd, length, mmap.MAP_PRIVATE) as m:  # (untouched: the file's pages)
            vec = (ctypes.c_ubyte * (length // mmap.PAGESIZE))()
            at = ctypes.c_char.from_buffer(m)
            assert libc.mincore(ctypes.byref(at), ctypes.c_size_t(length), vec) == 0
            del at
            return sum(b & 1 for b in vec)
    finally:
        os.close(fd)


def test_a_disks_cached_pages_are_kept_across_opens_and_never_outlive_it(node):
    """A disk's file keeps the kernel's cached pages from one open to the
    next (a resumed guest's RAM read ahead before its VMM opens it), but a
    disk of the same id made again (the same inode) never shows the pages
    of the one before."""
    for seed in (b"A", b"B"):
        node.cli("disk", "create", "p", "--size", "4M")
        path = disk_path(node, "p")
        with open(path, "r+b") as f:  # the first open: nothing of the old disk is kept
            assert f.read(MiB) == bytes(MiB)
            f.seek(0)
            f.write(seed * MiB)
            f.flush()
            os.fsync(f.fileno())
        with open(path, "rb") as f:
            assert f.read(2 * MiB) == seed * MiB + bytes(MiB)
        assert page_cached(path, 2 * MiB) == 2 * MiB // mmap.PAGESIZE  # kept by this open
        node.cli("disk", "rm", "p")


# -- the sealed format --

def test_sealed_layer_fields_match_the_lsmt_layout(tmp_path, store):
    img = make_image(tmp_path / "img", 8 * MiB + 512 * 3, seed=1)
    res = build_disk(RefStore(store), str(img), "disk/a", "1", chunk_size=MiB)
    refstore = RefStore(store)
    sealed = tmp_path / "sealed"
    materialize_blob(store, refstore.chunk_table(res.manifest), str(sealed))
    raw = sealed.read_bytes()
    head, tail = raw[:4096], raw[-4096:]
    magic1 = bytes.fromhex("657E63D29444084CA2D2C8EC4FCFAE8A")
    for block, flags, index_offset in ((head, 0b111, 0), (tail, 0b110, res.manifest.index_offset)):
        assert block[0:8] == b"LSMT\0\1\2\0"
        assert block[8:24] == magic1
        assert struct.unpack_from("<I", block, 24)[0] == 390
        assert struct.unpack_from("<I", block, 28)[0] == flags  # header / data file / sealed
        assert struct.unpack_from("<Q", block, 32)[0] == index_offset
        assert struct.unpack_from("<Q", block, 48)[0] == img.stat().st_size
        uid = block[56:93]
        assert len(uid.rstrip(b"\0")) == 36 and uid[36] == 0
        assert block[93:130] == b"\0" * 37  # no parent
        assert block[132] == 1 and block[133] == 1  # version, sub_version
        assert block[390:] == b"\0" * (4096 - 390)
    index_size = struct.unpack_from("<Q", tail, 40)[0]
    assert index_size % 256 == 0 and index_size == res.manifest.index_entries
    entries = raw[index_offset : index_offset + 16 * index_size]
    rebuilt = bytearray(img.stat().st_size)
    previous_end = 0
    for i in range(index_size):
        lo, hi = struct.unpack_from("<QQ", entries, 16 * i)
        offset, length = lo & ((1 << 50) - 1), lo >> 50
        moffset, zeroed = hi & ((1 << 55) - 1), (hi >> 55) & 1
        if offset == (1 << 50) - 1:
            continue  # padding
        assert offset >= previous_end and 0 < length <= 16383 and not zeroed
        previous_end = offset + length
        assert moffset * 512 >= 4096 and (moffset + length) * 512 <= index_offset
        rebuilt[offset * 512 : (offset + length) * 512] = raw[moffset * 512 :
                                                              (moffset + length) * 512]
    assert bytes(rebuilt) == img.read_bytes()
    assert res.manifest.stats.stored_bytes < 0.5 * img.stat().st_size  # zeros not stored


def test_segment_map_against_a_model():
    rng = random.Random(5)
    for _ in range(100):
        flat: list = [None] * 300
        seg = lsmt.SegmentMap()
        for k in range(40):
            a = rng.randrange(300)
            n = min(rng.randrange(1, 50), 300 - a)
            seg.insert(lsmt.Mapping(a, n, 1000 * k, tag=k))
            flat[a : a + n] = [(k, 1000 * k + i) for i in range(n)]
        got: list = [None] * 300
        for start, length, m in seg.lookup(0, 300):
            for i in range(start, start + length):
                got[i] = None if m is None else (m.tag, m.moffset + i - m.offset)
        assert got == flat


def test_parent_chain_reads_as_one_disk(node, store, tmp_path):
    a = make_image(tmp_path / "a", 4 * MiB, seed=2)
    b = tmp_path / "b"
    shutil.copy(a, b)
    with open(b, "r+b") as f:  # the child: new data, and a range zeroed over parent data
        f.seek(MiB)
        f.write(os.urandom(300_000 // 512 * 512))
        f.seek(0)
        f.write(bytes(2 * MiB // 3 // 512 * 512))
    build_disk(RefStore(store), str(a), "chain/x", "1")
    child = build_disk(RefStore(store), str(b), "chain/x", "2", parent_ref="chain/x@1")
    assert child.manifest.parent_ref == "chain/x@1"
    node.cli("disk", "create", "d", "--base", "chain/x@2")
    assert sha256_file(disk_path(node, "d")) == sha256_file(b)
    node.cli("disk", "rm", "d")


# -- writable disks --

@pytest.mark.daemon_log(r"disk w: index log cut after entry")
def test_unaligned_writes_match_a_model(node):
    node.cli("disk", "create", "w", "--size", "4M")
    model = bytearray(4 * MiB)
    rng = random.Random(9)
    fd = os.open(disk_path(node, "w"), os.O_RDWR)
    try:
        for _ in range(200):
            off = rng.randrange(0, 4 * MiB - 70_000)
            data = rng.randbytes(rng.randrange(1, 70_000))
            assert os.pwrite(fd, data, off) == len(data)
            model[off : off + len(data)] = data
        for _ in range(50):
            off, n = rng.randrange(0, 4 * MiB), rng.randrange(1, 100_000)
            assert os.pread(fd, n, off) == bytes(model[off : off + n])
        os.fsync(fd)
    finally:
        os.close(fd)
    assert hashlib.sha256(model).hexdigest() == sha256_file(disk_path(node, "w"))
    node.kill()  # a crash after fsync loses nothing; a torn log entry is cut off
    with open(node.root / "disks" / "w" / "index", "ab") as f:
        f.write(b"\x01\x02\x03\x04\x05\x06\x07")
    node.start()
    assert hashlib.sha256(model).hexdigest() == sha256_file(disk_path(node, "w"))
    assert "index log cut" in node.log()
    node.cli("disk", "rm", "w")


def write_tree(root: Path, seed: int) -> None:
    rng = random.Random(seed)
    for d in range(4):
        sub = root / f"dir{d}"
        sub.mkdir(parents=True)
        for i in range(10):
            (sub / f"f{i}").write_bytes(rng.randbytes(rng.randrange(0, 200_000)))
    (root / "link").symlink_to("dir0/f1")


def test_ext4_commit_and_resume_on_another_node(node, node2, tmp_path):
    src1, src2 = tmp_path / "gen1", tmp_path / "gen2"
    write_tree(src1, 1)
    write_tree(src2, 2)
    node.cli("disk", "create", "vm1", "--size", "128M")
    with loop(disk_path(node, "vm1")) as dev:
        subprocess.run(["mkfs.ext4", "-q", dev], check=True)
        with mounted(dev, tmp_path / "m1") as mnt:
            shutil.copytree(src1, mnt / "gen1", symlinks=True)
        subprocess.run(["e2fsck", "-fn", dev], check=True, capture_output=True)
    first = json.loads(node.cli("disk", "commit", "vm1", "--name", "snap/vm", "--version", "1",
                                "--json").stdout)
    assert first["parent"] is None
    # resume on a second node root, lazily, and write a second generation
    node2.cli("disk", "create", "vm2", "--base", "snap/vm@1")
    with loop(disk_path(node2, "vm2")) as dev:
        with mounted(dev, tmp_path / "m2") as mnt:
            assert diff_trees(str(src1), str(mnt / "gen1"), dir_mtime=False) == []
            shutil.copytree(src2, mnt / "gen2", symlinks=True)
    second = json.loads(node2.cli("disk", "commit", "vm2", "--name", "snap/vm", "--version",
                                  "2", "--json").stdout)
    assert second["parent"] == "snap/vm@1"
    # resume the 2-deep chain back on the first node
    node.cli("disk", "create", "vm3", "--base", "snap/vm@2")
    listed = {d["id"]: d for d in json.loads(node.cli("disk", "ls", "--json").stdout)}
    assert listed["vm3"]["chain_depth"] == 2
    with loop(disk_path(node, "vm3"), read_only=True) as dev:
        subprocess.run(["e2fsck", "-fn", dev], check=True, capture_output=True)
        with mounted(dev, tmp_path / "m3", "-o", "ro,noload") as mnt:
            assert diff_trees(str(src1), str(mnt / "gen1"), dir_mtime=False) == []
            assert diff_trees(str(src2), str(mnt / "gen2"), dir_mtime=False) == []
    for sid in ("vm1", "vm3"):
        node.cli("disk", "rm", sid)
    node2.cli("disk", "rm", "vm2")


def test_commit_stores_what_changed_not_the_disk_size(node, store):
    node.cli("disk", "create", "big", "--size", "1G")
    with open(disk_path(node, "big"), "r+b") as f:
        for i in range(10):
            f.seek(i * 97 * MiB)
            f.write(os.urandom(MiB))
        f.flush()
        os.fsync(f.fileno())
    res = json.loads(node.cli("disk", "commit", "big", "--name", "snap/big", "--version", "1",
                              "--json").stdout)
    assert res["changed_bytes"] == 10 * MiB
    assert res["stored_bytes"] < 12 * MiB and res["uploaded_bytes"] < 12 * MiB
    node.cli("disk", "rm", "big")


def test_qemu_img_reads_the_disk(node, store, tmp_path):
    if not shutil.which("qemu-img"):
        pytest.fail("qemu-img (Debian qemu-utils) is required")
    img = make_image(tmp_path / "img", 16 * MiB, seed=4)
    build_disk(RefStore(store), str(img), "q/base", "1")
    node.cli("disk", "create", "q", "--base", "q/base@1")
    expect = bytearray(img.read_bytes())
    with open(disk_path(node, "q"), "r+b") as f:
        f.seek(5 * MiB + 100)
        f.write(b"written after the base" * 1000)
    expect[5 * MiB + 100 : 5 * MiB + 100 + 22_000] = b"written after the base" * 1000
    out = tmp_path / "out.raw"
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "raw", str(disk_path(node, "q")),
                    str(out)], check=True)
    assert sha256_file(out) == hashlib.sha256(expect).hexdigest()
    node.cli("disk", "rm", "q")


# -- VM drive sets --

def test_vm_drives_mount_as_the_container_view(node, store, tmp_path):
    src = tmp_path / "src"
    write_tree(src, 3)
    build(store, str(src), name="vmbase", chunk_size=65536)
    drives = json.loads(node.cli("vm", "up", "--layer", "vmbase@1", "--id", "v1",
                                 "--disk-size", "64M", "--json").stdout)
    by_id = {d["drive_id"]: d for d in drives["drives"]}
    layer = drives["layers"][0]
    meta = by_id[layer["meta_drive"]]["path_on_host"]
    blob = by_id[layer["device_drives"][0]]["path_on_host"]
    assert by_id["rw"]["is_read_only"] is False
    rootfs = Path(node.cli("up", "--layer", "vmbase@1", "--id", "c1").stdout.strip())
    layer_mount = node.root / "layers" / layer["digest"].removeprefix("sha256:")
    with loop(blob, read_only=True) as blob_dev, loop(meta, read_only=True) as meta_dev:
        with mounted(meta_dev, tmp_path / "vm", "-t", "erofs", "-o",
                     f"ro,device={blob_dev}") as mnt:
            assert diff_trees(str(layer_mount), str(mnt)) == []  # the container's layer
            assert diff_trees(str(rootfs), str(mnt), dir_mtime=False) == []  # its rootfs
    node.cli("down", "c1")
    node.cli("vm", "down", "v1")
    assert json.loads(node.cli("disk", "ls", "--json").stdout) == []


# -- bad input --

def publish_raw_sealed(store, raw: bytes, name: str, virtual_size: int,
                       parent: str | None = None) -> None:
    """Publish arbitrary bytes as a sealed layer (to test what the node refuses)."""
    pipeline = ChunkPipeline(store, DedupIndex(), MiB)
    pipeline.add_windows((off, raw[off : off + MiB]) for off in range(0, len(raw), MiB))
    pipeline.set_blob_size(len(raw))
    result = pipeline.finish()
    table = result.table.to_bytes()
    digest, _ = store.put_blob(table)
    manifest = DiskManifest(name=name, version="1", chunk_size=MiB,
                            chunk_table=BlobRef(digest, len(table)), blob_size=len(raw),
                            virtual_size=virtual_size, uuid=lsmt.new_uuid(), parent=parent,
                            parent_ref=None, index_offset=0, index_entries=0, created="now")
    mdigest, _ = store.put_blob(manifest.to_bytes())
    RefStore(store).publish(LAYERS, name, "1", mdigest)


def test_bad_lsmt_input_is_a_clear_error(node, store, tmp_path):
    img = make_image(tmp_path / "img", 2 * MiB, seed=6)
    good = build_disk(RefStore(store), str(img), "good", "1")
    node.cli("disk", "create", "ok", "--base", "good@1")
    sealed = tmp_path / "sealed"
    materialize_blob(store, RefStore(store).chunk_table(good.manifest), str(sealed))
    raw = bytearray(sealed.read_bytes())
    size = good.manifest.virtual_size

    broken_trailer = bytearray(raw)
    broken_trailer[-4096:-4088] = b"NOTLSMT!"
    publish_raw_sealed(store, bytes(broken_trailer), "bad/trailer", size)
    publish_raw_sealed(store, bytes(raw[:-100]), "bad/truncated", size)
    past = bytearray(raw)
    ioff = good.manifest.index_offset
    lo, hi = struct.unpack_from("<QQ", past, ioff)
    struct.pack_into("<QQ", past, ioff, lo, hi + (1 << 40))  # moffset far past the data
    publish_raw_sealed(store, bytes(past), "bad/index", size)
    # a parent the daemon has not read yet (it keeps manifests it verified: they are immutable)
    lost = build_disk(RefStore(store), str(img), "lost", "1")
    child = build_disk(RefStore(store), str(img), "orphan", "1", parent_ref="lost@1")
    cases = [("bad/trailer@1", "bad magic"), ("bad/truncated@1", "bad"),
             ("bad/index@1", "past the data")]
    for ref, words in cases:
        proc = node.cli("disk", "create", "x", "--base", ref, check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 6 and len(lines) == 1 and words in lines[0], proc.stderr
    store.delete(blob_key(lost.digest))  # the parent's manifest disappears
    proc = node.cli("disk", "create", "x", "--base", child.ref, check=False)
    assert proc.returncode == 5 and "no such parent layer" in proc.stderr
    proc = node.cli("disk", "create", "y", "--size", "1000", check=False)
    assert proc.returncode == 2 and "multiple of 512" in proc.stderr
    odd = tmp_path / "odd.img"
    odd.write_bytes(b"x" * 1000)
    proc = subprocess.run([*LAYERFS, "build-disk", str(odd), "--name", "odd", "--version", "1",
                           *node.location.cli_args()], capture_output=True, text=True)
    assert proc.returncode == 3 and "multiple of 512" in proc.stderr
    # the daemon kept serving the good disk all along
    assert sha256_file(disk_path(node, "ok")) == sha256_file(img)
    node.cli("disk", "rm", "ok")


def test_disk_and_vm_errors_name_the_disk_or_vm(node):
    node.cli("disk", "create", "d1", "--size", "1M")
    cases = [(("disk", "create", "d1", "--size", "1M"), "disk d1: already exists"),
             (("disk", "rm", "nope"), "disk nope: no such disk"),
             (("vm", "down", "nope"), "vm nope: no such vm")]
    for (argv, message), code in zip(cases, (9, 5, 5), strict=True):  # exists, not found
        proc = node.cli(*argv, check=False)
        assert (proc.returncode, proc.stderr.strip()) == (code, f"layerfs: error: {message}")
    # the failed create left the first disk serving as it was
    assert os.path.getsize(disk_path(node, "d1")) == 1 << 20
    node.cli("disk", "rm", "d1")


def test_vm_prefetch_brings_a_snapshots_working_set_onto_the_node(node, node2, store):
    """``vm prefetch``: the working set pushed for a snapshot's RAM layer
    (the chunks a first resume touched) fetched onto another node ahead of a
    resume there, cached plain (a guest reads its RAM in pages), once: a
    second prefetch fetches nothing; a snapshot with no working set yet
    brings nothing; an unknown ref is one error line."""
    node.cli("disk", "create", "ram", "--size", "16M")
    text = b"".join(b"page %d of a guest's memory\n" % i for i in range(400_000))
    with open(disk_path(node, "ram"), "r+b") as f:
        f.write(text[:8 * MiB])  # compressible: the store holds zstd frames
        f.flush()
        os.fsync(f.fileno())
    node.cli("disk", "commit", "ram", "--name", "snap/ram", "--version", "1")
    node.cli("disk", "rm", "ram")
    refstore = RefStore(store)
    digest = refstore.resolve(LAYERS, "snap/ram@1")
    entries = refstore.chunk_table(refstore.disk(digest)).entries

    def prefetch() -> dict:
        return json.loads(node2.cli("vm", "prefetch", "snap/ram@1", "--json").stdout)

    assert prefetch() == {"ref": "snap/ram@1", "chunks": 0, "bytes": 0, "fetched_bytes": 0}
    store.put(trace_key(digest), trace_bytes([1, 0, 3]))
    want = sum(entries[i].length for i in (0, 1, 3))
    assert prefetch() == {"ref": "snap/ram@1", "chunks": 3, "bytes": want, "fetched_bytes": want}
    fetched = node2.request("stats")["cache"]["bytes_fetched"]  # (and the layer's index)
    assert prefetch()["fetched_bytes"] == 0
    assert node2.request("stats")["cache"]["bytes_fetched"] == fetched
    for i in (0, 1, 3):
        sha = entries[i].sha256.hex()
        assert (node2.root / "cache" / sha[:2] / sha).read_bytes()[:8] == b"LFSCACH3"
    missing = node2.cli("vm", "prefetch", "snap/none@1", check=False)
    assert missing.returncode != 0 and len(missing.stderr.strip().splitlines()) == 1
