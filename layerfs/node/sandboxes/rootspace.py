"""Room on ROOT's file system, which the cache, the meta images, the replica,
the sandboxes' upper directories and the runtimes' state share.

Two amounts keep a full file system an ordinary day (docs/dev/node.md):

* the **reserve** (``--reserve``; default 5% of the file system, at least
  16 MiB, at most 1 GiB): room the cache leaves to everything else. At start
  the cache's bound is lowered to what the file system has room for less the
  reserve (:meth:`RootSpace.cache_room`), in one log line.
* the **held space**: a quarter of the reserve (4 to 64 MiB), allocated
  (``fallocate``) as the file ``ROOT/reserve``, so a sandbox writing until
  ENOSPC cannot take it. When a write of the daemon's own state (an LMDB
  commit: a sandbox record, a trace, a layer) fails for want of room, the file
  is emptied (:meth:`RootSpace.release`) and the write tried once more; the
  space is taken again (:meth:`RootSpace.retake`) after the next ``down`` or
  ``up``, as soon as the file system has it.

``up`` (and ``run``) on a file system with less than ``NEEDED`` free besides
the held space fails at once with :class:`~layerfs.errors.NodeFull`.
Blocking calls: run them in worker threads.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from ...errors import NodeFull
from ...sizes import mib

log = logging.getLogger(__name__)
RESERVE_FILE = "reserve"
RESERVE_SHARE = 0.05  # of the file system, the default reserve
RESERVE_MIN, RESERVE_MAX = 16 << 20, 1 << 30
HELD_MIN, HELD_MAX = 4 << 20, 64 << 20
NEEDED = 4 << 20  # free bytes an up or a run needs besides the held space


@dataclass(frozen=True)
class FsUsage:
    """ROOT's file system: its size and the bytes root may still write."""

    total: int
    free: int


def fs_usage(path: str | Path) -> FsUsage:
    """Sizes of the file system holding ``path``; free is what ``df`` shows as
    available (blocks kept for root, and ext4's own reserve, not counted)."""
    st = os.statvfs(path)
    return FsUsage(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


def default_reserve(total: int) -> int:
    return min(max(int(total * RESERVE_SHARE), RESERVE_MIN), RESERVE_MAX)


def check_room(root: str | Path, what: str) -> None:
    """NodeFull unless ROOT's file system has ``NEEDED`` bytes free for ``what``."""
    if fs_usage(root).free < NEEDED:
        raise no_room_for(root, what)


def no_room_for(root: str | Path, what: str) -> NodeFull:
    """The error of ``what`` (a sandbox, a container) finding ROOT full."""
    return NodeFull(root, mib(fs_usage(root).free), what, mib(NEEDED))


class RootSpace:
    """The reserve and the held space on ROOT's file system."""

    def __init__(self, root: Path, reserve: int | None = None) -> None:
        self.root = root
        self.path = root / RESERVE_FILE
        self.reserve = default_reserve(fs_usage(root).total) if reserve is None else reserve
        self.held_size = min(max(self.reserve // 4, HELD_MIN), HELD_MAX)
        self._lock = threading.Lock()

    def held(self) -> int:
        """Bytes the held file has allocated now."""
        try:
            return os.stat(self.path).st_blocks * 512
        except FileNotFoundError:
            return 0

    def cache_room(self, cached: int) -> int:
        """Bytes the cache (now ``cached`` bytes of files) may fill: the free
        space, its own files and the held file's, less the reserve."""
        return fs_usage(self.root).free + cached + self.held() - self.reserve

    def take(self) -> bool:
        """Allocate the held file whole; False if the file system has not the
        room (what it had is kept, the rest taken by a later :meth:`retake`)."""
        with self._lock:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.held_size)
            except OSError as exc:
                log.debug("held space not taken whole: %s", exc)
                return False
            finally:
                os.close(fd)
            return True

    def retake(self) -> None:
        """Take the held space again if it was given up and there is room."""
        if self.held() < self.held_size and fs_usage(self.root).free > self.held_size + NEEDED \
                and self.take():
            log.info("held space of %s on ROOT taken again", mib(self.held_size))

    def release(self) -> bool:
        """Give the held space back to the file system (a write of the daemon's
        state found it full); False if there was none to give."""
        with self._lock:
            had = self.held()
            if had == 0:
                return False
            os.truncate(self.path, 0)
        log.warning("ROOT's file system is full: gave up the %s held for the daemon's "
                    "state to write it", mib(had))
        return True

    def check_room(self, what: str) -> None:
        """Take the held space again if there is room, then NodeFull unless
        the file system has room for ``what``."""
        self.retake()
        check_room(self.root, what)
