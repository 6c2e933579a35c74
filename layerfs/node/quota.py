"""The quota of a sandbox's writable layer, enforced by the kernel: on a ROOT
on btrfs with quotas enabled (``btrfs quota enable --simple ROOT``), a sandbox
with a quota gets ``ROOT/sandboxes/<id>`` as a btrfs subvolume of its own
(its ``upper`` and ``work`` inside, so overlayfs's renames from work to upper
stay within it) whose qgroup is limited to the quota. A write past it fails
with EDQUOT ("Disk quota exceeded") in that sandbox only; the file system's
free space, and every other sandbox, are untouched beyond the quota.

A subvolume costs an ioctl, no device and no mkfs; deleting the sandbox's
directory (``down``) deletes the subvolume (an empty subvolume is removed
by rmdir). Any other file system for ROOT refuses a quota at ``up``
(:class:`~layerfs.errors.LimitUnsupported`), as does btrfs with quotas off.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from pathlib import Path

from ..errors import LimitUnsupported

BTRFS_SUPER_MAGIC = 0x9123683E
BTRFS_IOC_SUBVOL_CREATE = 0x5000940E  # _IOW(0x94, 14, struct btrfs_ioctl_vol_args)
BTRFS_IOC_QGROUP_LIMIT = 0x8030942B  # _IOR(0x94, 43, struct btrfs_ioctl_qgroup_limit_args)
VOL_ARGS_SIZE = 4096  # s64 fd, char name[4088]
LIMIT_MAX_RFER, LIMIT_MAX_EXCL = 1, 2
OPTION = "--disk-quota"
NEEDS = "it needs ROOT on btrfs with quotas enabled: btrfs quota enable --simple ROOT"


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
    """Refuse a quota (:class:`LimitUnsupported`) unless ``parent`` (the
    sandboxes' directory) is on btrfs."""
    if fs_type(parent) != BTRFS_SUPER_MAGIC:
        raise LimitUnsupported(OPTION, f"{parent} is not on btrfs; {NEEDS}")


def make_quota_dir(path: Path, quota: int) -> None:
    """Worker thread: ``path`` made as a btrfs subvolume (0700) whose
    referenced and exclusive bytes are limited to ``quota``; removed again if
    the limit cannot be set (quotas off: :class:`LimitUnsupported`)."""
    check_supported(path.parent)
    create_subvolume(path)
    try:
        set_limit(path, quota)
    except BaseException:
        os.rmdir(path)  # (empty: an empty subvolume goes with rmdir)
        raise
    os.chmod(path, 0o700)


def create_subvolume(path: Path) -> None:
    args = bytearray(VOL_ARGS_SIZE)
    name = os.fsencode(path.name)
    args[8:8 + len(name)] = name
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, BTRFS_IOC_SUBVOL_CREATE, args)
    finally:
        os.close(fd)


def set_limit(path: Path, quota: int) -> None:
    """Limit the qgroup of subvolume ``path`` (qgroupid 0: its own)."""
    args = bytearray(struct.pack("6Q", 0, LIMIT_MAX_RFER | LIMIT_MAX_EXCL, quota, quota, 0, 0))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, BTRFS_IOC_QGROUP_LIMIT, args)
    except OSError as exc:
        if exc.errno in (errno.ENOTCONN, errno.ENOENT, errno.EINVAL):  # quotas off
            raise LimitUnsupported(OPTION, f"quotas are off on {path.parent}; {NEEDS}") \
                from None
        raise
    finally:
        os.close(fd)
