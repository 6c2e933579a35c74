"""Layer commands: build, ls, inspect, verify, rm."""

from __future__ import annotations

from collections import Counter
from typing import Any

import click

from layerfs.builder.layer import BuildOptions, Progress, build_layer
from layerfs.errors import LayerfsError, VerifyFailed
from layerfs.inspect import env_report, layer_report, resolve_any
from layerfs.leases import Held, Lease, holders_of, live_leases
from layerfs.manifest import ROLES
from layerfs.refstore import ENVS, LAYERS, RefStore
from layerfs.retention import remove
from layerfs.verify import EXIT_CODES, Found, VerifyReport, verify_layer, worst

from .common import (
    Output,
    ProgressLine,
    exit_if_unreadable,
    human_bytes,
    parse_size,
    report_unreadable,
    stderr_is_tty,
    store_options,
    warn,
    write_store_options,
)


@click.command()
@click.argument("src")
@click.option("--name", required=True, help="Layer name, lowercase [a-z0-9][a-z0-9._/-]*.")
@click.option("--version", "version", required=True, help="Layer version, [A-Za-z0-9._-]+.")
@click.option("--role", type=click.Choice(ROLES[:3]), default="base", show_default=True)
@click.option("--chunk-size", default="1M", show_default=True,
              help="Chunk size, a power of two from 4K to 16M.")
@click.option("--dedup-with", multiple=True, metavar="REF",
              help="Also reuse chunks stored by this layer (repeatable).")
@write_store_options
def build(out: Output, refstore: RefStore, src: str, name: str, version: str, role: str,
          chunk_size: str, dedup_with: tuple[str, ...]) -> None:
    """Build SRC (a directory, a tar/tar.gz/tar.zst file, or - for stdin) into
    the layer NAME@VERSION and publish it."""
    opts = BuildOptions(name, version, role, parse_size(chunk_size), list(dedup_with))
    line = ProgressLine(f"build {name}@{version}", enabled=stderr_is_tty() and not out.as_json)
    warnings: list[str] = []
    try:
        result = build_layer(refstore, src, opts,
                             Progress(line.on_file, line.on_bytes, warnings.append))
    finally:
        line.close()
        for text in warnings:
            warn(text)
    s = result.manifest.stats
    doc = {"ref": result.ref, "digest": result.digest, "published": result.published,
           "stats": {**s.__dict__, "uploaded_bytes": result.uploaded_bytes,
                     "uploaded_packs": result.uploaded_packs}}  # this push's
    if result.published:
        text = (f"{result.ref} {result.digest}\n"
                f"  {s.files} files, {human_bytes(s.file_bytes)}; {s.unique_chunks} chunks "
                f"({s.reused_chunks} already stored, {s.holes} holes); "
                f"uploaded {human_bytes(s.uploaded_bytes)} in {s.uploaded_packs} packs")
    else:
        text = f"{result.ref} {result.digest}\n  unchanged: already published, nothing uploaded"
    out.emit(doc, text)


@click.command("ls")
@click.argument("name", required=False)
@store_options
def ls(out: Output, refstore: RefStore, name: str | None) -> None:
    """List layers (all, or the versions of NAME); one that cannot be read is
    named on an error line and skipped (exit 6 after the list)."""
    rows: list[dict[str, Any]] = []
    layers, unreadable = refstore.read_refs(LAYERS, name, refstore.any_layer)
    report_unreadable(unreadable)
    for entry, m in layers:
        rows.append({"ref": str(entry), "digest": entry.digest, "role": m.role,
                     "file_bytes": m.stats.file_bytes, "created": m.created})
    out.emit(rows, lambda: "\n".join(
        f"{r['ref']:40} {r['role']:10} {human_bytes(r['file_bytes']):>10}  "
        f"{r['created']}  {r['digest'][:19]}" for r in rows) or "(no layers)")
    exit_if_unreadable(unreadable)


@click.command()
@click.argument("ref")
@store_options
def inspect(out: Output, refstore: RefStore, ref: str) -> None:
    """Show what the layer or env REF holds: sizes, chunks, stored and shared bytes."""
    kind, digest = resolve_any(refstore, ref)
    if kind == ENVS:
        rep = env_report(refstore, digest)
        out.emit(rep, lambda: _env_text(rep))
    else:
        rep = layer_report(refstore, digest)
        out.emit(rep, lambda: _disk_text(rep) if rep["kind"] == "lsmt" else _layer_text(rep))


def _layer_text(r: dict) -> str:
    s = r["stats"]
    ratio = r["compression_ratio"]
    return "\n".join([
        f"layer {r['ref']}  {r['digest']}",
        f"  role {r['role']}, created {r['created']}, chunk size {human_bytes(r['chunk_size'])}",
        f"  files {s['files']}, dirs {s['dirs']}, symlinks {s['symlinks']}, other {s['others']}",
        f"  file bytes {human_bytes(s['file_bytes'])} (inline in meta "
        f"{human_bytes(s['inline_bytes'])}), blob {human_bytes(r['blob_bytes'])}",
        f"  meta image {human_bytes(r['meta_bytes'])} "
        f"({human_bytes(r['meta_stored_bytes'])} stored), chunk table "
        f"{human_bytes(r['chunk_table_bytes'])}",
        f"  chunks {s['chunks']}, unique {s['unique_chunks']}, holes {s['holes']}",
        f"  stored {human_bytes(r['stored_bytes'])} in {r['packs']} packs, compression "
        f"{ratio if ratio else '-'}x, shared with other layers "
        f"{human_bytes(r.get('shared_bytes'))}",
        f"  this push uploaded {human_bytes(s['uploaded_bytes'])} "
        f"({s['uploaded_packs']} packs, {s['reused_chunks']} chunks reused)"
        + (f"; dedup with {', '.join(r['dedup_sources'])}" if r["dedup_sources"] else ""),
    ])


