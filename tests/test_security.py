"""Node security for real: an unprivileged user made by the test (``local_user``)
attacks a running daemon: its ROOT, its FUSE blob and disk files, and a sandbox
whose layer ships a setuid-root program and a world-writable node of a
root-only block device. Also: a ROOT that cannot host file-backed EROFS mounts
is refused at start, and so are disk sizes of zero."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pyfuse3
import pytest
import trio
from support import IN_CI, build, need_root
from support.nodes import NodeDaemon
from support.users import LocalUser

from harness.daemonproc import LAYERFS, DaemonProcess, detach_mounts
from layerfs.errors import LayerfsError
from layerfs.formats.chunktable import ChunkTable
from layerfs.node.daemon.service import mounts_under
from layerfs.node.fuse.nodefs import NodeFS
from layerfs.node.reads.blobfiles import BlobDirectory
from layerfs.store.file import FileStore

CHUNK = 65536
SECRET = os.urandom(4 * CHUNK)  # a 0600 file's bytes: big enough to live in the blob
SANDBOX_USER_PROGRAM = "/usr/bin/id"

# As the attacker: open PATH with FLAGS, print OK and what it read (or wrote), or the errno.
OPEN_AS_USER = """
import errno, os, sys
path, mode = sys.argv[1], sys.argv[2]
try:
    if mode == "list":
        print("OK", len(os.listdir(path)))
        sys.exit()
    fd = os.open(path, os.O_RDWR if mode == "rw" else os.O_RDONLY)
    if mode == "rw":
        os.pwrite(fd, b"v" * 4096, 0)
    data = os.pread(fd, 1 << 22, 0)
    sys.stdout.write("OK ")
    sys.stdout.flush()
    sys.stdout.buffer.write(data)
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""


def attempt(user: LocalUser, path: Path, mode: str = "r") -> bytes:
    """``b"OK ..."`` with what the user read, or the errno's name."""
    proc = user.python(OPEN_AS_USER, str(path), mode)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip() if not proc.stdout.startswith(b"OK") else proc.stdout


def root_only_block_device() -> os.stat_result:
    """A block device of this host that only root may open (a loop device, the disk)."""
    for name in sorted(os.listdir("/dev"), key=lambda n: (not n.startswith("loop"), n)):
        st = os.lstat(f"/dev/{name}")
        if stat.S_ISBLK(st.st_mode) and not st.st_mode & 0o066:
            return st
    if IN_CI:
        pytest.fail("no root-only block device on this host")
    pytest.skip("no root-only block device on this host")


def shared_libraries(program: str) -> list[str]:
    """The absolute paths ``ldd`` names for ``program`` (loader included)."""
    out = subprocess.run(["ldd", program], capture_output=True, text=True, check=True).stdout
    paths = []
    for line in out.splitlines():
        words = line.split()
        path = words[2] if "=>" in words and len(words) > 2 else words[0]
        if path.startswith("/"):
            paths.append(path)
    return paths


