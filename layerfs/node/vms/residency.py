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
(root has it); the present bit is all it reads.

The process is the VMM's user's (whoever listens on its QMP socket), so the
read is bounded: the process is known by its pid and its start time (a pid
reused since is another process: no answer); at most :data:`MAX_MAPPINGS`
mappings of the file, each cut to the file's size; a deadline checked before
each read of the page map; one byte of memory per page of the file. What
the process maps only narrows a working set (the chunks the node read that
hold a mapped page): it decides how much a later resume over the same
snapshot layers prefetches, never what it reads.
"""

from __future__ import annotations

import bisect
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

PAGE = os.sysconf("SC_PAGE_SIZE")
# a page map entry's most significant byte: 0x80 present, 0x40 swapped
MARKED = bytes(1 if b & 0xC0 else 0 for b in range(256))
TOP = 7 if sys.byteorder == "little" else 0  # (that byte's place in an entry)
MARKED_RUN = re.compile(b"\x01+")
READ_PAGES = 1 << 16  # page map entries read at once (512 KiB)
MAX_MAPPINGS = 16  # mappings of the file looked at (QEMU maps a RAM file once)


class NotKnown(OSError):
    """the process's pages cannot be known"""


@dataclass(frozen=True)
class Process:
    """A process, by pid and start time (clock ticks after boot): a pid
    reused since names another process."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> Process | None:
        """Worker thread: process ``pid`` now (None where it is gone or 0)."""
        if pid <= 0:
            return None
        try:
            return cls(pid, start_time(pid))
        except OSError:
            return None


def start_time(pid: int) -> int:
    """Process ``pid``'s start time, from ``/proc/PID/stat`` (field 22,
    after the command name in parentheses, which may hold anything)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def resident_runs(process: Process, dev: int, ino: int, size: int,
                  deadline: float) -> list[tuple[int, int]]:
    """Worker thread: ``(offset, length)`` runs of the file ``(dev, ino)``,
    ``size`` bytes, whose pages ``process`` has in its page tables (present
    or swapped out), over its mappings of the file, sorted and joined.
    Raises OSError (:class:`NotKnown` among them) where they cannot be
    known: the process gone or another one, too many mappings, past
    ``deadline`` (``time.monotonic()``)."""
    wanted = f"{os.major(dev):02x}:{os.minor(dev):02x}"
    pages = bytearray(-(-size // PAGE))  # 1 where a page is mapped
    seen = 0
    with open(f"/proc/{process.pid}/maps", encoding="ascii", errors="replace") as maps, \
            open(f"/proc/{process.pid}/pagemap", "rb", buffering=0) as pagemap:
        if start_time(process.pid) != process.start:
            raise NotKnown(f"process {process.pid} is not the VMM any more")
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 5 or fields[3] != wanted or int(fields[4]) != ino:
                continue
            seen += 1
            if seen > MAX_MAPPINGS:
                raise NotKnown(f"process {process.pid} maps the file more than "
                               f"{MAX_MAPPINGS} times")
            low, high = (int(x, 16) for x in fields[0].split("-"))
            first = int(fields[2], 16) // PAGE  # (the mapping's first page of the file)
            count = min((high - low) // PAGE, len(pages) - first)  # (none past the file's end)
            for at, n in _present(pagemap.fileno(), low // PAGE, count, deadline):
                pages[first + at:first + at + n] = b"\x01" * n
    return [(m.start() * PAGE, (m.end() - m.start()) * PAGE)
            for m in MARKED_RUN.finditer(pages)]


def _present(pagemap: int, start: int, count: int, deadline: float) -> Iterator[tuple[int, int]]:
    """Runs ``(first, count)`` (page indexes from ``start``) of the virtual
    pages ``[start, start + count)`` that are present or swapped (bits 63 and
    62 of an entry)."""
    for at in range(0, max(count, 0), READ_PAGES):
        if time.monotonic() > deadline:
            raise NotKnown("its page tables took too long to read")
        n = min(READ_PAGES, count - at)
        flags = os.pread(pagemap, n * 8, (start + at) * 8)[TOP::8].translate(MARKED)
        for run in MARKED_RUN.finditer(flags):
            yield at + run.start(), run.end() - run.start()


def touches(runs: list[tuple[int, int]], offset: int, length: int) -> bool:
    """Whether ``[offset, offset + length)`` meets any of ``runs`` (sorted,
    disjoint)."""
    i = bisect.bisect_right(runs, offset, key=lambda run: run[0] + run[1])  # (ends after it)
    return i < len(runs) and runs[i][0] < offset + length
