"""The daemon's lifecycle lines for on-call: one INFO line per sandbox or vm
``up``, ``down`` and ``commit`` (with its duration), and the summaries of a
start and a stop (the version, the sandboxes and vms restored, unmounted or
handed over).

Each line carries its facts twice: in its text, for a reader of the journal,
and as ``extra=`` fields, which ``--log-format json`` writes as keys of the
line's object (layerfs/node/daemon/jsonlog.py) for a log pipeline to filter on:
``sandbox``, ``vm``, ``env`` (the ref asked for), ``layers`` (the layers'
manifest digests, top first), ``layer_refs`` (their names, ``name@version``,
from the manifests the node holds; "" where it holds none), ``digest``,
``ref``, ``duration`` (seconds), ``version``, ``sandboxes``, ``vms``,
``states``, ``ending``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

from ... import __version__
from ...manifest import manifest_head
from ..protocol import CommitAnswer, SandboxRecord, VmRecord
from ..replica.replica import Replica

log = logging.getLogger(__name__)


def layer_name(replica: Replica, digest: str) -> str:
    """``name@version`` of a layer the node holds the manifest of, else ""
    (a blocking LMDB read: call it in a thread)."""
    try:  # a name for a log line: never a reason for the work to fail
        data = replica.manifest(digest)
        head = manifest_head(data, digest) if data is not None else None
    except Exception:  # (a damaged manifest, a replica closing)
        return ""
    return f"{head.name}@{head.version}" if head is not None else ""


def layer_names(replica: Replica, digests: Iterable[str]) -> list[str]:
    return [layer_name(replica, d) for d in digests]


def sandbox_fields(record: SandboxRecord, names: list[str]) -> dict[str, object]:
    return {"sandbox": record.id, "env": record.env, "layers": list(record.layers),
            "layer_refs": names, "state": record.state}


def what_of(record: SandboxRecord, names: list[str]) -> str:
    """``env e@1, layers a@1 b@2`` (names where known, else short digests)."""
    shown = [name or digest.removeprefix("sha256:")[:12]
             for name, digest in zip(names, record.layers, strict=False)]
    env = f"env {record.env}, " if record.env else ""
    return f"{env}layer{'' if len(shown) == 1 else 's'} {' '.join(shown)}"


def sandbox_up(record: SandboxRecord, names: list[str], seconds: float) -> None:
    """``names``: the layers' ``name@version`` (:func:`layer_names`), top first."""
    log.info("sandbox %s up in %.2f s: %s", record.id, seconds, what_of(record, names),
             extra={**sandbox_fields(record, names), "duration": round(seconds, 4)})


def sandbox_down(record: SandboxRecord, names: list[str], seconds: float) -> None:
    log.info("sandbox %s down in %.2f s (%s): %s", record.id, seconds, record.state,
             what_of(record, names),
             extra={**sandbox_fields(record, names), "duration": round(seconds, 4)})


def sandbox_committed(answer: CommitAnswer, seconds: float) -> None:
    log.info("sandbox %s committed as %s %s in %.2f s (%s uploaded, %d chunks new)",
             answer.id, answer.ref, answer.digest, seconds, f"{answer.uploaded_bytes:,} B",
             answer.unique_chunks,
             extra={"sandbox": answer.id, "ref": answer.ref, "digest": answer.digest,
                    "duration": round(seconds, 4), "uploaded_bytes": answer.uploaded_bytes})


def vm_fields(record: VmRecord) -> dict[str, object]:
    return {"vm": record.id, "layers": list(record.blobs), "disk": record.disk,
            "state": record.state}


def vm_up(record: VmRecord, seconds: float) -> None:
    log.info("vm %s up in %.2f s: %d layer drive%s, disk %s", record.id, seconds,
             len(record.blobs), "" if len(record.blobs) == 1 else "s", record.disk,
             extra={**vm_fields(record), "duration": round(seconds, 4)})


def vm_down(record: VmRecord, seconds: float) -> None:
    log.info("vm %s down in %.2f s: disk %s", record.id, seconds, record.disk,
             extra={**vm_fields(record), "duration": round(seconds, 4)})


def states_text(states: dict[str, int]) -> str:
    return ", ".join(f"{n} {state}" for state, n in sorted(states.items()))


def count_states(records: Iterable[SandboxRecord]) -> dict[str, int]:
    return dict(Counter(r.state for r in records))


def ready(root: str, store_url: str, sandboxes: Iterable[SandboxRecord], vms: int,
          seconds: float) -> None:
    """The start's summary (its text begins ``layerfs daemon ready at ROOT``)."""
    states = count_states(sandboxes)
    count = sum(states.values())
    log.info("layerfs daemon ready at %s (store %s): version %s, %d sandbox%s restored%s, "
             "%d vm%s, in %.2f s", root, store_url, __version__, count,
             "" if count == 1 else "es", f" ({states_text(states)})" if states else "",
             vms, "" if vms == 1 else "s", seconds,
             extra={"version": __version__, "sandboxes": count, "states": states, "vms": vms,
                    "duration": round(seconds, 4)})


UNMOUNTED, HANDED_OVER, FAILED = "unmounted", "handed_over", "failed"  # how a daemon ends
ENDINGS = {UNMOUNTED: "unmounted, their vms' drives closed",
           HANDED_OVER: "handed over to the next daemon",
           FAILED: "left mounted for the next daemon (it failed)"}


def stopped(how: str, sandboxes: int, vms: int) -> None:
    """The stop's summary: what was unmounted, handed to the next daemon, or
    left as a crash leaves it (``how``: one of ENDINGS)."""
    log.info("layerfs daemon stopped: version %s, %d sandbox%s and %d vm%s %s", __version__,
             sandboxes, "" if sandboxes == 1 else "es", vms, "" if vms == 1 else "s",
             ENDINGS[how], extra={"version": __version__, "sandboxes": sandboxes, "vms": vms,
                                  "ending": how})
