"""A tar stream (plain, gzip, xz, bzip2 or zstd) as a layer source.

The archive is read once, front to back, without extracting: owners, modes,
device numbers and xattrs (PAX ``SCHILY.xattr.*``) come from the headers, so no
root is needed. OCI whiteouts become overlayfs ones: ``.wh.NAME`` a 0:0
character device ``NAME``, ``.wh..wh..opq`` ``trusted.overlay.opaque=y`` on
its directory. Entries that could write outside the tree are refused.

The source is opened once (a FIFO or pipe has no second read) and its
compression undone here. Python's ``tarfile`` parses the headers behind guards
(:class:`BoundedTarInfo`): extended headers are bounded before they are read,
pax records are parsed in linear time and their numbers checked, and a bad
header is an error rather than the end of the archive.

The tree an archive makes does not depend on who reads it: an entry below a
name that an earlier entry of the same archive made a symlink, a file or
another non-directory ("symlink ``s`` -> ``d``, then ``s/f``") is refused
(:func:`check_parents`). GNU tar and containerd's applier would write it
through the symlink (to ``d/f``, or into a lower layer's ``d``), a lazy mount
would show a directory ``s``: no single layer tree is both. A whiteout there
(``.wh.s``, then ``s/f``) is not such a name: the new directory replaces it.

Where the archive may end is decided as Go's ``archive/tar`` (and so containerd)
decides: at a header's place, with or without end-of-archive blocks, or inside
the padding after an entry's data; a header or an entry's data cut short is an
error, and so is a zero block followed by anything but a second one or the end.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import re
import stat
import sys
import tarfile
import zlib
from typing import BinaryIO, Protocol, cast

import zstandard

from layerfs.errors import SourceError, UnsafeTarEntry
from layerfs.tree import FileTree, FsNode

from .assembler import LayerAssembler

WHITEOUT = b".wh."
OPAQUE = b".wh..wh..opq"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
TAR_MAGICS = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ", ZSTD_MAGIC)
HEAD = tarfile.BLOCKSIZE
STREAM_BUFFER = 1 << 20

MAX_META_HEADER = 1 << 20  # one pax or GNU long name/link header
MAX_META_PER_ENTRY = 4 << 20  # all such headers in front of one entry
MAX_META_HEADERS = 64  # how many of them in front of one entry
MAX_GLOBAL_PAX = 4 << 20  # all global pax headers of the archive
META_TYPES = {tarfile.XHDTYPE: "pax", tarfile.SOLARIS_XHDTYPE: "pax",
              tarfile.XGLTYPE: "global pax", tarfile.GNUTYPE_LONGNAME: "GNU long name",
              tarfile.GNUTYPE_LONGLINK: "GNU long link"}
PAX_NUMBERS = {"uid": rb"\d{1,30}", "gid": rb"\d{1,30}", "size": rb"\d{1,30}",
               "mtime": rb"-?\d+(\.\d+)?", "atime": rb"-?\d+(\.\d+)?",
               "ctime": rb"-?\d+(\.\d+)?", "GNU.sparse.size": rb"\d{1,30}",
               "GNU.sparse.realsize": rb"\d{1,30}", "GNU.sparse.map": rb"\d{1,30}(,\d{1,30})*"}

ZERO_BLOCK = bytes(HEAD)

# tarfile's header errors, not exported by its stubs
InvalidHeaderError: type[Exception] = tarfile.InvalidHeaderError  # type: ignore[attr-defined]
octal_number = tarfile.nti  # type: ignore[attr-defined]


class TarFormatError(Exception):
    """A malformed or oversized tar header; the source adds its path."""


class ArchiveEnd(Exception):  # noqa: N818 (not an error: the archive ends here)
    """The stream ends where an archive may end; raised past tarfile's own
    handlers (a header after a GNU long name wraps its header errors)."""


def looks_like_tar(head: bytes) -> bool:
    """True for the first bytes of a (compressed) tar archive."""
    if head.startswith(TAR_MAGICS):
        return True
    return len(head) == HEAD and head[257:262] == b"ustar"


class HeadStream(io.RawIOBase):
    """A stream read once: the bytes already sniffed, then the rest of it."""

    def __init__(self, head: bytes, rest: BinaryIO) -> None:
        self.head = head
        self.rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:  # type: ignore[no-untyped-def]
        if self.head:
            n = min(len(buf), len(self.head))
            buf[:n], self.head = self.head[:n], self.head[n:]
            return n
        data = self.rest.read(len(buf))
        buf[: len(data)] = data
        return len(data)


def read_head(raw: BinaryIO) -> bytes:
    """Up to one tar block; a pipe may hand it over in pieces."""
    head = b""
    while len(head) < HEAD:
        piece = raw.read(HEAD - len(head))
        if not piece:
            break
        head += piece
    return head


def open_tar(path: str) -> TarSource:
    """Open ``path`` (or stdin for ``-``) once and check that it starts like a tar.

    Pipes, FIFOs and ``/dev/stdin`` cannot be opened twice, so the sniffed
    bytes are handed on to the reader instead of being read again."""
    try:
        raw: BinaryIO = (sys.stdin.buffer if path == "-"
                         else open(path, "rb", buffering=0))  # type: ignore[assignment]  # noqa: SIM115
    except OSError as exc:
        raise SourceError(path, (exc.strerror or str(exc)).lower()) from None
    try:
        head = read_head(raw)
    except OSError as exc:
        _close(raw)
        raise SourceError(path, (exc.strerror or str(exc)).lower()) from None
    if not looks_like_tar(head):
        _close(raw)
        raise SourceError(path, "not a directory or tar archive")
    return TarSource(path, raw, head)


def _close(raw: BinaryIO) -> None:
    if raw is not sys.stdin.buffer:
        raw.close()


def open_stream(raw: BinaryIO, head: bytes = b"") -> BinaryIO:
    """The archive's tar bytes: compression undone here, where the formats'
    own checks (gzip CRC, xz and bzip2 checks, zstd checksums) run once the
    stream is read to its end (see :func:`drain`)."""
    buffered = io.BufferedReader(HeadStream(head, raw), STREAM_BUFFER)  # type: ignore[arg-type]
    magic = buffered.peek(6)[:6]
    if magic.startswith(ZSTD_MAGIC):
        return zstandard.ZstdDecompressor().stream_reader(  # type: ignore[return-value]
            buffered, read_across_frames=True)
    if magic.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=buffered, mode="rb")  # type: ignore[return-value]
    if magic.startswith(b"BZh"):
        return bz2.BZ2File(buffered)  # type: ignore[return-value]
    if magic.startswith(b"\xfd7zXZ"):
        return lzma.LZMAFile(buffered)  # type: ignore[return-value]
    return buffered


def drain(stream: BinaryIO) -> None:
    """Read what follows the end-of-archive blocks, so that a compressed
    stream's trailer is checked too."""
    while stream.read(STREAM_BUFFER):
        pass