def add_file(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.uid, info.gid = len(data), mode, 0, 0
    tar.addfile(info, io.BytesIO(data))


def add_dirs(tar: tarfile.TarFile, path: str, done: set[str]) -> None:
    parts = path.strip("/").split("/")[:-1]
    for i in range(1, len(parts) + 1):
        name = "/".join(parts[:i])
        if name not in done:
            done.add(name)
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if name == "tmp" else 0o755
            tar.addfile(info)


def hostile_tar(path: Path, device: os.stat_result) -> Path:
    """A layer as an attacker ships it: a setuid-root ``id`` with its libraries,
    a 0666 node of a root-only block device, a static busybox, and secrets."""
    done: set[str] = set()
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        files = [("bin/busybox", Path("/bin/busybox").read_bytes(), 0o755),
                 (SANDBOX_USER_PROGRAM.lstrip("/"), Path(SANDBOX_USER_PROGRAM).read_bytes(),
                  0o4755),
                 ("secret/big", SECRET, 0o600), ("secret/small", b"small secret\n", 0o600),
                 ("tmp/.keep", b"", 0o644)]
        files += [(lib.lstrip("/"), Path(os.path.realpath(lib)).read_bytes(), 0o755)
                  for lib in shared_libraries(SANDBOX_USER_PROGRAM)]
        for name, data, mode in files:
            add_dirs(tar, name, done)
            add_file(tar, name, data, mode)
        add_dirs(tar, "dev/hostdisk", done)
        node = tarfile.TarInfo("dev/hostdisk")
        node.type, node.mode = tarfile.BLKTYPE, 0o666
        node.devmajor, node.devminor = os.major(device.st_rdev), os.minor(device.st_rdev)
        tar.addfile(node)
    return path


@pytest.fixture
def hostile(starts_a_server, tmp_path: Path) -> SimpleNamespace:
    """Layer hostile@1 in a file:// store; the daemon's CLI arguments for it."""
    need_root()
    store = FileStore(str(tmp_path / "store"))
    result = build(store, str(hostile_tar(tmp_path / "hostile.tar", root_only_block_device())),
                   name="hostile", chunk_size=CHUNK)
    return SimpleNamespace(store_args=["--store", "file://" + str(tmp_path / "store")],
                           hex=result.digest.removeprefix("sha256:"))


@pytest.fixture
def node_parent(starts_a_server) -> Iterator[Path]:
    """Where ROOT lives: a directory everyone may traverse, like /var/lib (pytest's
    own temporary directories are closed to other users, which would hide what
    the daemon itself lets them reach)."""
    parent = Path(tempfile.mkdtemp(prefix="layerfs-node-"))
    os.chmod(parent, 0o711)
    try:
        yield parent
    finally:
        detach_mounts(parent)
        shutil.rmtree(parent, ignore_errors=True)


def start_daemon(root: Path, hostile: SimpleNamespace, *extra: str) -> NodeDaemon:
    daemon = NodeDaemon(root, hostile.store_args)
    daemon.extra_args = list(extra)
    return daemon.start()


@pytest.fixture
def node(starts_a_server, node_parent: Path, hostile: SimpleNamespace) -> Iterator[NodeDaemon]:
    daemon = start_daemon(node_parent / "node", hostile)
    try:
        yield daemon
    finally:
        assert daemon.cleanup() == [], "mounts left behind"


def up(node: NodeDaemon, sid: str) -> Path:
    return Path(node.cli("up", "--layer", "hostile@1", "--id", sid).stdout.strip())


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def in_sandbox(user: LocalUser, rootfs: Path, *argv: str) -> subprocess.CompletedProcess:
    """Run ``argv`` inside the sandbox as the user, the way a runtime starts an
    unprivileged process: chroot as root, then drop to the user's uid and gid."""
    ids = f"--userspec={user.uid}:{user.gid}"
    return subprocess.run(["chroot", ids, f"--groups={user.gid}", str(rootfs), *argv],
                          capture_output=True, text=True, timeout=60)


# -- finding 1: ROOT and the FUSE mount belong to root --


def test_root_and_sandbox_uppers_are_closed_to_local_users(node_parent, hostile, local_user):
    root = node_parent / "node"
    for sub in ("", "sandboxes", "meta", "layers"):  # an existing ROOT that others may read
        (root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(root / sub, 0o755)
    node = start_daemon(root, hostile)
    try:
        rootfs = up(node, "s1")
        (rootfs / "note").write_text("a sandbox's file")
        os.chmod(rootfs / "note", 0o644)
        upper_note = root / "sandboxes" / "s1" / "upper" / "note"
        assert upper_note.read_text() == "a sandbox's file"
        assert attempt(local_user, upper_note) == b"EACCES"
        assert attempt(local_user, root / "sandboxes" / "s1" / "upper", "list") == b"EACCES"
        assert attempt(local_user, root / "meta" / f"{hostile.hex}.erofs") == b"EACCES"
        assert attempt(local_user, root / "layers" / hostile.hex / "secret", "list") == b"EACCES"
        assert attempt(local_user, root / "fuse" / "blobs" / hostile.hex) == b"EACCES"
        assert mode_of(root) == 0o700
        for sub in ("sandboxes", "sandboxes/s1", "meta", "layers", "cache", "disks"):
            assert mode_of(root / sub) == 0o700, sub
        node.cli("down", "s1")
    finally:
        assert node.cleanup() == [], "mounts left behind"


def test_fuse_files_refuse_local_users_even_through_an_open_root(node, hostile, local_user):
    """ROOT is 0700; were it opened up by mistake, the FUSE mount itself still
    refuses everyone but root: blobs hold the bytes of every layer's 0600
    files, disks are the VMs' writable drives."""
    up(node, "s1")
    disk = Path(node.cli("disk", "create", "d1", "--size", "1M").stdout.strip())
    blob = node.root / "fuse" / "blobs" / hostile.hex
    assert SECRET in blob.read_bytes()  # root reads it: the EROFS mount needs that
    os.chmod(node.root, 0o711)
    assert attempt(local_user, blob) == b"EACCES"
    assert attempt(local_user, disk, "rw") == b"EACCES"
    assert attempt(local_user, disk) == b"EACCES"
    assert attempt(local_user, node.root / "fuse" / "blobs", "list") == b"EACCES"
    st = os.stat(blob)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o440)
    assert stat.S_IMODE(os.stat(disk).st_mode) == 0o660
    node.cli("disk", "rm", "d1")
    node.cli("down", "s1")


def test_the_fuse_group_opens_a_vms_drives_and_nothing_else(node_parent, hostile,
                                                            local_user):
    """``--fuse-group``: a VMM running as a member opens the drives ``vm up``
    hands it (meta image and blob read-only, the writable disk read-write);
    it neither writes a blob nor reaches the sandboxes, layers or cache."""
    node = start_daemon(node_parent / "node", hostile, "--fuse-group", local_user.name)
    try:
        drives = json.loads(node.cli("vm", "up", "--layer", "hostile@1", "--id", "v1",
                                     "--disk-size", "1M", "--json").stdout)["drives"]
        for drive in drives:
            got = attempt(local_user, Path(drive["path_on_host"]),
                          "r" if drive["is_read_only"] else "rw")
            assert got.startswith(b"OK"), (drive, got)
            if not drive["is_read_only"]:
                assert got[3:3 + 4096] == b"v" * 4096
        blob = node.root / "fuse" / "blobs" / hostile.hex
        assert SECRET in attempt(local_user, blob)
        assert attempt(local_user, blob, "rw") == b"EACCES"
        assert mode_of(node.root) == 0o710 and os.stat(node.root).st_gid == local_user.gid
        for sub in ("sandboxes", "layers", "cache", "disks"):
            assert attempt(local_user, node.root / sub, "list") == b"EACCES", sub
        assert attempt(local_user, node.root, "list") == b"EACCES"
        node.cli("vm", "down", "v1")
    finally:
        assert node.cleanup() == [], "mounts left behind"
    unknown = subprocess.run([*LAYERFS, "daemon", "--root", str(node_parent / "other"),
                              "--fuse-group", "no-such-group-here"], capture_output=True,
                             text=True, timeout=60)
    assert unknown.returncode == 2 and unknown.stderr.splitlines() == [
        "layerfs: error: --fuse-group: no such group 'no-such-group-here'"]


@pytest.mark.daemon_log(r"refused uid 4321 gid \d+ \(pid \d+\): not root or the FUSE group")
def test_fuse_open_checks_the_callers_uid_and_group():
    """The adapter checks the caller itself, not only the kernel's
    ``default_permissions``: root, or the configured group, primary or
    supplementary (a process's groups, found from its pid)."""
    need_root()  # a process with a supplementary group of our choosing
    blobs = BlobDirectory()
    blob = blobs.add("sha256:" + "ab" * 32, ChunkTable([], 4096, CHUNK), None)
    disks = SimpleNamespace(by_inode={}, disks={})
    stranger = SimpleNamespace(uid=4321, gid=4321, pid=0, umask=0)

    async def opens(fs: NodeFS, ctx: SimpleNamespace) -> str:
        try:
            await fs.open(blob.inode, os.O_RDONLY, ctx)
            await fs.opendir(pyfuse3.ROOT_INODE, ctx)
            return "ok"
        except pyfuse3.FUSEError as exc:
            return os.strerror(exc.errno)

    closed = NodeFS(blobs, disks)
    by_group = NodeFS(blobs, disks, fuse_group=4242)
    assert trio.run(opens, closed, SimpleNamespace(uid=0, gid=0, pid=0, umask=0)) == "ok"
    assert trio.run(opens, closed, stranger) == os.strerror(13)
    assert trio.run(opens, closed, SimpleNamespace(uid=4321, gid=0, pid=0, umask=0)) \
        == os.strerror(13)
    assert trio.run(opens, by_group, stranger) == os.strerror(13)
    assert trio.run(opens, by_group, SimpleNamespace(uid=4321, gid=4242, pid=0, umask=0)) \
        == "ok"
    member = subprocess.Popen(["sleep", "60"], extra_groups=[4242])  # in the group, not primary
    try:
        supplementary = SimpleNamespace(uid=4321, gid=4321, pid=member.pid, umask=0)
        assert trio.run(opens, by_group, supplementary) == "ok"
        assert trio.run(opens, closed, supplementary) == os.strerror(13)
    finally:
        member.kill()
        member.wait()
    assert trio.run(opens, by_group, supplementary) == os.strerror(13)  # gone: no groups


# -- finding 2: nothing in a layer is setuid or a device --


def test_a_setuid_root_program_in_a_layer_gives_no_root(node, local_user):
    rootfs = up(node, "s1")
    program = rootfs / SANDBOX_USER_PROGRAM.lstrip("/")
    st = os.stat(program)
    assert st.st_uid == 0 and st.st_mode & stat.S_ISUID  # the layer kept the bit
    proc = in_sandbox(local_user, rootfs, SANDBOX_USER_PROGRAM)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"uid={local_user.uid}(") or \
        proc.stdout.startswith(f"uid={local_user.uid} ")
    assert "euid=" not in proc.stdout, proc.stdout  # id names the euid when it differs
    euid = in_sandbox(local_user, rootfs, SANDBOX_USER_PROGRAM, "-u")
    assert euid.stdout.strip() == str(local_user.uid)
    node.cli("down", "s1")