def _disk_text(r: dict) -> str:
    return "\n".join([
        f"disk layer {r['ref']}  {r['digest']}",
        f"  created {r['created']}, parent {r['parent'] or '-'} (chain of {r['chain_depth']})",
        f"  disk {human_bytes(r['virtual_size'])}, data {human_bytes(r['data_bytes'])}, "
        f"sealed file {human_bytes(r['blob_bytes'])}",
        f"  chunks {r['chunks']}, stored {human_bytes(r['stored_bytes'])}, shared with other "
        f"layers {human_bytes(r['shared_bytes'])}, this push uploaded "
        f"{human_bytes(r['uploaded_bytes'])}",
    ])


def _env_text(r: dict) -> str:
    lines = [f"env {r['ref']}  {r['digest']}  created {r['created']}"]
    for layer in r["layers"]:
        lines.append(f"  {layer['ref']:36} {layer['role']:10} {layer['digest'][:19]}  "
                     f"created {layer['created']}  uploaded "
                     f"{human_bytes(layer['uploaded_bytes'])}")
    return "\n".join(lines)


@click.command()
@click.argument("ref")
@store_options
def verify(out: Output, refstore: RefStore, ref: str) -> None:
    """Check that every object of the layer (or of every layer of the env) REF
    is there and matches its sha256: its meta image, chunk table and each pack
    it uses. Lists per object what it found (ok, missing, unavailable,
    unreachable, denied, corrupt, error) and exits as the worst."""
    kind, digest = resolve_any(refstore, ref)
    digests = [x.digest for x in refstore.env(digest).layers] if kind == ENVS else [digest]
    reports = [verify_layer(refstore, d) for d in digests]
    out.emit([_verify_doc(r) for r in reports], lambda: "\n".join(map(_verify_text, reports)))
    bad = [r for r in reports if not r.ok]
    if bad:
        found = worst([r.found for r in bad])
        counts = Counter(o.found.value for r in bad for o in r.objects if o.found is not Found.OK)
        summary = ", ".join(f"{n} {what}" for what, n in sorted(counts.items()))
        raise VerifyFailed(", ".join(r.ref for r in bad),
                           f"{sum(counts.values())} bad objects ({summary})", EXIT_CODES[found])


def _verify_doc(r: VerifyReport) -> dict[str, Any]:
    return {"ref": r.ref, "chunks": r.chunks, "bytes": r.bytes, "found": r.found.value,
            "problems": r.problems,
            "objects": [{"what": o.what, "digest": o.digest, "found": o.found.value,
                         "chunks": o.chunks, "bad_chunks": o.bad_chunks, "detail": o.detail}
                        for o in r.objects]}


def _verify_text(r: VerifyReport) -> str:
    bad = len(r.problems)
    head = (f"{r.ref}: {r.chunks} chunks, {human_bytes(r.bytes)}, {len(r.objects)} objects: "
            + ("ok" if r.ok else f"{bad} bad"))
    lines = [head]
    for o in r.objects:
        chunks = f" ({o.bad_chunks} of {o.chunks} chunks)" if o.bad_chunks and o.chunks > 1 else ""
        detail = f": {o.detail}" if o.detail else ""
        lines.append(f"  {o.found.value:11} {o.what} {o.digest}{chunks}{detail}")
    return "\n".join(lines)


@click.command()
@click.argument("refs", nargs=-1, required=True, metavar="REF...")
@click.option("--force", is_flag=True,
              help="Remove a layer even if an env names it (the env keeps its blobs "
                   "reachable; only the layer's ref goes).")
@write_store_options
def rm(out: Output, refstore: RefStore, refs: tuple[str, ...], force: bool) -> None:
    """Remove the layer or env refs REF... (name@version; layer:REF or env:REF when
    both exist). A layer an env names is refused (exit 15) unless --force; envs
    given in the same command go first. The blobs are freed by the next gc."""
    done = remove(refstore, list(refs), force=force)
    leases = live_leases(refstore.store)
    held = [holders(refstore, leases, t.kind, t.digest) for t, _ in done]
    rows = [{"ref": f"{t.name}@{t.version}", "kind": t.kind[:-1], "digest": t.digest,
             "removed": removed, "held_by": [
                 {"node": h.lease.node, "host": h.lease.host, "kind": h.holder.kind,
                  "id": h.holder.id} for h in by]}
            for (t, removed), by in zip(done, held, strict=True)]

    def text() -> str:
        lines = []
        for r, by in zip(rows, held, strict=True):
            lines.append(f"removed {r['kind']} {r['ref']}" if r["removed"] else
                         f"kept {r['kind']} {r['ref']}: published again meanwhile")
            if by:
                on = ", ".join(str(h) for h in by)
                lines.append(f"  still held by {on}: gc keeps its data while their leases "
                             f"live (`layerfs revoke` to refuse new ups of it)")
        return "\n".join(lines)

    out.emit(rows, text)


def holders(refstore: RefStore, leases: list[Lease], kind: str, digest: str) -> list[Held]:
    """Who holds a layer, or an env's layers (its manifest read if it can be)."""
    layers = None
    if kind == ENVS:
        try:
            layers = [layer.digest for layer in refstore.env(digest).layers]
        except LayerfsError:
            layers = None
    return holders_of(leases, digest, layers)
