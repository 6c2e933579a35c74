"""Log lines that may repeat once per chunk or per read, rate-limited.

A :class:`RateLimitedLog` writes the first line of each kind at once, then at
most one line of that kind per ``interval`` (60 s): the one that ends a
quiet interval carries the count of those left out since the last line,
``... (and 1,765 more like it in the last 60 s)``. A kind is a short name
the caller picks (``"cache write"``, ``"store timeout"``): lines of one kind
are one problem seen many times, so the first says what it is and the count
says how often. Thread safe: the chunk cache writes from worker threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

INTERVAL = 60.0  # seconds between two lines of one kind


@dataclass
class _Kind:
    last: float  # when its last line was written
    left_out: int = 0  # lines not written since then


class RateLimitedLog:
    """One line per kind per ``interval`` seconds through ``logger``."""

    def __init__(self, logger: logging.Logger, interval: float = INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._kinds: dict[str, _Kind] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, kind, msg, *args)

    def error(self, kind: str, msg: str, *args: object) -> None:
        self.log(logging.ERROR, kind, msg, *args)

    def log(self, level: int, kind: str, msg: str, *args: object) -> None:
        """``msg % args`` at ``level``, unless a line of ``kind`` was written
        less than ``interval`` seconds ago (then it is only counted)."""
        if not self.logger.isEnabledFor(level):
            return
        now = self.clock()
        with self._lock:
            seen = self._kinds.get(kind)
            if seen is not None and now - seen.last < self.interval:
                seen.left_out += 1
                return
            left_out, since = (seen.left_out, now - seen.last) if seen else (0, 0.0)
            self._kinds[kind] = _Kind(now)
        if left_out:
            msg += f" (and {left_out:,} more like it in the last {since:.0f} s)"
        self.logger.log(level, msg, *args)
