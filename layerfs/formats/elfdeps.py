"""What an ELF program or library asks the dynamic loader for: its
interpreter and the libraries it names (``DT_NEEDED``), with where to look
(``DT_RUNPATH``, ``DT_RPATH``).

The node reads these from layer data to fetch a program's libraries before
the loader asks for them (layerfs/node/reads/libraryahead.py). The bytes are
checked layer data, but the layer's author may be anyone: every count and
offset is bounded, every read stays inside the file, and a file that does not
parse as expected has no needs (nothing raised but :class:`NeedBytes`).

Reads go through ``read(offset, length)``, which returns the file's bytes or
raises :class:`NeedBytes` for a part the caller does not hold yet (a chunk
not fetched): the caller fetches it and asks again. pyelftools was looked at:
it finds the dynamic string table through the section headers at the end of
the file (an ``ELFParseError`` on a library's first MiB) and takes about 1
ms a file; this reads three small tables within fixed bounds.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

MAGIC = b"\x7fELF"
HEAD = 64  # bytes of the ELF header (64-bit; 52 for 32-bit)
PT_LOAD, PT_DYNAMIC, PT_INTERP = 1, 2, 3
DT_NULL, DT_NEEDED, DT_STRTAB, DT_STRSZ, DT_RPATH, DT_RUNPATH = 0, 1, 5, 10, 15, 29
MAX_PHDRS = 256  # program headers read at most
MAX_DYNAMIC = 1024  # dynamic entries read at most
MAX_NEEDED = 64  # libraries taken from one file at most
MAX_NAME = 255  # bytes of a library name or path
MAX_STRTAB = 1 << 20  # bytes of the string table read at most
# e_machine → the Debian multiarch directory name of its libraries
MULTIARCH = {62: "x86_64-linux-gnu", 183: "aarch64-linux-gnu", 3: "i386-linux-gnu",
             40: "arm-linux-gnueabihf", 243: "riscv64-linux-gnu", 21: "powerpc64le-linux-gnu",
             22: "s390x-linux-gnu"}

Read = Callable[[int, int], bytes]


class NeedBytes(Exception):
    """The file's bytes at ``offset`` are not held yet."""

    def __init__(self, offset: int) -> None:
        super().__init__(offset)
        self.offset = offset


@dataclass
class ElfNeeds:
    """A dynamically linked file's requests to the loader."""

    machine: int
    interp: str | None = None
    needed: list[str] = field(default_factory=list)
    search: list[str] = field(default_factory=list)  # DT_RUNPATH, else DT_RPATH dirs

    @property
    def multiarch(self) -> str | None:
        return MULTIARCH.get(self.machine)


@dataclass(frozen=True)
class _Layout:
    big: bool
    wide: bool  # 64-bit
    machine: int
    loads: list[tuple[int, int, int]]  # (vaddr, filesz, offset) of each PT_LOAD
    dynamic: tuple[int, int] | None  # (offset, size)
    interp: tuple[int, int] | None


def is_elf(head: bytes | bytearray | memoryview) -> bool:
    return bytes(head[:4]) == MAGIC


def needs(read: Read) -> ElfNeeds | None:
    """The file's needs, None if it is no dynamically linked ELF file it can
    read (:class:`NeedBytes` for bytes to fetch first)."""
    try:
        layout = _layout(read)
        if layout is None:
            return None
        out = ElfNeeds(layout.machine)
        if layout.interp is not None:
            out.interp = _name(read(*layout.interp).split(b"\0", 1)[0])
        if layout.dynamic is not None:
            _dynamic(read, layout, out)
        return out
    except NeedBytes:
        raise
    except (struct.error, ValueError, IndexError):
        return None


def _layout(read: Read) -> _Layout | None:
    ident = read(0, 16)
    if ident[:4] != MAGIC or ident[4] not in (1, 2) or ident[5] not in (1, 2):
        return None
    wide, big = ident[4] == 2, ident[5] == 2
    e = ">" if big else "<"
    if wide:
        (_type, machine, _v, _entry, phoff, _shoff, _flags, _ehsize, phentsize,
         phnum) = struct.unpack(e + "HHIQQQIHHH", read(16, 42))
        ph = struct.Struct(e + "IIQQQQQQ")
    else:
        (_type, machine, _v, _entry, phoff, _shoff, _flags, _ehsize, phentsize,
         phnum) = struct.unpack(e + "HHIIIIIHHH", read(16, 30))
        ph = struct.Struct(e + "IIIIIIII")
    if phentsize != ph.size or not 0 < phnum <= MAX_PHDRS:  # (glibc's loader asks the same)
        return None
    table = read(phoff, phentsize * phnum)
    loads, dynamic, interp = [], None, None
    for k in range(phnum):
        fields = ph.unpack_from(table, k * phentsize)
        if wide:
            p_type, _pf, offset, vaddr, _paddr, filesz = fields[:6]
        else:
            p_type, offset, vaddr, _paddr, filesz = fields[:5]
        if p_type == PT_LOAD:
            loads.append((vaddr, filesz, offset))
        elif p_type == PT_DYNAMIC:
            dynamic = (offset, min(filesz, MAX_DYNAMIC * (16 if wide else 8)))
        elif p_type == PT_INTERP:
            interp = (offset, min(filesz, MAX_NAME + 1))
    return _Layout(big, wide, machine, loads, dynamic, interp)


def _dynamic(read: Read, layout: _Layout, out: ElfNeeds) -> None:
    entry = struct.Struct((">" if layout.big else "<") + ("qQ" if layout.wide else "iI"))
    data = read(*layout.dynamic) if layout.dynamic else b""
    strtab = strsz = None
    needed: list[int] = []
    paths: dict[int, list[int]] = {DT_RPATH: [], DT_RUNPATH: []}
    for tag, value in entry.iter_unpack(data[:len(data) - len(data) % entry.size]):
        if tag == DT_NULL:
            break
        if tag == DT_NEEDED and len(needed) < MAX_NEEDED:
            needed.append(value)
        elif tag == DT_STRTAB:
            strtab = value
        elif tag == DT_STRSZ:
            strsz = value
        elif tag in paths:
            paths[tag].append(value)
    if strtab is None or strsz is None:
        return
    base = _file_offset(layout, strtab)
    if base is None:
        return
    size = min(strsz, MAX_STRTAB)

    def string(at: int) -> str | None:
        if not 0 <= at < size:
            return None
        return _name(read(base + at, min(MAX_NAME + 1, size - at)).split(b"\0", 1)[0])

    out.needed = [n for n in map(string, needed) if n]
    for at in paths[DT_RUNPATH] or paths[DT_RPATH]:
        dirs = string(at)
        out.search += [d for d in (dirs or "").split(":") if d]


def _file_offset(layout: _Layout, vaddr: int) -> int | None:
    """The file offset of a virtual address, through the PT_LOAD that maps it."""
    for start, size, offset in layout.loads:
        if start <= vaddr < start + size:
            return offset + vaddr - start
    return None


def _name(raw: bytes) -> str | None:
    """A name as the loader would take it; None for one that is not a
    plain, printable name of at most ``MAX_NAME`` bytes."""
    if not raw or len(raw) > MAX_NAME:
        return None
    try:
        name = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    return name if name.isprintable() else None
