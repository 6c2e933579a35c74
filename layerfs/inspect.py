"""What a layer or env holds and costs: sizes, chunks, stored and shared bytes."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from .manifest import manifest_kind
from .refstore import ENVS, LAYERS, RefStore


def shared_locations(refstore: RefStore, exclude: str) -> set[tuple[str, int]]:
    """Chunk locations referenced by every layer version other than ``exclude``."""
    seen: set[tuple[str, int]] = set()
    for entry in refstore.list_refs(LAYERS):
        if entry.digest == exclude:
            continue
        table = refstore.chunk_table(refstore.any_layer(entry.digest))
        seen.update(e.location for e in table.entries)
    return seen


def disk_report(refstore: RefStore, digest: str) -> dict[str, Any]:
    manifest = refstore.disk(digest)
    table = refstore.chunk_table(manifest)
    stored = table.stored_bytes()
    others = shared_locations(refstore, digest)
    return {
        "kind": "lsmt",
        "ref": f"{manifest.name}@{manifest.version}",
        "digest": digest,
        "role": manifest.role,
        "created": manifest.created,
        "virtual_size": manifest.virtual_size,
        "data_bytes": manifest.stats.file_bytes,
        "parent": manifest.parent_ref,
        "chain_depth": len(refstore.disk_chain(digest)),
        "blob_bytes": manifest.blob_size,
        "chunks": len(table),
        "stored_bytes": stored,
        "shared_bytes": sum(e.stored_length for e in table.entries if e.location in others),
        "uploaded_bytes": manifest.stats.uploaded_bytes,
    }


def layer_report(refstore: RefStore, digest: str, shared: bool = True) -> dict[str, Any]:
    if manifest_kind(refstore.store.get_blob(digest)) == "lsmt":
        return disk_report(refstore, digest)
    manifest = refstore.layer(digest)
    table = refstore.chunk_table(manifest)
    stored = table.stored_bytes()
    logical = sum(e.length for e in table.entries)
    report: dict[str, Any] = {
        "kind": "layer",
        "ref": f"{manifest.name}@{manifest.version}",
        "digest": digest,
        "role": manifest.role,
        "created": manifest.created,
        "chunk_size": manifest.chunk_size,
        "meta_bytes": manifest.meta.raw_size,
        "meta_stored_bytes": manifest.meta.size,
        "chunk_table_bytes": manifest.chunk_table.size,
        "blob_bytes": manifest.blob_size,
        "packs": len(table.packs()),
        "stored_bytes": stored,
        "compression_ratio": round(logical / stored, 3) if stored else None,
        "stats": asdict(manifest.stats),
        "dedup_sources": manifest.dedup_sources,
    }
    if shared:
        others = shared_locations(refstore, digest)
        report["shared_bytes"] = sum(e.stored_length for e in table.entries
                                     if e.location in others)
    return report


def env_report(refstore: RefStore, digest: str) -> dict[str, Any]:
    manifest = refstore.env(digest)
    layers = []
    for layer in manifest.layers:
        lm = refstore.layer(layer.digest)
        layers.append({
            "ref": layer.ref,
            "digest": layer.digest,
            "role": lm.role,
            "created": lm.created,
            "file_bytes": lm.stats.file_bytes,
            "uploaded_bytes": lm.stats.uploaded_bytes,
        })
    return {
        "kind": "env",
        "ref": f"{manifest.name}@{manifest.version}",
        "digest": digest,
        "created": manifest.created,
        "layers": layers,
    }


def resolve_any(refstore: RefStore, text: str) -> tuple[str, str]:
    """(kind, digest) for a layer or env reference; layers are tried first."""
    from .errors import RefNotFound

    if text.startswith("sha256:"):
        digest = refstore.resolve(LAYERS, text)
        kind = manifest_kind(refstore.store.get_blob(digest))
        return (ENVS if kind == "env" else LAYERS), digest
    try:
        return LAYERS, refstore.resolve(LAYERS, text)
    except RefNotFound:
        pass
    try:
        return ENVS, refstore.resolve(ENVS, text)
    except RefNotFound:
        raise RefNotFound("layer or env", text) from None
