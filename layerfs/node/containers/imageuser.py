"""The user an image's process runs as: an OCI ``User`` (``user``, ``uid``,
``user:group``, ``uid:gid``, ``user:gid``, ``uid:group``) resolved against the
image's own ``/etc/passwd`` and ``/etc/group``, read inside the sandbox rootfs.

The rootfs is hostile. Its files are opened with ``openat2(RESOLVE_IN_ROOT)``
from a descriptor of the rootfs, so every symlink on the way (``/etc`` or
``/etc/passwd`` pointing at ``/host/secret`` or ``../../..``) resolves inside
the rootfs, never on the host; ``O_NONBLOCK`` so that a FIFO does not block the
open; only a regular file of at most :data:`MAX_DB_BYTES` is read. A missing
file has no entries; one that is not a regular file or is too large is an error.
"""

from __future__ import annotations

import errno
import os
import stat

from ...errors import ImageFileError, ImageUserError
from ...records import Record
from ...safeopen import READ_FLAGS, RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, openat2

MAX_DB_BYTES = 4 << 20  # /etc/passwd and /etc/group: real ones are far smaller
MAX_ID = (1 << 31) - 1  # the largest uid/gid runc and crun set up (the kernel's is 2^32 - 2)


class PasswdEntry(Record):
    name: str
    uid: int
    gid: int
    home: str


class GroupEntry(Record):
    name: str
    gid: int
    members: tuple[str, ...]


class ImageUser(Record):
    """The resolved user: ids for the runtime, and the HOME its passwd entry gives."""

    uid: int
    gid: int
    additional_gids: tuple[int, ...] = ()
    home: str = "/root"
    name: str = "root"


def open_in_root(rootfs_fd: int, path: str) -> int | None:
    """Open ``path`` read-only with every component resolved inside the rootfs
    (``RESOLVE_IN_ROOT``); None if it does not exist."""
    try:
        return openat2(rootfs_fd, path, READ_FLAGS, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise ImageFileError(path, exc.strerror or str(exc)) from None


def read_image_file(rootfs_fd: int, path: str, limit: int = MAX_DB_BYTES) -> str:
    """The text of a regular file of the rootfs of at most ``limit`` bytes
    ("" if it is missing)."""
    fd = open_in_root(rootfs_fd, path)
    if fd is None:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageFileError(path, "not a regular file")
        if st.st_size > limit:
            raise ImageFileError(path, f"larger than {limit} bytes")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ImageFileError(path, f"larger than {limit} bytes")
    return data.decode("utf-8", errors="replace")


def parse_id(text: str) -> int | None:
    """A decimal uid/gid in range, or None."""
    if not text.isascii() or not text.isdigit():
        return None
    value = int(text)
    return value if value <= MAX_ID else None


def parse_passwd(text: str) -> list[PasswdEntry]:
    """``name:password:uid:gid:gecos:home:shell`` lines; malformed ones are skipped."""
    entries = []
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) < 7 or not fields[0]:
            continue
        uid, gid = parse_id(fields[2]), parse_id(fields[3])
        if uid is not None and gid is not None:
            entries.append(PasswdEntry(fields[0], uid, gid, fields[5] or "/"))
    return entries


def parse_group(text: str) -> list[GroupEntry]:
    """``name:password:gid:member,member`` lines; malformed ones are skipped."""
    entries = []
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) < 4 or not fields[0]:
            continue
        gid = parse_id(fields[2])
        if gid is not None:
            members = tuple(m for m in fields[3].split(",") if m)
            entries.append(GroupEntry(fields[0], gid, members))
    return entries


def resolve_user(rootfs: str, spec: str) -> ImageUser:
    """Resolve the OCI ``User`` ``spec`` ("" = root) against the rootfs's
    /etc/passwd and /etc/group."""
    user_part, _, group_part = spec.partition(":")
    rootfs_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        passwd = parse_passwd(read_image_file(rootfs_fd, "/etc/passwd"))
        groups = parse_group(read_image_file(rootfs_fd, "/etc/group"))
    finally:
        os.close(rootfs_fd)
    entry = _passwd_entry(spec, user_part or "0", passwd)
    uid = entry.uid if entry else int(user_part or 0)
    gid = entry.gid if entry else 0
    if group_part:
        gid = _group_id(spec, group_part, groups)
    name = entry.name if entry else ""
    extra = sorted({g.gid for g in groups if name and name in g.members and g.gid != gid})
    home = entry.home if entry else ("/root" if uid == 0 else "/")
    return ImageUser(uid=uid, gid=gid, additional_gids=tuple(extra), home=home, name=name)


def _passwd_entry(spec: str, user: str, passwd: list[PasswdEntry]) -> PasswdEntry | None:
    """The entry a name or uid names; a uid may have none, a name must."""
    uid = parse_id(user)
    if uid is not None:
        return next((e for e in passwd if e.uid == uid), None)
    _check_range(spec, "uid", user)
    entry = next((e for e in passwd if e.name == user), None)
    if entry is None:
        raise ImageUserError(spec, f"no user {user!r} in the image's /etc/passwd")
    return entry


def _check_range(spec: str, what: str, text: str) -> None:
    """A number too large for an id is one error, not a name to look up."""
    if text.isascii() and text.isdigit():
        raise ImageUserError(spec, f"{what} {text} is out of range (0 to {MAX_ID},"
                                   " what the OCI runtimes take)")


def _group_id(spec: str, group: str, groups: list[GroupEntry]) -> int:
    gid = parse_id(group)
    if gid is not None:
        return gid
    _check_range(spec, "gid", group)
    entry = next((g for g in groups if g.name == group), None)
    if entry is None:
        raise ImageUserError(spec, f"no group {group!r} in the image's /etc/group")
    return entry.gid