def parse_pax(buf: bytes, where: int) -> dict[str, str]:
    """The records ``"<length> <key>=<value>\\n"`` of one pax header, checked."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(buf):
        if not buf[pos:].strip(b"\0"):
            break  # NUL padding
        space = buf.find(b" ", pos, pos + 21)
        digits = buf[pos:space] if space > pos else b""
        end = pos + int(digits) if digits.isdigit() else -1
        if end <= space + 1 or end > len(buf) or buf[end - 1] != 0x0A:
            raise TarFormatError(f"malformed pax record at byte {where + pos}")
        key, eq, value = buf[space + 1 : end - 1].partition(b"=")
        name = key.decode("utf-8", "surrogateescape")
        if not eq or not key:
            raise TarFormatError(f"malformed pax record at byte {where + pos}")
        number = PAX_NUMBERS.get(name)
        if number is not None and not re.fullmatch(number, value):
            shown = value[:40].decode("utf-8", "replace")
            raise TarFormatError(f"invalid pax {name} {shown!r} at byte {where + pos}")
        out[name] = value.decode("utf-8", "surrogateescape")
        pos = end
    return out


class BoundedTarFile(tarfile.TarFile):
    """A tar reader that counts the extended headers in front of each entry."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.meta_bytes = 0
        self.meta_headers = 0
        self.global_bytes = 0
        self.data_end = 0  # where the last header's data ends (its padding starts)
        kwargs["tarinfo"] = BoundedTarInfo
        super().__init__(*args, **kwargs)

    def next(self) -> tarfile.TarInfo | None:
        """The next entry, or None where the archive ends: tarfile's own, but
        the stream may end in the padding after an entry's data."""
        fileobj = self.fileobj
        assert fileobj is not None
        try:
            if self.firstmember is None and self.offset > fileobj.tell():  # type: ignore[attr-defined]
                self.skip_data()
            return super().next()
        except ArchiveEnd:
            self._loaded = True
            return None

    def skip_data(self) -> None:
        """Move past the unread rest of an entry's data, then its padding."""
        if not self.reaches(self.data_end):
            raise TarFormatError(f"archive ends inside an entry's data before byte "
                                 f"{self.data_end}")
        if not self.reaches(self.offset):
            raise ArchiveEnd

    def reaches(self, pos: int) -> bool:
        """Move the stream to ``pos``; False if it ends before."""
        fileobj = self.fileobj
        assert fileobj is not None
        if fileobj.tell() >= pos:
            return True
        fileobj.seek(pos - 1)
        return bool(fileobj.read(1))

    def count_meta(self, info: tarfile.TarInfo) -> None:
        kind = META_TYPES[info.type]
        if info.size > MAX_META_HEADER:
            raise TarFormatError(f"{kind} header of {info.size} bytes at byte {info.offset} "
                                 f"(at most {MAX_META_HEADER >> 20} MiB)")
        if info.type == tarfile.XGLTYPE:
            self.global_bytes += info.size
        self.charge(info.size, info.offset)

    def charge(self, size: int, offset: int, header: bool = True) -> None:
        """Count ``size`` more bytes of extended headers (or of a sparse map)."""
        self.meta_bytes += size
        self.meta_headers += header
        if (self.meta_bytes > MAX_META_PER_ENTRY or self.meta_headers > MAX_META_HEADERS
                or self.global_bytes > MAX_GLOBAL_PAX):
            raise TarFormatError(f"too many pax and long name headers before byte {offset} "
                                 f"(at most {MAX_META_HEADERS} and {MAX_META_PER_ENTRY >> 20} "
                                 "MiB per entry)")

    def end_entry(self) -> None:
        self.meta_bytes = self.meta_headers = 0


