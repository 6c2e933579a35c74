"""The revoke and unrevoke commands: the store's revocation list (layerfs.leases)."""

from __future__ import annotations

import time

import click

from layerfs.errors import ObjectNotFound, RefNotFound
from layerfs.inspect import resolve_any
from layerfs.leases import Revocation, delete_revocation, live_leases, write_revocation
from layerfs.names import Ref
from layerfs.refstore import LAYERS, RefStore

from .common import Output, write_store_options
from .layers import holders

RENEWALS = "at their next lease renewal (a fifth of the nodes' --lease-ttl, 2 min by default)"


def revoked_digest(refstore: RefStore, ref: str) -> tuple[str, str]:
    """(kind, digest) of a layer or env ref; a digest whose manifest is gone is a layer's."""
    try:
        return resolve_any(refstore, ref)
    except (ObjectNotFound, RefNotFound):
        if ref.startswith("sha256:"):
            Ref.parse(ref)  # (a well-formed digest)
            return LAYERS, ref
        raise


@click.command()
@click.argument("ref", metavar="REF")
@click.option("--reason", default="", help="Why, for the nodes' refusals and the list.")
@write_store_options
def revoke(out: Output, refstore: RefStore, ref: str, reason: str) -> None:
    """Revoke layer or env REF (name@version or sha256:...): nodes refuse new ups of it
    (an env's, a layer's) from their next lease renewal on, their store away or not.
    Lists the sandboxes, vms and disks still on it (from the nodes' leases): take them
    down on their node, `layerfs down --force ID`."""
    kind, digest = revoked_digest(refstore, ref)
    write_revocation(refstore.store, Revocation(digest, ref, kind[:-1], time.time(), reason))
    still = holders(refstore, live_leases(refstore.store), kind, digest)
    doc = {"ref": ref, "kind": kind[:-1], "digest": digest, "reason": reason,
           "still_on_it": [{"node": h.lease.node, "host": h.lease.host,
                            "kind": h.holder.kind, "id": h.holder.id} for h in still]}

    def text() -> str:
        lines = [f"revoked {kind[:-1]} {shown(ref, digest)}: nodes refuse new ups of it "
                 f"{RENEWALS}"]
        lines += [f"  still on it: {h} (on that node: layerfs down --force {h.holder.id})"
                  if h.holder.kind == "sandbox" else f"  still on it: {h}" for h in still]
        return "\n".join(lines)

    out.emit(doc, text)


@click.command()
@click.argument("ref", metavar="REF")
@write_store_options
def unrevoke(out: Output, refstore: RefStore, ref: str) -> None:
    """Lift the revocation of layer or env REF (name@version or sha256:...)."""
    kind, digest = revoked_digest(refstore, ref)
    if not delete_revocation(refstore.store, digest):
        raise RefNotFound("revocation", shown(ref, digest))
    out.emit({"ref": ref, "kind": kind[:-1], "digest": digest},
             lambda: f"unrevoked {kind[:-1]} {shown(ref, digest)}: nodes bring it up again "
                     f"{RENEWALS}")


def shown(ref: str, digest: str) -> str:
    return ref if ref == digest else f"{ref} ({digest})"

