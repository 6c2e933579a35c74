"""What the node client commands (``up``, ``down``, ``ps``, ``stats``, ``run``)
do once their arguments are parsed: a call of :class:`layerfs.node.Client`
and its output. Click-free, so that :mod:`.fastpath` runs them without
importing click; :mod:`.node` and :mod:`.run` declare their options."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from layerfs.errors import UsageError
from layerfs.node.client import Client
from layerfs.node.protocol import PsAnswer, utc_time

from .common import Output, human_bytes, warn_offline

TYPE_CHECKING = False  # (typing is not imported at run time)
if TYPE_CHECKING:
    from typing import Any

    from layerfs.node.protocol import SandboxRecord


def sandbox_json(record: SandboxRecord) -> dict[str, Any]:
    """A sandbox record as the JSON output shows it: ``created`` in ISO 8601 UTC."""
    doc = record.to_json()
    doc["created"] = utc_time(record.created, micros=True)
    return doc


def up(env_ref: str | None, layers: Sequence[str], sid: str, prefetch: str,
       bundle_dir: str | None, root: str, as_json: bool, memory: str | None = None,
       cpus: str | None = None, pids: str | None = None,
       disk_quota: str | None = None) -> None:
    if bool(env_ref) == bool(layers):
        raise UsageError("give ENV_REF or --layer refs (not both; several layers: repeat "
                         "--layer, --layer A --layer B)")
    record = Client(root).up(sid, env=env_ref, layers=layers, prefetch=prefetch,
                             bundle_dir=bundle_dir,
                             memory=limit_value("--memory", memory, size),
                             cpus=limit_value("--cpus", cpus, float),
                             pids=limit_value("--pids", pids, int),
                             disk_quota=limit_value("--disk-quota", disk_quota, size))
    warn_offline(record.offline)  # the store did not answer: the node's own resolution
    doc = sandbox_json(record)
    if bundle_dir:
        doc["bundle"] = os.path.join(os.path.abspath(bundle_dir), "config.json")
    Output(as_json).emit(doc, record.rootfs)


def size(text: str) -> int:
    from layerfs.sizes import parse_size

    return parse_size(text)


def limit_value(option: str, text: str | None, parse: Callable[[str], Any]) -> Any:
    """An ``up`` limit's value, None if not given; one usage error if malformed."""
    if text is None:
        return None
    try:
        value = parse(text)
    except ValueError:
        raise UsageError(f"{option}: not a valid value: {text[:80]!r}") from None
    if value != value or value in (float("inf"), float("-inf")):  # nan, inf
        raise UsageError(f"{option}: not a valid value: {text[:80]!r}")
    return value


def down(sid: str, keep_upper: bool, force: bool, root: str, as_json: bool) -> None:
    record = Client(root).down(sid, keep_upper=keep_upper, force=force)
    Output(as_json).emit(sandbox_json(record), f"{sid} down")


def ps(root: str, as_json: bool) -> None:
    from layerfs.node.sandboxes.limits import describe

    answer = Client(root).ps_all()
    rows = answer.sandboxes

    def text() -> str:
        lines = [f"{'ID':20} {'STATE':11} {'UPPER':>10} {'LAYERS READ':>11}  LAYERS"]
        for r in rows:
            refs = r.env or " ".join(r.layer_refs)
            if r.offline:
                made = utc_time(min(used.made for used in r.offline))
                refs += f"  (resolved by the node, {r.offline[0].reason}; resolution of {made})"
            limits = f"  (limits: {describe(r.limits)})" if r.limits.given() else ""
            lines.append(f"{r.id:20} {r.state:11} {human_bytes(r.upper_bytes):>10} "
                         f"{human_bytes(r.layer_bytes_read):>11}  {refs}{limits}")
        return "\n".join(lines + containerd_rows(answer))

    Output(as_json).emit([sandbox_json(r) for r in rows], text)


def containerd_rows(answer: PsAnswer) -> list[str]:
    """``ps``'s section of containerd's snapshots (none: no section)."""
    if not answer.snapshot_count:
        return []
    shown = len(answer.snapshots)
    more = f", the first {shown} listed" if shown < answer.snapshot_count else ""
    lines = ["", f"containerd snapshots: {answer.snapshot_count}{more}",
             f"{'KIND':10} {'TREE':32}  NAME (PARENT)"]
    for snap in answer.snapshots:
        tree = (f"lazy, {snap.layers} layerfs layer(s)" if snap.chain else "plain")
        parent = f"  ({printable(snap.parent)})" if snap.parent else ""
        lines.append(f"{snap.kind:10} {tree:32}  {printable(snap.name)}{parent}")
    return lines


def printable(text: str) -> str:
    """``text`` as one line: a containerd key may hold any character."""
    return text if text.isprintable() else ascii(text)


def stats(root: str, as_json: bool) -> None:
    res = Client(root).stats()
    c = res.cache

    def text() -> str:
        lines = [f"cache: {human_bytes(c['size'])} of {human_bytes(c['limit'])} in "
                 f"{c['entries']} chunks; hits {c['hits']}, misses {c['misses']}, fetched "
                 f"{human_bytes(c['bytes_fetched'])}, written {human_bytes(c['bytes_written'])}"
                 f", evictions {c['evictions']}, corrupt {c['corrupt']}"]
        if res.store:
            lines.append("store requests: " + ", ".join(f"{kind} {n}" for kind, n
                                                         in sorted(res.store.items())))
        for digest, layer in res.layers.items():
            name = f"{layer.name} " if layer.name else ""
            lines.append(f"layer {name}{digest[:19]}: read {human_bytes(layer.bytes_read)} of "
                         f"{human_bytes(layer.blob_bytes)}, chunks {layer.chunks_touched}"
                         f"/{layer.chunks}, used by {layer.users}")
        return "\n".join(lines)

    Output(as_json).emit(res.to_json(), text)


def run(sid: str, cmd: Sequence[str], runtime_name: str, network: str, user: str | None,
        entrypoint: str | None, root: str, env: Sequence[str] = (), cwd: str | None = None,
        timeout: str | None = None) -> None:
    result = Client(root).run(sid, cmd, runtime=runtime_name, network=network, user=user,
                              entrypoint=entrypoint, terminal=sys.stdin.isatty(),
                              env=env_pairs(env), cwd=cwd, timeout=seconds(timeout))
    sys.exit(result.exit_code)


def env_pairs(items: Sequence[str]) -> dict[str, str]:
    """``--env KEY=VALUE`` options as a mapping (a later KEY wins)."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--env {item!r}: expected KEY=VALUE")
        env[key] = value
    return env


def seconds(text: str | None) -> float | None:
    """``--timeout SECONDS``: a positive number up to the runner's bound, or None."""
    if text is None:
        return None
    from layerfs.node.containers.runner import MAX_TIMEOUT

    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= MAX_TIMEOUT:
        raise UsageError(f"--timeout {text!r}: expected a positive number of seconds,"
                         f" at most {MAX_TIMEOUT:.0f} (366 days)")
    return value
