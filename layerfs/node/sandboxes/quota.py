"""The quota of a sandbox's writable layer, enforced by the kernel, on any
file system for ROOT.

- ROOT on btrfs with quotas enabled (``btrfs quota enable ROOT``, or
  ``--simple`` with btrfs-progs 6.7 and later): ``ROOT/sandboxes/<id>`` is a
  btrfs subvolume of its own (its ``upper`` and ``work`` inside, so that
  overlayfs's renames from work to upper stay within it) whose qgroup is
  limited to the quota. A write past it fails with EDQUOT ("Disk quota
  exceeded"). A subvolume costs an ioctl, no device and no mkfs; deleting the
  directory (``down``) deletes it (an empty subvolume goes with rmdir).
- Any other ROOT (ext4, xfs, btrfs with quotas off): ``ROOT/sandboxes/<id>``
  is the mount point of an ext4 file system of its own, made on a sparse
  file of the quota's size (:data:`IMAGE`, inside the directory it is then
  mounted over: hidden while it is mounted), through a loop device,
  ``nosuid,nodev,discard``. A write past it fails with ENOSPC ("No space
  left on device"); the file system's own metadata (its journal, inode
  tables) takes part of the quota, more of a small one. The image's blocks
  are taken from ROOT as they are written (and given back as files are
  deleted: ``discard``), so the quotas of all sandboxes may add up to more
  than ROOT holds, but no one sandbox takes more than its quota.

Either way the sandbox's directories keep their paths (``upper``, ``work``,
``rootfs``), its other sandboxes and the node are untouched beyond the quota.
An image is mounted again when its sandbox is restored (after a stop, or a
crash whose mounts were detached), and unmounted before its directory is
removed; ``down --keep-upper`` keeps the image (the upper inside it).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import struct
import subprocess
import time
from pathlib import Path

from ...errors import LimitUnsupported
from ...mounts import mount_table, umount

BTRFS_SUPER_MAGIC = 0x9123683E
BTRFS_IOC_SUBVOL_CREATE = 0x5000940E  # _IOW(0x94, 14, struct btrfs_ioctl_vol_args)
BTRFS_IOC_QGROUP_LIMIT = 0x8030942B  # _IOR(0x94, 43, struct btrfs_ioctl_qgroup_limit_args)
VOL_ARGS_SIZE = 4096  # s64 fd, char name[4088]
LIMIT_MAX_RFER, LIMIT_MAX_EXCL = 1, 2
OPTION = "--disk-quota"
IMAGE = "quota.img"  # a sandbox's file system image, in the directory it is mounted on
LOOP_CONTROL = "/dev/loop-control"
MKFS = "mkfs.ext4"
# the blocks of a fresh sparse file read as zeros: nothing to zero (e2fsprogs 1.47)
MKFS_OPTIONS = ("-q", "-F", "-m", "0", "-E", "root_owner=0:0,assume_storage_prezeroed=1")
MOUNT_OPTIONS = "loop,nosuid,nodev,discard"
TOOL_TIMEOUT = 120  # seconds for mkfs or mount of one image
LOOP_RUNDOWN_WAIT = 5.0  # seconds a remount waits for a loop device being freed


def fs_type(path: Path) -> int:
    """The f_type of the file system holding ``path`` (statfs(2))."""
    import ctypes

    buf = ctypes.create_string_buffer(120)  # struct statfs; f_type is its first word
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return struct.unpack_from("l", buf)[0] & 0xFFFFFFFF


def check_supported(parent: Path) -> None:
    """Refuse a quota (:class:`LimitUnsupported`) that ``parent`` (the
    sandboxes' directory) could not have: on btrfs a subvolume (or, with
    quotas off, an image), elsewhere an image, which needs ``mkfs.ext4`` and
    loop devices."""
    if fs_type(parent) == BTRFS_SUPER_MAGIC:
        return
    check_images()


def check_images() -> None:
    """Refuse (:class:`LimitUnsupported`) where no image can be made and mounted."""
    if shutil.which(MKFS) is None:
        raise LimitUnsupported(OPTION, f"no {MKFS} (e2fsprogs) on the daemon's PATH")
    try:
        loop_control = stat.S_ISCHR(os.stat(LOOP_CONTROL).st_mode)
    except OSError:
        loop_control = False
    if not loop_control:
        raise LimitUnsupported(OPTION, f"no loop devices ({LOOP_CONTROL})")


def make_quota_dir(path: Path, quota: int) -> None:
    """Worker thread: ``path`` made (0700) as a directory whose contents may
    take at most ``quota`` bytes: a quota-limited btrfs subvolume where ROOT
    is on btrfs with quotas on, else an image mounted on it; removed again if
    that fails (:class:`LimitUnsupported`)."""
    if fs_type(path.parent) == BTRFS_SUPER_MAGIC and make_subvolume(path, quota):
        return
    check_images()
    path.mkdir(mode=0o700)
    try:
        make_image(path / IMAGE, quota)
        mount_image(path)
    except BaseException:
        (path / IMAGE).unlink(missing_ok=True)
        os.rmdir(path)
        raise


def make_subvolume(path: Path, quota: int) -> bool:
    """Worker thread: ``path`` as a btrfs subvolume (0700) whose referenced
    and exclusive bytes are limited to ``quota``; False (nothing left) if
    quotas are off on its file system."""
    create_subvolume(path)
    try:
        limited = set_limit(path, quota)
    except BaseException:
        os.rmdir(path)  # (empty: an empty subvolume goes with rmdir)
        raise
    if not limited:
        os.rmdir(path)
        return False
    os.chmod(path, 0o700)
    return True


def create_subvolume(path: Path) -> None:
    args = bytearray(VOL_ARGS_SIZE)
    name = os.fsencode(path.name)
    args[8:8 + len(name)] = name
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, BTRFS_IOC_SUBVOL_CREATE, args)
    finally:
        os.close(fd)


def set_limit(path: Path, quota: int) -> bool:
    """Limit the qgroup of subvolume ``path`` (qgroupid 0: its own); False if
    quotas are off on its file system."""
    args = bytearray(struct.pack("6Q", 0, LIMIT_MAX_RFER | LIMIT_MAX_EXCL, quota, quota, 0, 0))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, BTRFS_IOC_QGROUP_LIMIT, args)
    except OSError as exc:
        if exc.errno in (errno.ENOTCONN, errno.ENOENT, errno.EINVAL):  # quotas off
            return False
        raise
    finally:
        os.close(fd)
    return True


def make_image(image: Path, size: int) -> None:
    """Worker thread: a new sparse file of ``size`` bytes (root's alone) with
    an empty ext4 on it."""
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    tool([MKFS, *MKFS_OPTIONS, str(image)], f"cannot make the file system of {image}")


def mount_image(path: Path) -> None:
    """Worker thread: ``path``'s image mounted on ``path`` (util-linux
    ``mount`` sets the loop device up, to be freed with the last unmount, and
    reuses the one an earlier mount of the same image still holds)."""
    tool(["mount", "-t", "ext4", "-o", MOUNT_OPTIONS, str(path / IMAGE), str(path)],
         f"cannot mount {path / IMAGE}")


def tool(argv: list[str], what: str) -> None:
    """Run ``argv``; its failure as :class:`LimitUnsupported` with its last line."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT,
                              stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LimitUnsupported(OPTION, f"{what}: {exc}") from None
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines() or [f"exit {proc.returncode}"]
        raise LimitUnsupported(OPTION, f"{what}: {lines[-1]}")


