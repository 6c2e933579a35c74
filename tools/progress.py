"""A one-line progress display on stderr (files, bytes, throughput)."""

from __future__ import annotations

import sys
import time

from .common import human_bytes


class ProgressLine:
    """Counts files and bytes; redraws at most ten times a second on a terminal."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self.files = 0
        self.bytes = 0
        self.start = time.monotonic()
        self._drawn = 0.0

    def on_file(self) -> None:
        self.files += 1
        self._maybe_draw()

    def on_bytes(self, n: int) -> None:
        self.bytes += n
        self._maybe_draw()

    def _maybe_draw(self) -> None:
        now = time.monotonic()
        if self.enabled and now - self._drawn >= 0.1:
            self._drawn = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.bytes / max(now - self.start, 1e-6)
        line = (f"{self.label}: {self.files} files, {human_bytes(self.bytes)}, "
                f"{human_bytes(rate)}/s")
        sys.stderr.write("\r\033[K" + line)
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            sys.stderr.write("\n")
            sys.stderr.flush()