class BoundedTarInfo(tarfile.TarInfo):
    """Checks each header before tarfile acts on it: sizes bounded, numbers
    well formed, a bad header an error rather than the end of the archive."""

    @classmethod
    def fromtarfile(cls, tarfile_: tarfile.TarFile) -> BoundedTarInfo:
        assert isinstance(tarfile_, BoundedTarFile)
        offset = tarfile_.fileobj.tell()  # type: ignore[union-attr]
        if offset < tarfile_.data_end:  # a GNU long name cut short
            raise TarFormatError(f"archive ends inside an entry's data before byte "
                                 f"{tarfile_.data_end}")
        buf = read_header_block(tarfile_, offset)
        try:
            obj = cls.frombuf(buf, tarfile_.encoding, tarfile_.errors)  # type: ignore[arg-type]
        except InvalidHeaderError as exc:
            raise TarFormatError(f"invalid tar header at byte {offset} ({exc})") from None
        obj.offset = offset
        return cast(BoundedTarInfo, obj._proc_member(tarfile_))

    def _proc_member(self, tarfile_: BoundedTarFile) -> tarfile.TarInfo:
        if self.size < 0:
            raise TarFormatError(f"negative size in the tar header at byte {self.offset}")
        has_data = (self.type in META_TYPES or self.isreg()
                    or self.type not in tarfile.SUPPORTED_TYPES)
        tarfile_.data_end = self.offset + HEAD + (self.size if has_data else 0)
        if self.type in META_TYPES:
            tarfile_.count_meta(self)
        else:
            tarfile_.end_entry()
        try:
            return super()._proc_member(tarfile_)  # type: ignore[misc,no-any-return]
        except (ValueError, OverflowError) as exc:
            raise TarFormatError(f"malformed tar header at byte {self.offset} ({exc})") from None

    def _proc_pax(self, tarfile_: BoundedTarFile) -> tarfile.TarInfo:
        """tarfile's own, with a linear record parser (its regexes can take hours
        on a crafted 1 MiB header) and bounded GNU sparse maps."""
        buf = tarfile_.fileobj.read(self._block(self.size))  # type: ignore[attr-defined,union-attr]
        if len(buf) < self.size:
            raise TarFormatError(f"archive ends inside the pax header at byte {self.offset}")
        records = parse_pax(buf[: self.size], self.offset + HEAD)
        if "GNU.sparse.offset" in records:
            raise TarFormatError(f"GNU sparse format 0.0 at byte {self.offset} is not supported")
        if self.type == tarfile.XGLTYPE:
            pax_headers = cast(dict, tarfile_.pax_headers)
            pax_headers.update(records)
        else:
            pax_headers = {**tarfile_.pax_headers, **records}
        following = self.fromtarfile(tarfile_)
        sparse_version = (pax_headers.get("GNU.sparse.major"), pax_headers.get("GNU.sparse.minor"))
        if "GNU.sparse.map" in pax_headers:
            self._proc_gnusparse_01(following, pax_headers)  # type: ignore[attr-defined]
        elif sparse_version == ("1", "0"):
            self._sparse_map_10(following, tarfile_)
        if self.type != tarfile.XGLTYPE:
            following._apply_pax_info(pax_headers, tarfile_.encoding,  # type: ignore[attr-defined]
                                      tarfile_.errors)
            following.offset = self.offset
            if "size" in pax_headers:
                end = following.offset_data  # type: ignore[attr-defined]
                if following.isreg() or following.type not in tarfile.SUPPORTED_TYPES:
                    tarfile_.data_end = end + following.size
                    end += following._block(following.size)  # type: ignore[attr-defined]
                else:
                    tarfile_.data_end = end
                tarfile_.offset = end
        return following

    def _sparse_map_10(self, following: tarfile.TarInfo, tarfile_: BoundedTarFile) -> None:
        """GNU sparse 1.0: the map leads the entry's data as decimal lines,
        read a block at a time and counted against the entry's header budget."""
        numbers: list[int] = []
        buf = b""
        count = None
        while count is None or len(numbers) < 2 * count:
            while b"\n" not in buf:
                block = tarfile_.fileobj.read(HEAD)  # type: ignore[union-attr]
                if len(block) < HEAD:
                    raise TarFormatError(f"archive ends inside the sparse map at byte "
                                         f"{self.offset}")
                tarfile_.charge(HEAD, self.offset, header=False)
                buf += block
            line, buf = buf.split(b"\n", 1)
            if not line.isdigit() or len(line) > 30:
                raise TarFormatError(f"malformed sparse map at byte {self.offset}")
            if count is None:
                count = int(line)
            else:
                numbers.append(int(line))
        following.offset_data = tarfile_.fileobj.tell()  # type: ignore[attr-defined,union-attr]
        pairs = list(zip(numbers[::2], numbers[1::2], strict=True))
        following.sparse = pairs  # type: ignore[assignment]

    def _proc_sparse(self, tarfile_: BoundedTarFile) -> tarfile.TarInfo:
        """An old GNU sparse entry; its extension blocks are counted like headers."""
        structs, extended, real_size = self._sparse_structs  # type: ignore[attr-defined]
        del self._sparse_structs  # type: ignore[attr-defined]
        while extended:
            tarfile_.charge(HEAD, self.offset, header=False)
            buf = tarfile_.fileobj.read(HEAD)  # type: ignore[union-attr]
            if len(buf) < HEAD:
                raise TarFormatError(f"archive ends inside the sparse header at byte "
                                     f"{self.offset}")
            for pos in range(0, 21 * 24, 24):
                try:
                    start = octal_number(buf[pos : pos + 12])
                    length = octal_number(buf[pos + 12 : pos + 24])
                except ValueError:
                    break
                if start and length:
                    structs.append((start, length))
            extended = bool(buf[504])
        self.sparse = structs
        self.offset_data = tarfile_.fileobj.tell()  # type: ignore[attr-defined,union-attr]
        tarfile_.data_end = self.offset_data + self.size  # type: ignore[attr-defined]
        tarfile_.offset = self.offset_data + self._block(self.size)  # type: ignore[attr-defined]
        self.size = real_size
        return self


