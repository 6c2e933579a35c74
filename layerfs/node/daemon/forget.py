"""Forgetting layers no sandbox used for a while (``daemon --forget-after``).

A layer is in use while a sandbox record (in any state: starting, up, lost,
down_failed) names it or it is mounted. Each sweep notes the time for every
layer in use; a layer the replica holds that no sandbox used for the
configured time (and no vm: while one is up, nothing is forgotten) is dropped
from the node: its replica entries (manifest,
chunk table, trace, the resolutions naming it), its meta image, and the
cache files of its chunks that no other layer the node holds has. The time a
layer was last used is kept in memory and starts at the daemon's start for
the layers it finds, so a restart only postpones forgetting.

The drop runs under the layer's mount lock (:meth:`LayerMounts.acquire`
takes it to fetch and mount), after checking again that nothing uses the
layer: an ``up`` that needs the layer meanwhile waits for the drop and then
fetches it from the store again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import trio

from ..reads.chunkcache import ChunkCache
from ..replica.replica import Replica
from ..sandboxes.layermounts import LayerMounts

log = logging.getLogger(__name__)
SWEEP_MAX = 60.0  # seconds between sweeps at most


class LayerForgetter:
    """Drops the layers no sandbox used for ``forget_after`` seconds."""

    def __init__(self, replica: Replica, cache: ChunkCache, layers: LayerMounts,
                 in_use: Callable[[], Iterable[str]], forget_after: float,
                 paused: Callable[[], bool] = lambda: False) -> None:
        self.replica = replica
        self.cache = cache
        self.layers = layers
        self.in_use = in_use  # digests the sandbox records name
        self.forget_after = forget_after
        self.paused = paused  # while true, every layer held counts as used
        self.last_used: dict[str, float] = {}

    def _used_now(self) -> set[str]:
        return set(self.in_use()) | set(self.layers.mounted)

    async def run(self) -> None:
        """Sweep for ever, every half ``forget_after`` (at most a minute)."""
        interval = max(0.2, min(self.forget_after / 2, SWEEP_MAX))
        while True:
            await self.sweep()
            await trio.sleep(interval)

    async def sweep(self) -> list[str]:
        """Forget what is due; the digests forgotten."""
        now = time.time()
        for digest in self._used_now():
            self.last_used[digest] = now
        held = await trio.to_thread.run_sync(self.replica.layer_digests)
        for digest in held:
            self.last_used[digest] = now if self.paused() else self.last_used.get(digest, now)
        due = [d for d in held if now - self.last_used[d] >= self.forget_after]
        forgotten = []
        for digest in due:
            async with self.layers.lock(digest):
                if digest in self._used_now() or self.paused():
                    self.last_used[digest] = time.time()
                    continue
                freed = await trio.to_thread.run_sync(self._drop, digest)
            self.last_used.pop(digest, None)
            forgotten.append(digest)
            log.info("forgot layer %s: no sandbox used it for %.0fs (%d cache bytes freed)",
                     digest, self.forget_after, freed)
        return forgotten

    def _drop(self, digest: str) -> int:
        """Worker thread: the layer's replica entries, meta image and local
        or partial blob file, then its chunks' cache files that no other held
        layer has; bytes freed."""
        chunks = self.replica.forget_layer(digest)
        if self.layers.local is not None:
            self.layers.local.forget(digest.removeprefix("sha256:"))
        if self.layers.partial is not None:
            self.layers.partial.forget(digest.removeprefix("sha256:"))
        for other in self.replica.layer_digests():
            chunks -= self.replica.chunk_shas(other)
        return sum(self.cache.discard(sha) for sha in chunks)
