"""The gc command: delete blobs that no ref reaches, and leftovers of interrupted writes."""

from __future__ import annotations

import click

from layerfs.gc import DEFAULT_GRACE, collect
from layerfs.node.protocol import utc_time
from layerfs.refstore import RefStore

from .common import (
    Output,
    exit_if_unreadable,
    human_bytes,
    report_unreadable,
    store_options,
    warn,
)


@click.command()
@click.option("--dry-run", is_flag=True, help="Only list what is unreachable.")
@click.option("--grace", type=float, default=DEFAULT_GRACE, show_default=True,
              help="Keep unreachable blobs and temporaries younger than this many seconds "
                   "(a push refreshes what it reuses and writes its ref last; keep it "
                   "above a minute).")
@store_options
def gc(out: Output, refstore: RefStore, dry_run: bool, grace: float) -> None:
    """Delete blobs no layer or env ref reaches, and no live node lease (what the
    nodes' sandboxes, vms and disks use), and temporary files of interrupted writes.
    A ref, manifest or lease that cannot be read is named on an error line; gc then
    deletes no blob (only old temporaries) and exits 6."""
    rep = collect(refstore, dry_run=dry_run, grace=grace)
    doc = {"dry_run": dry_run, "reachable": rep.reachable, "unreachable": rep.unreachable,
           "deleted": rep.deleted, "deleted_bytes": rep.deleted_bytes,
           "kept_young": rep.kept_young, "temporaries": rep.temporaries,
           "deleted_temporaries": rep.deleted_temporaries, "swept": rep.swept,
           "unreadable": [{"what": u.what, "reason": u.reason} for u in rep.unreadable],
           "freed": {"objects": rep.deleted + rep.deleted_temporaries,
                     "bytes": rep.deleted_bytes},
           "expired": [f"{e.kind[:-1]} {e}" for e in rep.expiry.removed],
           "expired_in_use": rep.expiry.kept_in_use,
           "stale_expiries": rep.expiry.stale, "unreadable_expiries": rep.expiry.unreadable,
           "live_leases": rep.live_leases,
           "kept_for_leases": [k.to_json() for k in rep.kept_for_leases],
           "expired_leases": rep.expired_leases}
    report_unreadable(rep.unreadable)
    for key in rep.expiry.unreadable:
        warn(f"expiry record {key} cannot be read: left alone")

    def text() -> str:
        verb = "would delete" if dry_run else "deleted"
        lines = [f"{'would remove' if dry_run else 'removed'} expired {e.kind[:-1]} {e}"
                 for e in rep.expiry.removed]
        lines += [f"kept expired layer {k}" for k in rep.expiry.kept_in_use]
        lines += [k.line() for k in rep.kept_for_leases]
        lines += [f"lease of node {e['node']} ({e['host']}) expired "
                  f"{utc_time(e['expired'])}: keeps nothing"
                  + ("; deleted" if e["deleted"] else "") for e in rep.expired_leases]
        lines += [f"{u['digest']} {human_bytes(u['size']):>10}  age {u['age_s']:.0f}s"
                 + ("  (kept: younger than --grace)" if u["young"] else "")
                 for u in rep.unreachable]
        lines += [f"{t['key']} {human_bytes(t['size']):>10}  age {t['age_s']:.0f}s  temporary"
                  + ("  (kept: younger than --grace)" if t["young"] else "")
                  for t in rep.temporaries]
        total = sum(u["size"] for u in rep.unreachable)
        count = len(rep.unreachable) - rep.kept_young if dry_run else rep.deleted
        if not rep.swept:
            count = 0
        if not dry_run:  # (temporaries included)
            lines.append(f"freed {rep.deleted + rep.deleted_temporaries} objects, "
                         f"{human_bytes(rep.deleted_bytes)} ({rep.deleted_bytes} bytes)")
        lines.append(f"{rep.reachable} reachable, {len(rep.unreachable)} unreachable "
                     f"({human_bytes(total)}); {verb} {count}" + ("" if rep.swept else
                     f" ({len(rep.unreadable)} refs or manifests unreadable: no blob is "
                     f"deleted until each is repaired or its ref removed)"))
        if rep.temporaries:
            old = sum(1 for t in rep.temporaries if not t["young"])
            gone = old if dry_run else rep.deleted_temporaries
            lines.append(f"{len(rep.temporaries)} temporary files of interrupted writes; "
                         f"{verb} {gone}")
        return "\n".join(lines)

    out.emit(doc, text)
    exit_if_unreadable(rep.unreadable)
