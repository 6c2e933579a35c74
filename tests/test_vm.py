"""microVMs for real: QEMU guests (TCG) boot on the drives ``vm up`` hands
out, and a vm's drive set outlives a daemon restart like a sandbox.

Guests (harness.guest): Debian's cloud kernel, fetched once into
/var/cache/layerfs-tests, and a busybox initramfs made by the test. A guest
boots from a writable disk over a ``build-disk`` base, writes, and its
commit boots on a second node root with the write in it; a guest mounts a
layer's EROFS drives and reads its blob drive in a loop while the daemon is
killed (``kill -9``) and started again, then replaced (``--takeover``):
every read right, none failed. Without QEMU (Debian qemu-system-x86) or a
kernel the guest tests skip; in CI they must run. Each boot takes 5-15 s on
the shared 2-core VM (TCG), 60-90 s allowed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import IN_CI, build, need_root
from support.nodes import NodeDaemon, serving, take_over, wait_for

from harness import guest
from layerfs.builder.disk import build_disk
from layerfs.builder.env import create_env
from layerfs.chunks import materialize_blob
from layerfs.node import Client
from layerfs.node.protocol import VmRecord
from layerfs.node.replica.replica import Replica
from layerfs.node.vms.snapshots import Qmp, QmpError, new_private_file, read_state
from layerfs.node.vms.vmmargs import guest_device, qemu_drive_args, qemu_memory_args, qemu_ram_args
from layerfs.refstore import RefStore

MiB = 1 << 20
FILE_STORE = pytest.mark.parametrize("store_location", ["file"], indirect=True)
FILE_LINE = re.compile(r"^FILE (\w{64})  \./(.+)$")  # sha256sum's line of a file in the guest
PASS_TIMEOUT = 90.0  # one pass of the guest's read loop, a daemon switch included


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(4 * MiB):
            h.update(block)
    return h.hexdigest()


@pytest.fixture
def node(starts_a_server, tmp_path, store, store_location):
    need_root()
    yield from serving(NodeDaemon(tmp_path / "node1", store_location.cli_args()))


@pytest.fixture
def node2(starts_a_server, tmp_path, store_location):
    """A second node root on the same store."""
    yield from serving(NodeDaemon(tmp_path / "node2", store_location.cli_args()))


def unavailable(why: str) -> None:
    if IN_CI:
        pytest.fail(f"CI boots real guests: {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def kernel() -> guest.GuestKernel:
    """The guest kernel (fetched once into the cache), where QEMU runs."""
    need_root()
    if guest.qemu_or_none() is None:
        unavailable(f"no {guest.QEMU} (Debian qemu-system-x86: make apt-deps)")
    try:
        return guest.guest_kernel()
    except guest.GuestUnavailable as exc:
        unavailable(str(exc))
        raise


def vm_up(node: NodeDaemon, *args: str) -> dict:
    return json.loads(node.cli("vm", "up", *args, "--json").stdout)


def layer_tree(root: Path, seed: int) -> dict[str, str]:
    """A layer's files (a large one for the read loop); their sha256 by path."""
    rng = random.Random(seed)
    files = {"data/big.bin": rng.randbytes(12 * MiB), "data/small.txt": b"small file\n" * 30,
             "etc/motd": b"hello from a layerfs layer\n", "empty": b""}
    for i in range(6):
        files[f"lib/part{i}.bin"] = rng.randbytes(rng.randrange(1, 300_000))
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


# -- drive sets across a restart (no guest) --

# holds a vm's blob file and disk open: writes the disk and syncs, then on
# each line "check" reads the whole blob (page cache dropped) and the bytes
# written, through the descriptors opened before, and prints them
HOLDER = textwrap.dedent("""
    import hashlib, os, sys
    blob = os.open(sys.argv[1], os.O_RDONLY)
    disk = os.open(sys.argv[2], os.O_RDWR)
    os.pwrite(disk, b"written-before-the-restarts", 4096)
    os.fsync(disk)
    print("ready", flush=True)
    for line in sys.stdin:
        os.posix_fadvise(blob, 0, 0, os.POSIX_FADV_DONTNEED)
        h = hashlib.sha256(os.pread(blob, os.fstat(blob).st_size, 0)).hexdigest()
        print(h, os.pread(disk, 27, 4096).decode(), flush=True)
""")


