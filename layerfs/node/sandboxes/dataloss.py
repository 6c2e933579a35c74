"""Sandboxes and vms whose data can no longer be trusted: gone from the
store, or read unguarded after a crash.

A chunk read that the store answers "no such object" for its pack (a gc that
did not know the node held the layer, a lost volume, a pack deleted by hand)
means every sandbox and vm on a layer whose chunk table names that pack has
lost data: its reads of those chunks fail (EIO) and will keep failing. The
fetcher reports the pack (:attr:`.reads.fetcher.ChunkFetcher.pack_missing`);
:class:`DataLoss` finds the layers served from it and their users, logs one
ERROR line per sandbox (or vm) and layer, naming both, counts it
(``layerfs_sandbox_data_lost_total{layer}``) and marks the sandbox
``data_lost`` in ``ps``, kept in the replica (``datalost``) so that a
restarted daemon says so too, until the sandbox is down. Runs on the trio
loop; the replica is written in a worker thread.

The same mark, with its own ERROR line, goes to the sandboxes on a layer a
crashed daemon had mounted over a partial file when its keeper died too
(:meth:`DataLoss.read_unguarded`): the pre-content group went with both, so
their mounts read the file's holes as zeros until the next daemon started,
and a process that still has the old mount reads them still.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import trio

from ..protocol import SandboxRecord, VmRecord
from ..replica.replica import Replica

log = logging.getLogger(__name__)
DATA_LOST = "data_lost"  # the state ps shows


@dataclass(frozen=True)
class NodeUsers:
    """What the daemon serves, read when a pack is found missing."""

    tables: Callable[[], Iterable[tuple[str, list[str]]]]  # served layer → its packs
    sandboxes: Callable[[], Iterable[SandboxRecord]]
    vms: Callable[[], Iterable[VmRecord]]


class DataLoss:
    def __init__(self, users: NodeUsers, counted: Callable[[str], None],
                 replica: Replica) -> None:
        self.users = users
        self.counted = counted  # a (sandbox or vm, layer) found: the metric, by layer
        self.replica = replica
        self.missing: set[str] = set()  # packs found missing
        # sandbox or vm id → its layers with lost data (kept in the replica: a restart keeps it)
        self.lost: dict[str, set[str]] = {
            sid: set(layers) for sid, layers in replica.data_lost().items()}

    def pack_missing(self, pack: str) -> None:
        if pack in self.missing:
            return
        self.missing.add(pack)
        layers = [digest for digest, packs in self.users.tables() if pack in packs]
        for layer in layers:
            for kind, sid, ref, used in self._users():
                if layer in used and layer not in self.lost.setdefault(sid, set()):
                    self.lost[sid].add(layer)
                    self.counted(layer)
                    self._save(sid)
                    log.error("%s %s: the data of its layer %s%s is gone from the store "
                              "(pack %s missing): its reads of it fail; take it down and "
                              "bring it up from a layer the store has", kind, sid, layer,
                              f" ({ref})" if ref else "", pack)

    def read_unguarded(self, layers: list[str]) -> None:
        """At a start: the sandboxes on ``layers`` (each mounted over a partial
        file whose group is gone) are marked, each with one ERROR line."""
        for kind, sid, ref, used in self._users():
            for layer in sorted(set(layers) & set(used)):
                if layer in self.lost.setdefault(sid, set()):
                    continue
                self.lost[sid].add(layer)
                self.counted(layer)
                self._save(sid)
                log.error("%s %s: its layer %s%s was read with no daemon and no keeper to "
                          "fill it (both were killed): reads of data the node did not hold "
                          "got zeros; take it down and bring it up again",
                          kind, sid, layer, f" ({ref})" if ref else "")

    def _users(self) -> Iterable[tuple[str, str, str, list[str]]]:
        for record in self.users.sandboxes():
            yield "sandbox", record.id, record.env or " ".join(record.layer_refs), record.layers
        for vm in self.users.vms():
            yield "vm", vm.id, " ".join(layer.ref for layer in vm.layers), \
                [layer.digest for layer in vm.layers]

    def state(self, sid: str, state: str) -> str:
        """A sandbox's state for ``ps``: ``data_lost`` if it is up on lost data."""
        return DATA_LOST if state == "up" and self.lost.get(sid) else state

    def forget(self, sid: str) -> None:
        """The sandbox (or vm) is down."""
        if self.lost.pop(sid, None) is not None:
            self._save(sid)

    def _save(self, sid: str) -> None:
        """Write ``sid``'s entry to the replica, in a worker thread (not waited for)."""
        layers = sorted(self.lost.get(sid, ()))

        def write() -> None:
            try:
                if layers:
                    self.replica.put_data_lost(sid, layers)
                else:
                    self.replica.delete_data_lost(sid)
            except Exception as exc:  # noqa: BLE001 - ps shows it until a restart anyway
                log.warning("sandbox %s: its data_lost mark is not kept: %s", sid, exc)

        trio.lowlevel.spawn_system_task(trio.to_thread.run_sync, write)