def image_mounted(path: Path) -> bool:
    """Whether a file system is mounted on ``path`` (an image, after
    :func:`mount_image`; a btrfs subvolume is no mount)."""
    return bool(mounted_among([path]))


def mounted_among(paths: list[Path]) -> list[Path]:
    """Those of ``paths`` a file system is mounted on (one read of the mount table)."""
    points = {m.point for m in mount_table()}
    return [p for p in paths if str(p) in points]


def remount(path: Path) -> None:
    """Worker thread: a restored sandbox's image mounted on its directory
    again, unless it is mounted already (or the sandbox has none). A mount
    that fails while the loop device of its detached earlier mount is being
    freed (the kernel does that in a work item after the last close) is
    tried again once that device is gone."""
    if not (path / IMAGE).exists() or image_mounted(path):
        return
    try:
        mount_image(path)
    except LimitUnsupported:
        if not wait_loops_gone(path / IMAGE, LOOP_RUNDOWN_WAIT):
            raise
        mount_image(path)


def loops_of(image: Path) -> list[Path]:
    """The loop devices (their sysfs directories) backed by ``image``."""
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if backing.read_text().strip() == str(image):
                found.append(backing.parent.parent)
        except OSError:
            continue
    return found


def wait_loops_gone(image: Path, seconds: float) -> bool:
    """Wait until no loop device is backed by ``image`` (at most ``seconds``);
    whether there was one to wait for and it went."""
    if not loops_of(image):
        return False
    deadline = time.monotonic() + seconds
    while loops_of(image):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def unmount_image(path: Path) -> None:
    """Worker thread: the image mounted on ``path``, unmounted (EBUSY while a
    process uses it); nothing to do if none is."""
    if image_mounted(path):
        umount(str(path))
