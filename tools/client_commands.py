"""What the node client commands (``up``, ``down``, ``ps``, ``stats``, ``run``)
do once their arguments are parsed: a call of :class:`layerfs.node.Client`
and its output. Click-free, so that :mod:`.fastpath` runs them without
importing click; :mod:`.node` and :mod:`.run` declare their options."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from layerfs.errors import UsageError
from layerfs.node.client import Client
from layerfs.node.protocol import utc_time

from .common import Output, human_bytes, warn


def up(env_ref: str | None, layers: Sequence[str], sid: str, prefetch: str,
       bundle_dir: str | None, root: str, as_json: bool) -> None:
    if bool(env_ref) == bool(layers):
        raise UsageError("give ENV_REF or --layer refs (not both)")
    record = Client(root).up(sid, env=env_ref, layers=layers, prefetch=prefetch,
                             bundle_dir=bundle_dir)
    for used in record.offline:  # the store did not answer: the node's own resolution
        warn(used.note())
    doc = record.to_json()
    if bundle_dir:
        doc["bundle"] = os.path.join(os.path.abspath(bundle_dir), "config.json")
    Output(as_json).emit(doc, record.rootfs)


def down(sid: str, keep_upper: bool, force: bool, root: str, as_json: bool) -> None:
    record = Client(root).down(sid, keep_upper=keep_upper, force=force)
    Output(as_json).emit(record.to_json(), f"{sid} down")


def ps(root: str, as_json: bool) -> None:
    rows = Client(root).ps()

    def text() -> str:
        lines = [f"{'ID':20} {'STATE':8} {'UPPER':>10} {'READ':>10}  LAYERS"]
        for r in rows:
            refs = r.env or " ".join(r.layer_refs)
            if r.offline:
                made = utc_time(min(used.made for used in r.offline))
                refs += f"  (resolved by the node, {r.offline[0].reason}; resolution of {made})"
            lines.append(f"{r.id:20} {r.state:8} {human_bytes(r.upper_bytes):>10} "
                         f"{human_bytes(r.layer_bytes_read):>10}  {refs}")
        return "\n".join(lines)

    Output(as_json).emit([r.to_json() for r in rows], text)


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
            lines.append(f"layer {digest[:19]}: read {human_bytes(layer.bytes_read)} of "
                         f"{human_bytes(layer.blob_bytes)}, chunks {layer.chunks_touched}"
                         f"/{layer.chunks}, used by {layer.users}")
        return "\n".join(lines)

    Output(as_json).emit(res.to_json(), text)


def run(sid: str, cmd: Sequence[str], runtime_name: str, network: str, user: str | None,
        entrypoint: str | None, root: str) -> None:
    sys.exit(Client(root).run(sid, cmd, runtime=runtime_name, network=network, user=user,
                              entrypoint=entrypoint, terminal=sys.stdin.isatty()))