def test_a_device_node_in_a_layer_opens_nothing(node, hostile, local_user):
    rootfs = up(node, "s1")
    dev = os.lstat(rootfs / "dev" / "hostdisk")
    assert stat.S_ISBLK(dev.st_mode) and stat.S_IMODE(dev.st_mode) == 0o666
    proc = in_sandbox(local_user, rootfs, "/bin/busybox", "head", "-c", "512", "/dev/hostdisk")
    assert proc.returncode != 0 and "Permission denied" in proc.stderr, proc
    for path in (rootfs, node.root / "layers" / hostile.hex):
        with pytest.raises(PermissionError):  # not even root opens it there
            os.open(path / "dev" / "hostdisk", os.O_RDONLY)
    options = mount_options()
    for path in (rootfs, node.root / "layers" / hostile.hex, node.root / "fuse"):
        assert {"nosuid", "nodev"} <= options[str(path)], (path, options[str(path)])
    node.cli("down", "s1")


def mount_options() -> dict[str, set[str]]:
    """Mount point → its per-mount options, from /proc/self/mountinfo."""
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4]: set(line.split()[5].split(",")) for line in f}


# -- finding 12: a ROOT that cannot work, disk sizes of zero --


def test_a_root_on_tmpfs_is_refused_at_start(tmp_path, hostile):
    root = tmp_path / "tmpfs-root"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(root)], check=True)
    daemon = DaemonProcess(root, hostile.store_args, log_path=tmp_path / "daemon.log")
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            daemon.start(timeout=60)
        assert daemon.proc is not None and daemon.proc.wait(30) != 0
        lines = daemon.log().strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("layerfs: error: ") and "tmpfs" in lines[0] \
            and "file-backed EROFS" in lines[0], lines
        assert mounts_under(root) == [str(root)]  # no FUSE, no probe mount left
        assert not list((root / "meta").iterdir()) and not list((root / "layers").iterdir())
    finally:
        daemon.cleanup()  # detaches the tmpfs too