def ask(proc: subprocess.Popen, line: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline()


def test_vm_up_hands_out_roles_and_qemu_arguments_and_survives_restarts(node, store,
                                                                        tmp_path):
    """``vm up --json``: each drive's path, read-only flag and role, and QEMU's
    arguments; the drive set is recorded: after ``kill -9`` and a start, and
    after a ``--takeover``, a process that opened the files before reads
    them right through the same descriptors, and ``vm ps`` lists it; its disk cannot be removed
    under it; ``vm down`` releases all of it."""
    src = tmp_path / "src"
    want = layer_tree(src, 1)
    build(store, str(src), name="vmdata", chunk_size=MiB)
    doc = vm_up(node, "--layer", "vmdata@1", "--id", "v1", "--disk-size", "8M")
    roles = [(d["drive_id"], d["role"], d["is_read_only"]) for d in doc["drives"]]
    assert roles == [("layer0-meta", "meta", True), ("layer0-blob", "device", True),
                     ("rw", "disk", False)]
    assert doc["state"] == "up" and doc["disk"] == "v1-rw"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", doc["created"])
    assert doc["qemu"] == qemu_drive_args(VmRecord.from_json(
        {k: v for k, v in doc.items()
         if k not in ("qemu", "created", "cloud_hypervisor", "firecracker")}).drives)
    assert doc["qemu"][:4] == [
        "-drive", f"file={doc['drives'][0]['path_on_host']},format=raw,if=none,"
        "id=layer0-meta,cache=none,aio=threads,readonly=on",
        "-device", "virtio-blk-device,drive=layer0-meta,serial=layer0-meta"]
    assert "readonly" not in doc["qemu"][-3]
    for args, code, words in ((("--id", "v1"), 9, "vm v1: already exists"),
                              (("--id", "../v3"), 2, "invalid vm id '../v3'"),
                              (("--id", "v" * 126), 2, "invalid vm id"),
                              (("--id", "v3", "--base-disk", ""), 2, "give an env or --layer")):
        layer = [] if "--base-disk" in args else ["--layer", "vmdata@1"]
        proc = node.cli("vm", "up", *layer, *args, check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == code and len(lines) == 1 and words in lines[0], proc.stderr
    assert [vm.id for vm in Client(node.root).vm_ps()] == ["v1"]  # nothing left of those
    text = node.cli("vm", "up", "--layer", "vmdata@1", "--id", "v2").stdout
    assert "mount -t erofs -o ro,device=/dev/vdb /dev/vda" in text and "\nqemu: -drive " in text
    node.cli("vm", "down", "v2")

    expected_blob = tmp_path / "blob"
    materialize_blob(store, RefStore(store).chunk_table(RefStore(store).layer(
        doc["layers"][0]["digest"])), str(expected_blob))
    # the files are held by another process: one the test forks while the
    # daemon is dead would block closing them (FUSE's flush)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, doc["drives"][1]["path_on_host"],
                               doc["drives"][2]["path_on_host"]], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        for switch in ("kill", "takeover"):
            if switch == "kill":
                node.kill()
                node.start()
            else:
                take_over(node)
            out, _ = holder.communicate("check\n", timeout=60) if switch == "takeover" else (
                ask(holder, "check"), None)
            assert out.split() == [sha256_file(expected_blob), "written-before-the-restarts"]
            rows = json.loads(node.cli("vm", "ps", "--json").stdout)
            assert [(r["id"], r["state"], r["disk"]) for r in rows] == [("v1", "up", "v1-rw")]
            assert rows[0]["drives"] == doc["drives"]
        assert holder.returncode == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(30)
    assert "took over the FUSE connection" in node.log()
    proc = node.cli("disk", "rm", "v1-rw", check=False)
    assert (proc.returncode, proc.stderr.strip()) == (
        15, "layerfs: error: disk v1-rw: the writable disk of vm v1: take the vm down first "
        "(`layerfs vm down`)")
    assert "v1  " in node.cli("vm", "ps").stdout
    node.cli("vm", "down", "v1")
    assert json.loads(node.cli("vm", "ps", "--json").stdout) == []
    assert json.loads(node.cli("disk", "ls", "--json").stdout) == []
    assert os.listdir(node.root / "fuse" / "blobs") == []
    assert want  # (the layer's files: the guest test reads them)


@FILE_STORE
@pytest.mark.daemon_log(r"ERROR layerfs\.node\.vms\.drivesets: vm v-damaged not restored: its "
                        r"record "
                        r"is damaged", r"ERROR layerfs\.node\.vms\.drivesets: vm v-lost "
                                       r"restored broken: "
                        r"layer sha256:0{64}: .*; disk v-lost-rw: it is gone",
                        r"ERROR layerfs\.node\.vms\.drivesets: vm v-thief restored broken: its "
                        r"record "
                        r"names disk 'v-ok-rw', not its own 'v-thief-rw' \(left alone\)")
def test_restore_rolls_back_an_unfinished_up_and_reports_what_it_cannot_bring_back(
        node, store, tmp_path):
    """Records a crash can leave: an up that did not finish (its disk made) is
    rolled back; a damaged record, and a vm whose layer and disk are gone,
    are broken, listed with the reason, and ``vm down`` removes them. A
    tampered record naming another vm's disk is broken too, and its ``vm
    down`` (and a tampered unfinished up naming it) leaves that disk alone."""
    src = tmp_path / "src"
    layer_tree(src, 2)
    build(store, str(src), name="vmdata", chunk_size=MiB)
    for vid in ("v-ok", "v-ok2"):  # sharing a layer: one blob file, two users
        vm_up(node, "--layer", "vmdata@1", "--id", vid, "--disk-size", "1M")
    node.cli("disk", "create", "v-half-rw", "--size", "1M")
    node.stop()
    replica = Replica(node.root)
    try:
        half = VmRecord("v-half", [], [], disk="v-half-rw", blobs=[], state="starting")
        replica.put_vm("v-half", half.to_json())
        replica.put_vm("v-damaged", {"id": "v-damaged", "drives": "not a list"})
        lost = VmRecord("v-lost", [], [], disk="v-lost-rw", blobs=["sha256:" + "0" * 64])
        replica.put_vm("v-lost", lost.to_json())
        thief = VmRecord("v-thief", [], [], disk="v-ok-rw", blobs=[])
        replica.put_vm("v-thief", thief.to_json())
        half_thief = VmRecord("v-half2", [], [], disk="v-ok2-rw", blobs=[], state="starting")
        replica.put_vm("v-half2", half_thief.to_json())
    finally:
        replica.close()
    node.start()
    assert "vm v-half: rolling back its unfinished up" in node.log()
    rows = {r["id"]: r for r in json.loads(node.cli("vm", "ps", "--json").stdout)}
    assert sorted(rows) == ["v-damaged", "v-lost", "v-ok", "v-ok2", "v-thief"]
    assert [rows[v]["state"] for v in sorted(rows)] == ["broken", "broken", "up", "up",
                                                        "broken"]
    node.cli("vm", "down", "v-thief")
    assert "disk v-lost-rw: it is gone" in rows["v-lost"]["error"]
    assert rows["v-damaged"]["error"].startswith("its record is damaged: ")
    assert [d["id"] for d in json.loads(node.cli("disk", "ls", "--json").stdout)] == [
        "v-ok-rw", "v-ok2-rw"]
    blobs = node.root / "fuse" / "blobs"
    for vid in ("v-damaged", "v-lost", "v-ok"):
        node.cli("vm", "down", vid)
    assert len(os.listdir(blobs)) == 1  # still v-ok2's
    node.cli("vm", "down", "v-ok2")
    assert json.loads(node.cli("vm", "ps", "--json").stdout) == [] and os.listdir(blobs) == []


# -- real guests --

DISK_INIT = """#!/bin/sh
set -e
export PATH=/bin
mount -t proc proc /proc
mount -t devtmpfs devtmpfs /dev
echo "BASE $(sha256sum /data/base.bin)"
if [ -f /data/new.bin ]; then
    echo "SEEN $(sha256sum /data/new.bin)"
else
    dd if=/dev/urandom of=/data/new.bin bs=1M count=4 status=none
    sync
    echo "WROTE $(sha256sum /data/new.bin)"
fi
umount /dev
umount /proc
"""

BOOT_FROM_DISK = """mount -t ext4 /dev/vda /newroot || exit 1
chroot /newroot /bin/sh /init
rc=$?
umount /newroot || exit 1
exit $rc
"""


def base_disk_image(tmp_path: Path) -> tuple[Path, str]:
    """An ext4 image with busybox, an /init and a 3 MiB file; its sha256."""
    tree = tmp_path / "disk-tree"
    for d in ("bin", "proc", "dev", "data"):
        (tree / d).mkdir(parents=True)
    shutil.copy(guest.busybox(), tree / "bin" / "busybox")
    for tool in ("sh", "sha256sum", "dd", "mount", "umount", "sync", "cat"):
        (tree / "bin" / tool).symlink_to("busybox")
    (tree / "init").write_text(DISK_INIT)
    data = random.Random(3).randbytes(3 * MiB)
    (tree / "data" / "base.bin").write_bytes(data)
    image = tmp_path / "base.img"
    subprocess.run(["mkfs.ext4", "-q", "-d", str(tree), str(image), "32M"], check=True)
    return image, hashlib.sha256(data).hexdigest()


@FILE_STORE
def test_a_guest_boots_from_a_writable_disk_and_its_commit_on_another_node(
        kernel, node, node2, store, tmp_path):
    """Boot 1: ext4 root on the vm's writable disk over a ``build-disk`` base;
    the guest reads the base's file and writes a new one. The disk is
    committed; boot 2, on a second node root from that snapshot, reads both."""
    image, base_sha = base_disk_image(tmp_path)
    build_disk(RefStore(store), str(image), "guest/base", "1")
    first = vm_up(node, "--base-disk", "guest/base@1", "--id", "b1")
    assert [d["role"] for d in first["drives"]] == ["disk"]
    with guest.running_guest(kernel, BOOT_FROM_DISK, first["qemu"], tmp_path, "boot1") as g:
        _, base = g.wait_for(r"^BASE (\w+) ")
        _, wrote = g.wait_for(r"^WROTE (\w+) ")
        assert g.finish() == 0
    assert base.group(1) == base_sha
    commit = json.loads(node.cli("disk", "commit", "b1-rw", "--name", "guest/snap",
                                 "--version", "1", "--json").stdout)
    assert 4 * MiB <= commit["changed_bytes"] < 16 * MiB
    node.cli("vm", "down", "b1")
    second = vm_up(node2, "--base-disk", "guest/snap@1", "--id", "b2")
    with guest.running_guest(kernel, BOOT_FROM_DISK, second["qemu"], tmp_path, "boot2") as g:
        _, base = g.wait_for(r"^BASE (\w+) ")
        _, seen = g.wait_for(r"^SEEN (\w+) ")
        assert g.finish() == 0
    assert (base.group(1), seen.group(1)) == (base_sha, wrote.group(1))
    node2.cli("vm", "down", "b2")


READ_LOOP = """set -o pipefail
for d in /sys/block/vd*; do echo "DRIVE /dev/${d##*/} $(cat "$d/serial")"; done
mount -t erofs -o ro,device=/dev/vdb /dev/vda /mnt || echo "GUEST-ERROR mount"
cd /mnt
find . -type f | sort | while read -r f; do echo "FILE $(sha256sum "$f")"; done
cd /
umount /mnt
n=0
while true; do
    n=$((n + 1))
    sum=$(dd if=/dev/vdb bs=1M iflag=direct status=none 2>/tmp/err | sha256sum)
    rc=$?
    echo "pass $n" | dd of=/dev/vdc bs=512 seek=$n conv=sync,fsync oflag=direct status=none \
        2>>/tmp/err
    wrc=$?
    [ -s /tmp/err ] && echo "GUEST-ERROR $(cat /tmp/err)" && : > /tmp/err
    echo "PASS $n ${sum%% *} $rc $wrc"
    if read -r -t 1 line && [ "$line" = stop ]; then break; fi
done
"""


@FILE_STORE
def test_a_guest_reads_a_layer_through_kill_9_and_takeover(kernel, node, store, tmp_path):
    """The guest sees the drives in the drive set's order, their ids as
    serials; it mounts the layer's EROFS drives (meta image, ``device=`` the
    blob drive) and checks every file; then it reads the whole blob drive in
    a loop and writes a sector of its writable disk per pass while the daemon
    is killed (its reads wait in the kernel) and started again, and then
    replaced with ``--takeover``: every pass reads the blob's exact bytes,
    no read or write fails, and every sector written is there."""
    src = tmp_path / "src"
    files = layer_tree(src, 4)
    build(store, str(src), name="guestdata", chunk_size=MiB)
    doc = vm_up(node, "--layer", "guestdata@1", "--id", "g1", "--disk-size", "4M")
    expected_blob = tmp_path / "blob"
    refstore = RefStore(store)
    materialize_blob(store, refstore.chunk_table(refstore.layer(doc["layers"][0]["digest"])),
                     str(expected_blob))
    blob_sha = sha256_file(expected_blob)
    with guest.running_guest(kernel, READ_LOOP, doc["qemu"], tmp_path, "reader") as g:
        g.wait_for(r"^GUEST-START")
        at, _ = g.wait_for(r"^PASS 1 ", PASS_TIMEOUT)
        seen = {m.group(2): m.group(1) for line in g.lines[:at]
                if (m := FILE_LINE.match(line))}
        assert seen == files
        drives = dict(line.split()[1:] for line in g.lines[:at] if line.startswith("DRIVE "))
        assert drives == {guest_device(i): d["drive_id"] for i, d in enumerate(doc["drives"])}
        node.kill()
        wait_for(g.waiting_on_fuse, "the guest's reads to wait", 30)
        node.start()
        at, _ = g.wait_for(r"^PASS \d+ ", PASS_TIMEOUT, at + 1)
        at, _ = g.wait_for(r"^PASS \d+ ", PASS_TIMEOUT, at + 1)
        take_over(node)
        at, _ = g.wait_for(r"^PASS \d+ ", PASS_TIMEOUT, at + 1)
        at, _ = g.wait_for(r"^PASS \d+ ", PASS_TIMEOUT, at + 1)
        g.send("stop")
        assert g.finish() == 0
    problems = [line for line in g.lines if "GUEST-ERROR" in line or "I/O error" in line]
    assert problems == []
    passes = [line.split() for line in g.lines if line.startswith("PASS ")]
    assert len(passes) >= 5
    assert all(p[2:] == [blob_sha, "0", "0"] for p in passes), passes
    assert [int(p[1]) for p in passes] == list(range(1, len(passes) + 1))
    with open(node.root / "fuse" / "disks" / "g1-rw", "rb") as disk:
        for n in range(1, len(passes) + 1):
            assert os.pread(disk.fileno(), 512, 512 * n) == (
                f"pass {n}\n".encode().ljust(512, b"\0")), n
    assert json.loads(node.cli("vm", "ps", "--json").stdout)[0]["state"] == "up"
    node.cli("vm", "down", "g1")



# -- pmem drives --

PMEM_READ = """set -o pipefail
mkdir -p /l0 /l1 /up /merged
cached() { sed -n 's/^Cached: *\\([0-9]*\\) kB/\\1/p' /proc/meminfo; }
echo "CACHED-BEFORE $(cached)"
mount -t erofs -o ro,dax=always,device=/dev/pmem1 /dev/pmem0 /l0 || echo "GUEST-ERROR mount top"
mount -t erofs -o ro,dax=always,device=/dev/pmem3 /dev/pmem2 /l1 || echo "GUEST-ERROR mount base"
grep erofs /proc/mounts | while read -r line; do echo "MOUNT $line"; done
mount -t tmpfs tmpfs /up && mkdir /up/u /up/w
mount -t overlay overlay -o lowerdir=/l0:/l1,upperdir=/up/u,workdir=/up/w /merged \\
    || echo "GUEST-ERROR overlay"
cd /merged
find . -type f ! -name 'unread*' | sort | while read -r f; do echo "FILE $(sha256sum "$f")"; done
echo "written in the guest" > new.txt && echo "UPPER $(cat /up/u/new.txt)"
cd /
echo "CACHED-AFTER $(cached)"
"""


@FILE_STORE
def test_a_guest_stacks_an_envs_layers_from_pmem_drives_with_dax(kernel, node, store, tmp_path):
    """``vm up ENV --pmem``: each layer's meta image (a padded copy) and lazy
    blob (a padded FUSE file, ``fuse/pmem/``) as pmem drives, the VMMs'
    arguments in ``--json``; the drive set comes back after ``kill -9`` and a
    start (same files, same inodes). A q35 guest maps them (QEMU's
    ``virtio-pmem-pci``), mounts both layers' EROFS with ``dax=always``,
    stacks them with overlayfs under a tmpfs upper, and reads every file
    with the right sha256, the top layer's where both have one; its page
    cache grows by a fraction of what it read (the pages are the host's),
    and the layer's file it never read is not fetched whole. ``--pmem-private``
    gives a vm pmem files of its own (no path another vm maps), and ``vm
    up``'s text names the guest's devices and the DAX mount."""
    base_files = layer_tree(tmp_path / "base", 5)
    (tmp_path / "base" / "unread.bin").write_bytes(random.Random(6).randbytes(8 * MiB))
    top = tmp_path / "top"
    (top / "etc").mkdir(parents=True)
    (top / "etc" / "motd").write_bytes(b"the top layer's motd\n")
    (top / "top.txt").write_bytes(b"only in the top layer\n" * 100)
    build(store, str(tmp_path / "base"), name="pm/base", chunk_size=MiB)
    build(store, str(top), name="pm/top", chunk_size=MiB)
    create_env(RefStore(store), "pm/env", "1", ["pm/top@1", "pm/base@1"])
    doc = vm_up(node, "pm/env@1", "--id", "p1", "--disk-size", "4M", "--pmem")
    kinds = [(d["drive_id"], d.get("kind", "block"), d["size"] % (2 * MiB) if "size" in d else 0)
             for d in doc["drives"]]
    assert kinds == [("layer0-meta", "pmem", 0), ("layer0-blob", "pmem", 0),
                     ("layer1-meta", "pmem", 0), ("layer1-blob", "pmem", 0),
                     ("rw", "block", 0)]
    blob = Path(doc["drives"][3]["path_on_host"])
    assert blob.parent == node.root / "fuse" / "pmem"
    assert doc["pmem_bytes"] == sum(d["size"] for d in doc["drives"][:4])
    assert doc["qemu"][:4] == [
        "-object", f"memory-backend-file,id=mem-layer0-meta,mem-path="
        f"{doc['drives'][0]['path_on_host']},size={doc['drives'][0]['size']},share=on,"
        "readonly=on", "-device", "virtio-pmem-pci,memdev=mem-layer0-meta,id=layer0-meta"]
    assert "virtio-blk-pci,drive=rw,serial=rw" in doc["qemu"]
    assert [p["id"] for p in doc["firecracker"]["pmem"]] == [d["drive_id"]
                                                              for d in doc["drives"][:4]]
    assert doc["cloud_hypervisor"][doc["cloud_hypervisor"].index("--pmem") + 1].endswith(
        ",discard_writes=on")
    blob_size = RefStore(store).chunk_table(RefStore(store).layer(
        doc["layers"][1]["digest"])).blob_size
    assert blob.stat().st_size == -(-blob_size // (2 * MiB)) * 2 * MiB
    with open(blob, "rb") as f:  # past the blob's end: zeros
        f.seek(blob_size)
        assert f.read() == bytes(blob.stat().st_size - blob_size)
    inode = blob.stat().st_ino
    node.kill()
    node.start()
    assert blob.stat().st_ino == inode
    assert [r["state"] for r in json.loads(node.cli("vm", "ps", "--json").stdout)] == ["up"]
    requests_before = Client(node.root).stats().store.get("get", 0)

    record = Client(node.root).vm_ps()[0]
    memory = qemu_memory_args(record.drives, 256)
    with guest.running_guest(kernel, PMEM_READ, qemu_drive_args(record.drives), tmp_path,
                             "pmem", machine="q35", memory_args=memory) as g:
        assert g.finish() == 0
    assert [line for line in g.lines if "GUEST-ERROR" in line] == []
    mounts = [line for line in g.lines if line.startswith("MOUNT ")]
    assert len(mounts) == 2 and all("dax=always" in m for m in mounts), mounts
    seen = {m.group(2): m.group(1) for line in g.lines if (m := FILE_LINE.match(line))}
    want = {**base_files, "etc/motd": hashlib.sha256(b"the top layer's motd\n").hexdigest(),
            "top.txt": hashlib.sha256(b"only in the top layer\n" * 100).hexdigest()}
    assert seen == want
    assert "UPPER written in the guest" in g.lines
    before, after = (int(next(line.split()[1] for line in g.lines if line.startswith(w)))
                     for w in ("CACHED-BEFORE", "CACHED-AFTER"))
    read = 12 * MiB + sum((tmp_path / "base" / f).stat().st_size for f in base_files)
    assert (after - before) * 1024 < read // 4, (before, after)
    fetched = Client(node.root).stats().store.get("get", 0) - requests_before
    assert 0 < fetched < len(RefStore(store).chunk_table(RefStore(store).layer(
        doc["layers"][1]["digest"])).entries), fetched
    text = node.cli("vm", "up", "pm/env@1", "--id", "p2", "--pmem-private").stdout
    assert "mount -t erofs -o ro,dax=always,device=/dev/pmem1 /dev/pmem0 DIR" in text
    assert "qemu machine: -M q35 -m 512M,maxmem=" in text and "/dev/vda " in text
    private = {d.path_on_host for d in Client(node.root).vm_ps()[1].drives}
    assert str(node.root / "fuse" / "pmem" / f"p2.{blob.name}") in private  # its own
    assert not private & {d.path_on_host for d in record.drives}
    node.cli("vm", "down", "p2")
    assert sorted(os.listdir(node.root / "fuse" / "pmem")) == sorted(
        Path(d.path_on_host).name for d in record.drives if d.role == "device")
    node.cli("vm", "down", "p1")
    assert os.listdir(node.root / "fuse" / "pmem") == []
    assert os.listdir(node.root / "meta" / "pmem") == []


# -- suspend and resume --

SUSPENDED_WORK = """echo "written to tmpfs before the suspend" > /tmp/note
printf 'fsynced-before-suspend' | dd of=/dev/vdc bs=512 conv=sync,fsync oflag=direct \\
    status=none || echo "GUEST-ERROR disk write"
(n=0; while true; do n=$((n + 1)); echo $n > /tmp/count; sleep 0.2; done) &
bg=$!
echo READY
while read -r line; do
    case "$line" in
    check)
        echo "NOTE $(cat /tmp/note)"
        echo "COUNT $(cat /tmp/count)"
        kill -0 $bg && echo "ALIVE $bg"
        echo "DISK $(dd if=/dev/vdc bs=512 count=1 iflag=direct status=none | tr -d '\\000')"
        ;;
    more) echo "written after the resume" > /tmp/more; echo MORE ;;
    again) echo "AGAIN $(cat /tmp/note) / $(cat /tmp/more)" ;;
    stop) break ;;
    esac
done
"""


def resumed_guest(node: NodeDaemon, ref: str, vid: str, boot: tuple[guest.GuestKernel, Path, int],
                  log: Path) -> tuple[VmRecord, guest.Guest]:
    """Vm ``vid`` resumed from snapshot ``ref`` on ``node`` and its QEMU
    started (``boot``: kernel, initramfs, RAM bytes); its record and guest."""
    kernel, initramfs, ram = boot
    answer = Client(node.root).vm_resume(ref, vid)
    assert answer.ram is not None
    argv = guest.qemu_argv(kernel, initramfs, qemu_drive_args(answer.drives)
                           + qemu_ram_args(answer.ram), memory_mb=ram // MiB)
    return answer, guest.Guest(argv, log)


@FILE_STORE
def test_a_guest_suspended_on_one_node_resumes_on_another(kernel, node, node2, store,
                                                          tmp_path):
    """``vm up --ram``: the guest's RAM a file the node keeps, QEMU's QMP
    socket; the guest writes tmpfs, fsyncs a sector of its writable disk and
    starts a background process. ``vm suspend`` saves it (device state
    through QMP, RAM with its zero pages left out, the disk committed) into
    the store and QEMU ends; ``vm ps`` shows it suspended with its ref.
    ``vm resume`` on a second node root with its own cache: a new QEMU on
    the RAM served lazily from the store (mapped private) and the device
    state goes on: the tmpfs file, the process (still counting) and the
    fsynced sector are there, and the node fetched less than the RAM. The
    resumed guest writes more and is suspended again (its RAM is private to
    QEMU now: the state carries it, over the first snapshot as parent) and
    resumed on the first node: both writes are there. The first resume
    pushed the chunks it touched in its first seconds as the snapshot's
    working set, which the last resume (its chain has the first snapshot)
    prefetches and puts into its RAM file's page cache before the guest
    goes on (the daemon's store notifications: the guest's memory is
    right). Suspended once more with a chain bound of 2, its RAM and disk
    chains are merged into one layer each, and the guest resumed from
    them (on the second node) has both writes and the fsynced sector."""
    src = tmp_path / "src"
    layer_tree(src, 7)
    build(store, str(src), name="sr/data", chunk_size=MiB)
    ram = 256 * MiB
    first = Client(node.root).vm_up("s1", layers=["sr/data@1"], disk_size=4 * MiB, ram=ram)
    assert first.ram is not None and first.ram.share
    initramfs = guest.make_initramfs(tmp_path / "sr.cpio", kernel, SUSPENDED_WORK)
    argv = guest.qemu_argv(kernel, initramfs, qemu_drive_args(first.drives)
                           + qemu_ram_args(first.ram), memory_mb=ram // MiB)
    g1 = guest.Guest(argv, tmp_path / "sr1.log")
    try:
        g1.wait_for(r"^READY")
        g1.send("check")
        _, count = g1.wait_for(r"^COUNT (\d+)")
        suspended = Client(node.root).vm_suspend("s1", "sr/snap", "1")
        assert g1.proc.wait(60) == 0  # QEMU quit
    finally:
        g1.stop()
    assert (suspended.state, suspended.snapshot) == ("suspended", "sr/snap@1")
    node.kill()  # a suspended vm is node state too
    node.start()
    rows = json.loads(node.cli("vm", "ps", "--json").stdout)
    assert [(r["id"], r["state"], r["snapshot"]) for r in rows] == [
        ("s1", "suspended", "sr/snap@1")]
    assert "suspended as sr/snap@1" in node.cli("vm", "ps").stdout
    stored = RefStore(store).disk(RefStore(store).resolve("layers", "sr/snap@1"))
    assert stored.stats.stored_bytes < ram // 2  # zero pages are not stored

    second, g2 = resumed_guest(node2, "sr/snap@1", "s2", (kernel, initramfs, ram),
                               tmp_path / "sr2.log")
    try:  # (a line sent while the state loads is lost: the serial port's state is loaded)
        assert second.ram is not None and second.ram.share and second.ram.incoming
        assert second.ram.path == str(node2.root / "fuse" / "disks" / "s2-ram")
        assert [d.drive_id for d in second.drives] == [d.drive_id for d in first.drives]
        wait_for(lambda: "vm s2 resumed from its snapshot" in node2.log(), "the state", 90)
        g2.send("check")
        _, note = g2.wait_for(r"^NOTE (.*)$")
        _, count2 = g2.wait_for(r"^COUNT (\d+)")
        _, alive = g2.wait_for(r"^ALIVE (\d+)")
        _, disk = g2.wait_for(r"^DISK (.*)$")
        fetched = Client(node2.root).stats().cache["bytes_fetched"]
        g2.send("more")
        g2.wait_for(r"^MORE")
        wait_for(lambda: "vm s2: working set of " in node2.log(), "the working set", 60)
        # only chunks with a page QEMU mapped: not the rest of the 4 MiB the kernel read
        # around each fault (QEMU asks for huge pages on guest RAM)
        pushed = re.search(r"vm s2: working set of \S+ pushed \((\d+) chunks; (\d+) read\)",
                           node2.log())
        assert pushed and 0 < int(pushed.group(1)) < int(pushed.group(2)), pushed
        again = Client(node2.root).vm_suspend("s2", "sr/snap", "2")  # its RAM: private
        assert g2.proc.wait(60) == 0
    finally:
        g2.stop()
    assert note.group(1) == "written to tmpfs before the suspend"
    assert int(count2.group(1)) >= int(count.group(1))
    assert disk.group(1) == "fsynced-before-suspend"
    assert 0 < fetched < ram // 2, fetched
    assert again.snapshot == "sr/snap@2"
    again_stored = RefStore(store).disk(RefStore(store).resolve("layers", "sr/snap@2"))
    assert again_stored.stats.stored_bytes < stored.stats.stored_bytes // 4  # what changed

    _, g3 = resumed_guest(node, "sr/snap@2", "s3", (kernel, initramfs, ram),  # the first node
                          tmp_path / "sr3.log")
    try:
        wait_for(lambda: "vm s3 resumed from its snapshot" in node.log(), "the state", 90)
        g3.send("again")
        _, both = g3.wait_for(r"^AGAIN (.*)$")
        # a bound of 2 on the chains: the RAM's (snap@1, snap@2) and the disk's are merged
        Client(node.root).vm_suspend("s3", "sr/snap", "3", max_depth=2)
        assert g3.proc.wait(60) == 0
    finally:
        g3.stop()
    assert both.group(1) == "written to tmpfs before the suspend / written after the resume"
    assert "vm s3: prefetching the working set of sr/snap@2" in node.log()  # (its parent's)
    warmed = re.search(r"vm s3: working set read ahead \((\d+) bytes", node.log())
    assert warmed and int(warmed.group(1)) > 0  # into its page cache, before the guest went on
    for ref in ("sr/snap@3", "sr/snap-disk@3"):
        assert len(RefStore(store).disk_chain(RefStore(store).resolve("layers", ref))) == 1

    _, g4 = resumed_guest(node2, "sr/snap@3", "s4", (kernel, initramfs, ram),  # merged
                          tmp_path / "sr4.log")
    try:
        wait_for(lambda: "vm s4 resumed from its snapshot" in node2.log(), "the state", 90)
        g4.send("again")
        _, merged = g4.wait_for(r"^AGAIN (.*)$")
        g4.send("check")
        _, disk4 = g4.wait_for(r"^DISK (.*)$")
        g4.send("stop")
        assert g4.finish() == 0
    finally:
        g4.stop()
    assert merged.group(1) == both.group(1)
    assert disk4.group(1) == "fsynced-before-suspend"
    lines = g1.lines + g2.lines + g3.lines + g4.lines
    assert [line for line in lines if "GUEST-ERROR" in line] == []
    for vid in ("s2", "s4"):
        node2.cli("vm", "down", vid)
    for vid in ("s1", "s3"):
        node.cli("vm", "down", vid)
    for n in (node, node2):
        assert json.loads(n.cli("disk", "ls", "--json").stdout) == []
        assert os.listdir(n.root / "vms") == []


@FILE_STORE
def test_a_chain_past_its_bound_is_merged_into_one_layer(node, node2, store):
    """``disk commit --max-depth 3`` (what ``vm suspend`` does to a resumed
    vm's RAM and disk chains, with its default of 8): three commits chain
    (depth 1, 2, 3), the fourth merges the chain into one layer with no
    parent, the fifth chains over it again. A disk over the merged commit on
    a second node reads exactly what was written: each commit's block, and
    the block every commit overwrote as the last one wrote it."""
    refstore = RefStore(store)
    node.cli("disk", "create", "m", "--size", "4M")
    expected = bytearray(4 * MiB)
    commits = []
    with open(node.root / "fuse" / "disks" / "m", "r+b", buffering=0) as f:
        for i in range(1, 6):
            for off, data in ((0, bytes([i]) * 8192), (i * 256 * 1024, os.urandom(65536))):
                os.pwrite(f.fileno(), data, off)
                expected[off:off + len(data)] = data
            os.fsync(f.fileno())
            commits.append(json.loads(node.cli("disk", "commit", "m", "--name", "chain/m",
                                               "--version", str(i), "--max-depth", "3",
                                               "--json").stdout))
            if i == 4:
                merged_view = bytes(expected)
    assert [c["depth"] for c in commits] == [1, 2, 3, 1, 2]
    assert [c["merged"] for c in commits] == [0, 0, 0, 4, 0]
    assert commits[3]["parent"] is None and commits[4]["parent"] == "chain/m@4"
    for c in commits:
        assert len(refstore.disk_chain(c["digest"])) == c["depth"] <= 3
    for sid, version, want in (("m4", "4", merged_view), ("m5", "5", bytes(expected))):
        node2.cli("disk", "create", sid, "--base", f"chain/m@{version}")
        got = (node2.root / "fuse" / "disks" / sid).read_bytes()
        assert got == want, sid
        node2.cli("disk", "rm", sid)
    node.cli("disk", "rm", "m")


@FILE_STORE
def test_suspend_and_resume_refuse_what_they_cannot_do(node, store, tmp_path):
    """One error line each and nothing left behind: a RAM size that is not a
    whole number of 2 MiB, a suspend of a vm without a RAM file, a resume
    of a disk layer that is no vm snapshot (its disk made and removed
    again), a resume onto an id in use."""
    image, _ = base_disk_image(tmp_path)
    build_disk(RefStore(store), str(image), "guest/base", "1")
    node.cli("vm", "up", "--base-disk", "guest/base@1", "--id", "v1")
    for args, code, words in (
            (("up", "--base-disk", "guest/base@1", "--id", "v2", "--ram", "3M"), 2,
             "RAM size 3145728 is not a whole number of 2 MiB"),
            (("suspend", "v1", "--name", "x/snap", "--version", "1"), 2,
             "vm v1: only an up vm with a RAM file"),
            (("resume", "guest/base@1", "--id", "v3"), 2,
             "guest/base@1 is not a vm snapshot"),
            (("resume", "guest/base@1", "--id", "v1"), 9, "vm v1: already exists")):
        proc = node.cli("vm", *args, check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == code and len(lines) == 1 and words in lines[0], proc.stderr
    assert [vm.id for vm in Client(node.root).vm_ps()] == ["v1"]
    assert [d["id"] for d in json.loads(node.cli("disk", "ls", "--json").stdout)] == ["v1-rw"]
    assert not (node.root / "vms" / "v3").exists()
    node.cli("vm", "down", "v1")


def test_what_the_vmms_user_may_write_is_never_followed(tmp_path):
    """A vm's directory is writable by the FUSE group (QEMU's socket and
    state go there): the daemon reads the state QEMU wrote only as a regular
    file, never through a link to a file only root may read; it makes its
    own files there new (a link or file put there first is replaced, never
    written through); a QMP "socket" that is a link is refused."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"root only")
    secret.chmod(0o600)
    state = tmp_path / "state.out"
    state.symlink_to(secret)
    with pytest.raises(OSError):
        read_state(state)
    state.unlink()
    os.mkfifo(state)
    with pytest.raises(QmpError, match="not a regular file"):
        read_state(state)
    planted = tmp_path / "state"
    planted.symlink_to(secret)
    os.close(new_private_file(planted, 0o640))
    assert not planted.is_symlink() and secret.read_bytes() == b"root only"
    qmp = tmp_path / "qmp"
    qmp.symlink_to(secret)
    with pytest.raises(QmpError, match="is not a socket"):
        Qmp(str(qmp))