def read_header_block(tarfile_: BoundedTarFile, offset: int) -> bytes:
    """The block at a header's place. The archive ends if the stream does, or
    with a zero block followed by the stream's end or a second zero block."""
    fileobj = tarfile_.fileobj
    assert fileobj is not None
    buf = fileobj.read(HEAD)
    if not buf:
        raise ArchiveEnd
    if len(buf) < HEAD:
        raise TarFormatError(f"archive ends inside the header at byte {offset}")
    if buf != ZERO_BLOCK:
        return buf
    second = fileobj.read(HEAD)
    if not second or second == ZERO_BLOCK:
        raise ArchiveEnd
    if len(second) < HEAD:
        raise TarFormatError(f"archive ends inside the header at byte {offset + HEAD}")
    raise TarFormatError(f"tar header at byte {offset + HEAD} after a zero block")


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


def check_parents(tree: FileTree, parts: list[bytes], name: str) -> None:
    """Refuse an entry below a non-directory an earlier entry made (a symlink
    above all: readers differ on what that tree is); a whiteout is no such
    entry (a directory at its name replaces it, as in every reader)."""
    node = tree.root
    for depth, part in enumerate(parts[:-1]):
        assert node.children is not None
        child = node.children.get(part)
        if child is None:
            return
        if not child.is_dir:
            if stat.S_ISCHR(child.mode) and (child.rdev_major, child.rdev_minor) == (0, 0):
                return  # a whiteout
            above = b"/".join(parts[:depth + 1]).decode(errors="replace")
            kind = "a symlink" if stat.S_ISLNK(child.mode) else "not a directory"
            raise UnsafeTarEntry(name, f"below {above!r}, which an earlier entry made "
                                       f"{kind} (readers would unpack it differently)")
        node = child


