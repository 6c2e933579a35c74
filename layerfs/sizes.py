"""Sizes: a size given as text (``1M``, ``4KiB``, ``1048576``) and written as
text, the space a directory tree takes on disk, and the errors of a write
that found no room."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a write failed for want of room


def mib(n: int) -> str:
    """``n`` bytes for a message: ``20,480 MiB``."""
    return f"{n / (1 << 20):,.0f} MiB"


def size_arg(n: int) -> str:
    """``n`` bytes as a size option takes it (``64M``; :func:`parse_size` reads it back)."""
    return f"{n / (1 << 20):g}M"


def parse_size(text: str) -> int:
    """``1M``, ``4KiB``, ``1048576`` → bytes (binary units); ValueError if not a size."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in UNITS else (t, "")
    try:
        return int(float(num) * UNITS[unit])
    except OverflowError:  # "inf", or more digits than a float holds
        raise ValueError(f"not a size: {text[:80]!r}") from None


def du(path: Path) -> int:
    """Bytes the files below ``path`` take on disk (their blocks), like ``du -s``;
    a file that vanishes meanwhile counts nothing."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total
