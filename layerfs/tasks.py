"""The daemon's task group: one object, made by whoever composes the daemon
and handed in their constructors to the parts that start background work
(the fetch core's write-behind, the prefetch policy's fetch-ahead, the
sandboxes' and containerd's trace replays), open while the daemon runs.

Before it is opened (a fetcher used outside a daemon: a test, a benchmark)
there is no background: a write-behind is written inline, and nothing is
fetched ahead or replayed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import trio


class TaskGroup:
    def __init__(self) -> None:
        self.nursery: trio.Nursery | None = None  # while open

    @asynccontextmanager
    async def open(self) -> AsyncIterator[trio.Nursery]:
        """Open the group for the block: its nursery, closed (and waited for)
        when the block ends."""
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            try:
                yield nursery
            finally:
                self.nursery = None

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: object) -> bool:
        """``fn(*args)`` in the group, if it is open; whether it was started."""
        if self.nursery is None:
            return False
        self.nursery.start_soon(fn, *args)
        return True
