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

import bisect
import os
import re
from collections.abc import Iterator

PAGE = os.sysconf("SC_PAGE_SIZE")
# a page map entry's last byte (little-endian): 0x80 present, 0x40 swapped
MARKED = bytes(1 if b & 0xC0 else 0 for b in range(256))
MARKED_RUN = re.compile(b"\x01+")
READ_PAGES = 1 << 16  # page map entries read at once (512 KiB)


def resident_runs(pid: int, dev: int, ino: int) -> list[tuple[int, int]]:
    """Worker thread: ``(offset, length)`` runs of the file ``(dev, ino)``
    whose pages process ``pid`` has in its page tables (present or swapped
    out), over all its mappings of the file, sorted and joined. Raises
    OSError where the process or its maps cannot be read."""
    wanted = f"{os.major(dev):02x}:{os.minor(dev):02x}"
    runs: list[tuple[int, int]] = []
    with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as maps, \
            open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pagemap:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 5 or fields[3] != wanted or int(fields[4]) != ino:
                continue
            low, high = (int(x, 16) for x in fields[0].split("-"))
            offset = int(fields[2], 16)  # (the mapping's start in the file)
            runs += [(offset + first * PAGE, count * PAGE) for first, count
                     in _present(pagemap.fileno(), low // PAGE, (high - low) // PAGE)]
    return _joined(runs)


def _present(pagemap: int, start: int, count: int) -> Iterator[tuple[int, int]]:
    """Runs ``(first, count)`` (page indexes from ``start``) of the virtual
    pages ``[start, start + count)`` that are present or swapped (bits 63 and
    62 of an entry: the top bits of its last byte, little-endian)."""
    for at in range(0, count, READ_PAGES):
        n = min(READ_PAGES, count - at)
        flags = os.pread(pagemap, n * 8, (start + at) * 8)[7::8].translate(MARKED)
        for run in MARKED_RUN.finditer(flags):
            yield at + run.start(), run.end() - run.start()


def _joined(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` runs sorted, those that touch or overlap joined."""
    out: list[tuple[int, int]] = []
    for offset, length in sorted(runs):
        if out and offset <= out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], offset + length - out[-1][0]))
        else:
            out.append((offset, length))
    return out


def touches(runs: list[tuple[int, int]], offset: int, length: int) -> bool:
    """Whether ``[offset, offset + length)`` meets any of ``runs`` (sorted,
    disjoint)."""
    i = bisect.bisect_right(runs, offset, key=lambda run: run[0] + run[1])  # (ends after it)
    return i < len(runs) and runs[i][0] < offset + length
