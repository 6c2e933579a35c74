"""The node's lease in the store, and its copy of the revocation list (:mod:`layerfs.leases`).

The daemon's :class:`Leaser` task writes ``leases/<node id>`` (the id kept in
``ROOT/node-id``) with what the node's sandboxes, vms, writable disks and
containerd's lazy snapshots use, expiring ``--lease-ttl`` seconds later; it
writes it again every fifth of the TTL (5 s after a renewal the store
failed, so that a store back from an outage has it soon), and soon after a change
(:meth:`Leaser.changed`: an ``up``, a ``down``, a ``vm up`` ...). Each time it
also copies the store's revocation list into the replica, where ``up`` looks
(:meth:`.replica.noderefs.NodeRefs.check_revoked`), so revocations hold while the store
is away. The store requests run in a worker thread (the control store: short
timeouts); a failure is one INFO line (the store's outage has its own
WARNING), one WARNING line if the store refuses the write (access denied).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import trio

from ...errors import AccessDenied, StoreError
from ...leases import NODE_ID_RE, Holder, Lease, new_node_id, read_revocations, write_lease
from ...store.base import Store
from ..protocol import BrokenDisk, DiskRecord, SandboxRecord, VmRecord
from .replica import Replica

log = logging.getLogger(__name__)
NODE_ID_FILE = "node-id"
RENEWALS_PER_TTL = 5
SETTLE = 0.2  # seconds a change waits for the next ones (a burst of ups: one write)
RETRY = 5.0  # seconds before a renewal the store failed is tried again


def node_id(root: Path) -> str:
    """The node's id, made and kept in ``ROOT/node-id`` at its first start (and
    made again, one WARNING line, if what is there is not an id)."""
    path = root / NODE_ID_FILE
    try:
        kept = path.read_text(errors="replace").strip()
    except FileNotFoundError:
        kept = None
    if kept is not None and NODE_ID_RE.fullmatch(kept):
        return kept
    made = new_node_id()
    if kept is not None:
        log.warning("%s does not hold a node id: a new one, %s (the old lease expires)",
                    path, made)
    tmp = root / f"{NODE_ID_FILE}.tmp{os.getpid()}"
    tmp.write_text(made + "\n")
    os.replace(tmp, path)
    return made


def node_holders(sandboxes: Iterable[SandboxRecord], vms: Iterable[VmRecord],
                 disks: Iterable[DiskRecord | BrokenDisk], snapshots: list[str]) -> list[Holder]:
    """What the node holds (on the trio loop): each sandbox's and vm's layers,
    each writable disk's base (a vm's disk is one: its drive chain), and the
    layers of containerd's lazy snapshots."""
    found = [Holder("sandbox", r.id, tuple(r.layers), r.env or " ".join(r.layer_refs))
             for r in sandboxes]
    found += [Holder("vm", v.id, tuple(layer.digest for layer in v.layers),
                     " ".join(layer.ref for layer in v.layers)) for v in vms]
    found += [Holder("disk", d.id, (d.base,), d.base_ref or "") for d in disks
              if isinstance(d, DiskRecord) and d.base]
    if snapshots:
        found.append(Holder("containerd", "snapshots", tuple(sorted(set(snapshots)))))
    return found


class Leaser:
    def __init__(self, store: Store, replica: Replica, node: str, ttl: float,
                 holders: Callable[[], list[Holder]]) -> None:
        self.store = store
        self.replica = replica
        self.node = node
        self.host = socket.gethostname()
        self.ttl = ttl
        self.holders = holders  # on the trio loop
        self._changed = trio.Event()
        self._denied = False
        self.renewed: Lease | None = None  # the last lease written

    def changed(self) -> None:
        """What the node holds changed (on the trio loop): renew soon."""
        self._changed.set()

    async def run(self) -> None:
        """For the daemon's life: renew now, then every fifth of the TTL or after a change."""
        while True:
            self._changed = trio.Event()
            lease = self._lease()
            done = await trio.to_thread.run_sync(self.renew, lease, abandon_on_cancel=True)
            wait = self.ttl / RENEWALS_PER_TTL
            with trio.move_on_after(wait if done else min(wait, RETRY)):
                await self._changed.wait()
                await trio.sleep(SETTLE)

    def _lease(self) -> Lease:
        now = time.time()
        return Lease(self.node, self.host, now, now + self.ttl, self.holders())

    def renew(self, lease: Lease) -> bool:
        """Worker thread: write the lease, then copy the revocation list; False
        if the store failed it."""
        try:
            write_lease(self.store, lease)
            self.renewed = lease
            self._copy_revocations()
        except AccessDenied as exc:
            if not self._denied:
                log.warning("node lease %s not written: %s; gc does not know what this "
                            "node holds", self.node, exc)
            self._denied = True
            return False
        except StoreError as exc:
            log.info("node lease %s not renewed: %s", self.node, exc)
            return False
        return True

    def _copy_revocations(self) -> None:
        found, bad = read_revocations(self.store)
        for unreadable in bad:
            log.warning("revocation list: %s", unreadable)
        if bad:
            return  # (a damaged entry may be one the node must keep refusing: keep the old copy)
        self.replica.keep_revocations({r.digest: r.to_bytes() for r in found})
