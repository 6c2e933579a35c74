"""Which pages of a file a process has mapped in: its page tables, read from
``/proc/PID/maps`` and ``/proc/PID/pagemap``.

A resumed guest's working set is what it touched in its first seconds. The
node sees its RAM file's reads, but a VMM that asks for transparent huge
pages on guest RAM (QEMU does, on every RAM block) makes the kernel read
each fault's 2 MiB-aligned window and the next one (4 MiB) into the page
cache, most of it never touched. The pages the VMM's process has mapped are
what it touched (and, within the kernel's fault-around of 64 KiB, pages next
to them already cached): :func:`resident_runs` gives them as runs of file
offsets. Reading another process's page map needs the right to trace it
(root has it); the present bit is all it reads. What a process maps can
only narrow a working set: it keeps, of the chunks the node read, those
with a mapped page (a VMM's user who put another process behind its QMP
socket changes what its own snapshot prefetches, nothing else).
"""

from __future__ import annotations

import os

PAGE = os.sysconf("SC_PAGE_SIZE")
# a page map entry's last byte (little-endian): 0x80 present, 0x40 swapped
MARKED = bytes(1 if b & 0xC0 else 0 for b in range(256))
READ_PAGES = 1 << 16  # page map entries read at once (512 KiB)


def resident_runs(pid: int, dev: int, ino: int) -> list[tuple[int, int]]:
    """Worker thread: ``(offset, length)`` runs of the file ``(dev, ino)``
    whose pages process ``pid`` has in its page tables (present or swapped
    out), over all its mappings of the file, sorted and joined. Raises
    OSError where the process or its maps cannot be read."""
    wanted = f"{os.major(dev):02x}:{os.minor(dev):02x}"
    pages: set[int] = set()
    with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as maps, \
            open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pagemap:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 5 or fields[3] != wanted or int(fields[4]) != ino:
                continue
            low, high = (int(x, 16) for x in fields[0].split("-"))
            first = int(fields[2], 16) // PAGE  # the mapping's first page of the file
            pages.update(first + i for i in _present(pagemap, low // PAGE, (high - low) // PAGE))
    return _runs(sorted(pages))


def _present(pagemap, start: int, count: int) -> list[int]:
    """The indexes (from ``start``) of the virtual pages ``[start, start +
    count)`` that are present or swapped (bits 63 and 62 of an entry: the
    top bits of its last byte, little-endian)."""
    found: list[int] = []
    for at in range(0, count, READ_PAGES):
        n = min(READ_PAGES, count - at)
        flags = os.pread(pagemap.fileno(), n * 8, (start + at) * 8)[7::8].translate(MARKED)
        i = flags.find(1)
        while i >= 0:
            found.append(at + i)
            i = flags.find(1, i + 1)
    return found


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted page numbers as ``(offset, length)`` byte runs."""
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] == p * PAGE:
            runs[-1] = (runs[-1][0], runs[-1][1] + PAGE)
        else:
            runs.append((p * PAGE, PAGE))
    return runs


def touches(runs: list[tuple[int, int]], offset: int, length: int) -> bool:
    """Whether ``[offset, offset + length)`` meets any of ``runs`` (sorted,
    disjoint)."""
    lo, hi = 0, len(runs)
    while lo < hi:  # the first run that ends after offset
        mid = (lo + hi) // 2
        if runs[mid][0] + runs[mid][1] <= offset:
            lo = mid + 1
        else:
            hi = mid
    return lo < len(runs) and runs[lo][0] < offset + length
