"""A tar stream (plain, gzip, xz, bzip2 or zstd) as a layer source.

The archive is read once, front to back, without extracting: owners, modes,
device numbers and xattrs (PAX ``SCHILY.xattr.*``) come from the headers, so no
root is needed. OCI whiteouts become overlayfs ones: ``.wh.NAME`` a 0:0
character device ``NAME``, ``.wh..wh..opq`` ``trusted.overlay.opaque=y`` on
its directory. Entries that could write outside the tree are refused.
"""

from __future__ import annotations

import io
import stat
import sys
import tarfile
from typing import BinaryIO

import zstandard

from layerfs.errors import SourceError, UnsafeTarEntry
from layerfs.tree import FsNode

from .assembler import LayerAssembler

WHITEOUT = b".wh."
OPAQUE = b".wh..wh..opq"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
TAR_MAGICS = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ", ZSTD_MAGIC)


def looks_like_tar(path: str) -> bool:
    """True for ``-`` and for files that start like a (compressed) tar."""
    if path == "-":
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return False
    if head.startswith(TAR_MAGICS):
        return True
    return len(head) == 512 and head[257:262] == b"ustar"


def open_stream(raw: BinaryIO) -> BinaryIO:
    """Undo zstd here; tarfile itself undoes gzip, bzip2 and xz."""
    buffered: io.BufferedReader = (
        raw if isinstance(raw, io.BufferedReader)
        else io.BufferedReader(raw)  # type: ignore[arg-type,type-var]
    )
    if buffered.peek(4)[:4] == ZSTD_MAGIC:
        return zstandard.ZstdDecompressor().stream_reader(buffered)  # type: ignore[return-value]
    return buffered


def split_name(name: str, what: str) -> list[bytes]:
    """Archive path → safe components; refuses absolute paths and ``..``."""
    raw = name.encode("utf-8", "surrogateescape")
    if raw.startswith(b"/"):
        raise UnsafeTarEntry(name, f"absolute {what}")
    parts = [p for p in raw.split(b"/") if p not in (b"", b".")]
    if b".." in parts:
        raise UnsafeTarEntry(name, f"'..' in {what}")
    return parts


def check_symlink(parts: list[bytes], target: bytes, name: str) -> None:
    """A relative symlink must not climb above the layer's root."""
    if target.startswith(b"/"):
        return  # absolute targets resolve inside the sandbox root
    depth = 0
    for comp in b"/".join([*parts[:-1], target]).split(b"/"):
        if comp == b"..":
            depth -= 1
        elif comp not in (b"", b"."):
            depth += 1
        if depth < 0:
            shown = target.decode(errors="replace")
            raise UnsafeTarEntry(name, f"symlink target {shown!r} escapes the root")


def pax_mtime(member: tarfile.TarInfo) -> tuple[int, int]:
    text = member.pax_headers.get("mtime")
    if text:
        whole, _, frac = text.partition(".")
        return int(whole), int((frac + "000000000")[:9]) if frac else 0
    return int(member.mtime), 0


def pax_xattrs(member: tarfile.TarInfo) -> dict[bytes, bytes]:
    out = {}
    for key, value in member.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            name = key[len("SCHILY.xattr.") :].encode("utf-8", "surrogateescape")
            out[name] = value.encode("utf-8", "surrogateescape")
    return out


def node_from_member(member: tarfile.TarInfo) -> FsNode:
    mtime, mtime_ns = pax_mtime(member)
    perm = member.mode & 0o7777
    node = FsNode(mode=perm, uid=member.uid, gid=member.gid, mtime=mtime, mtime_ns=mtime_ns,
                  xattrs=pax_xattrs(member))
    if member.isreg():
        node.mode |= stat.S_IFREG
        node.size = member.size
    elif member.isdir():
        node.mode |= stat.S_IFDIR
        node.children = {}
    elif member.issym():
        node.mode |= stat.S_IFLNK
        node.target = member.linkname.encode("utf-8", "surrogateescape")
    elif member.ischr() or member.isblk():
        node.mode |= stat.S_IFCHR if member.ischr() else stat.S_IFBLK
        node.rdev_major, node.rdev_minor = member.devmajor, member.devminor
    elif member.isfifo():
        node.mode |= stat.S_IFIFO
    else:
        raise SourceError(member.name, f"unsupported tar entry type {member.type!r}")
    return node


class TarSource:
    """Reads a tar archive from a path, or from stdin for ``-``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def feed(self, asm: LayerAssembler) -> None:
        try:
            raw = sys.stdin.buffer if self.path == "-" else open(self.path, "rb")  # noqa: SIM115
        except OSError as exc:
            raise SourceError(self.path, exc.strerror) from None
        try:
            with tarfile.open(fileobj=open_stream(raw), mode="r|*") as tar:  # type: ignore[call-overload]
                for member in tar:
                    self._entry(asm, tar, member)
        except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
            raise SourceError(self.path, f"not a readable tar archive ({exc})") from None
        except OSError as exc:
            raise SourceError(self.path, exc.strerror or str(exc)) from None
        finally:
            if raw is not sys.stdin.buffer:
                raw.close()

    def _entry(self, asm: LayerAssembler, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        parts = split_name(member.name, "path")
        base = parts[-1] if parts else b""
        if base == OPAQUE:
            asm.mark_opaque(parts[:-1])
            return
        if base.startswith(WHITEOUT):
            wh = FsNode(mode=stat.S_IFCHR, uid=member.uid, gid=member.gid,
                        mtime=pax_mtime(member)[0])
            asm.add(parts[:-1] + [base[len(WHITEOUT) :]], wh)
            return
        if member.islnk():
            asm.link(parts, split_name(member.linkname, "hard link target"))
            return
        node = node_from_member(member)
        if not parts:
            asm.set_root(node)
            return
        if node.target:
            check_symlink(parts, node.target, member.name)
        asm.add(parts, node, tar.extractfile(member) if member.isreg() else None)