def pax_mtime(member: tarfile.TarInfo) -> tuple[int, int]:
    """Seconds and nanoseconds; ``parse_pax`` checked the syntax. A time with more
    digits than any inode holds comes out as 10**30, for the assembler to clamp."""
    text = member.pax_headers.get("mtime")
    if not text:
        return int(member.mtime), 0
    negative = text.startswith("-")
    whole, _, frac = text.lstrip("-").partition(".")
    if len(whole) > 30:
        return (-(10**30) if negative else 10**30), 0
    total = int(whole) * 10**9 + int((frac + "0" * 9)[:9])
    sec, nsec = divmod(-total if negative else total, 10**9)
    return sec, nsec


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


class MemberObserver(Protocol):
    """Told where each member starts and which stream bytes are file content the
    layer stores (``kind``: "hard_links", "whiteouts", "opaque_dirs" or "")."""

    def member(self, offset: int, kind: str = "") -> None: ...

    def content(self, offset: int, size: int, parts: list[bytes], node: FsNode) -> None: ...


class TarSource:
    """Reads a tar archive once, front to back, from an already opened stream."""

    def __init__(self, path: str, raw: BinaryIO, head: bytes, sniff: bool = True,
                 observer: MemberObserver | None = None) -> None:
        self.path = path
        self.raw = raw
        self.head = head
        self.sniff = sniff  # False: ``raw`` is already the plain tar stream
        self.observer = observer  # offsets are those of the plain tar stream

    def feed(self, asm: LayerAssembler) -> None:
        try:
            stream = open_stream(self.raw, self.head) if self.sniff else self.raw
            with BoundedTarFile.open(fileobj=stream, mode="r|") as tar:  # type: ignore[call-overload]
                for member in tar:
                    self._entry(asm, tar, member)
            drain(stream)
        except TarFormatError as exc:
            raise SourceError(self.path, str(exc)) from None
        except (tarfile.TarError, zstandard.ZstdError, zlib.error, lzma.LZMAError,
                EOFError) as exc:
            raise SourceError(self.path, f"not a readable tar archive ({exc})") from None
        except OSError as exc:
            raise SourceError(self.path, exc.strerror or str(exc)) from None
        finally:
            self.close()

    def close(self) -> None:
        _close(self.raw)

    def _entry(self, asm: LayerAssembler, tar: BoundedTarFile, member: tarfile.TarInfo) -> None:
        parts = split_name(member.name, "path")
        base = parts[-1] if parts else b""
        if self.observer:
            self.observer.member(member.offset, _member_kind(member, base))
        if base == OPAQUE:
            asm.mark_opaque(parts[:-1])
            return
        if base.startswith(WHITEOUT):
            parent = asm.tree.lookup(parts[:-1])
            if parent is not None and not parent.is_dir:
                return  # inside a file this layer writes: nothing below shows through
            wh = FsNode(mode=stat.S_IFCHR, uid=member.uid, gid=member.gid,
                        mtime=pax_mtime(member)[0])
            asm.add(parts[:-1] + [base[len(WHITEOUT) :]], wh)
            return
        if member.islnk():
            target = split_name(member.linkname, "hard link target")
            check_parents(asm.tree, parts, member.name)
            check_parents(asm.tree, target, member.linkname)
            asm.link(parts, target)
            return
        node = node_from_member(member)
        if not parts:
            asm.set_root(node)
            return
        check_parents(asm.tree, parts, member.name)
        if node.target:
            check_symlink(parts, node.target, member.name)
        if self.observer and member.isreg() and not member.issparse():
            self.observer.content(member.offset_data, member.size,  # type: ignore[attr-defined]
                                  parts, node)
        try:
            asm.add(parts, node, tar.extractfile(member) if member.isreg() else None)
        except tarfile.ReadError:  # the data is shorter than the header says
            raise TarFormatError(f"archive ends inside an entry's data before byte "
                                 f"{tar.data_end}") from None


def _member_kind(member: tarfile.TarInfo, base: bytes) -> str:
    if base == OPAQUE:
        return "opaque_dirs"
    if base.startswith(WHITEOUT):
        return "whiteouts"
    return "hard_links" if member.islnk() else ""