def test_zero_negative_and_garbage_disk_sizes_are_refused(node):
    cases = [("vm", "up", "--layer", "hostile@1", "--id", "v1", "--disk-size", "0"),
             ("vm", "up", "--layer", "hostile@1", "--id", "v1", "--disk-size", "-1G"),
             ("vm", "up", "--layer", "hostile@1", "--id", "v1", "--disk-size", "lots"),
             ("vm", "up", "--layer", "hostile@1", "--id", "v1", "--disk-size", "0.1"),
             ("disk", "create", "d1", "--size", "0"),
             ("disk", "create", "d1", "--size", "-512"),
             ("disk", "create", "d1", "--size", "1e400")]
    for args in cases:
        proc = node.cli(*args, check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (args, proc.stderr)
        assert lines[0].startswith("layerfs: error: ") and "size" in lines[0], lines
    for request in ({"op": "vm-up", "id": "v1", "layers": ["hostile@1"], "disk_size": 0},
                    {"op": "vm-up", "id": "v1", "layers": ["hostile@1"], "disk_size": "1G"},
                    {"op": "disk-create", "id": "d1", "size": 0, "base": None},
                    {"op": "disk-create", "id": "d1", "size": -4096, "base": None}):
        with pytest.raises(LayerfsError, match="size"):
            node.request(request.pop("op"), **request)
    assert json.loads(node.cli("disk", "ls", "--json").stdout) == []
    drives = json.loads(node.cli("vm", "up", "--layer", "hostile@1", "--id", "v1",
                                 "--disk-size", "1M", "--json").stdout)["drives"]
    assert os.stat(drives[-1]["path_on_host"]).st_size == 1 << 20
    node.cli("vm", "down", "v1")



# -- a layer's overlayfs xattrs steer nothing --


def overlay_redirect_tars(tmp_path: Path) -> tuple[Path, Path]:
    """A lower layer with /secret/file, and an upper one whose /d claims, by
    overlayfs's ``trusted.overlay.redirect`` xattr, to be the lower /secret."""
    paths = tmp_path / "lower.tar", tmp_path / "upper.tar"
    with tarfile.open(paths[0], "w", format=tarfile.PAX_FORMAT) as tar:
        add_dirs(tar, "secret/x", set())
        add_file(tar, "secret/file", b"lower secret", 0o600)
    with tarfile.open(paths[1], "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("d")
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        info.pax_headers = {"SCHILY.xattr.trusted.overlay.redirect": "/secret"}
        tar.addfile(info)
        add_file(tar, "d/own", b"own", 0o644)
    return paths


def test_a_layers_overlay_redirect_is_not_followed(tmp_path, node_parent):
    need_root()
    store = FileStore(str(tmp_path / "store"))
    lower, upper = overlay_redirect_tars(tmp_path)
    build(store, str(lower), name="lo", chunk_size=CHUNK)
    build(store, str(upper), name="hi", chunk_size=CHUNK)
    daemon = NodeDaemon(node_parent / "node", ["--store", "file://" + str(tmp_path / "store")])
    daemon.start()
    try:
        rootfs = Path(daemon.cli("up", "--layer", "hi@1", "--layer", "lo@1", "--id", "r")
                      .stdout.strip())
        try:  # overlayfs refuses the directory (EPERM) rather than follow it
            seen = sorted(os.listdir(rootfs / "d"))
        except PermissionError:
            seen = ["(refused)"]
        assert seen in (["own"], ["(refused)"]), seen
        assert (rootfs / "secret" / "file").read_bytes() == b"lower secret"
        daemon.cli("down", "r")
    finally:
        assert daemon.cleanup() == [], "mounts left behind"
