"""The export command: an env out as an OCI image (layout directory or archive)."""

from __future__ import annotations

import click

from layerfs.builder.oci.export import LAYER_TYPES, export_env, parse_destination
from layerfs.refstore import RefStore

from .common import Output, human_bytes, store_options


@click.command("export")
@click.argument("env_ref", metavar="ENV")
@click.argument("dest", metavar="DEST")
@click.option("--fold", is_flag=True,
              help="One layer of the merged tree (whiteouts applied) instead of one per layer.")
@click.option("--compression", type=click.Choice(sorted(LAYER_TYPES)), default="gzip",
              show_default=True, help="How the layer tars are compressed.")
@store_options
def export(out: Output, refstore: RefStore, env_ref: str, dest: str, fold: bool,
           compression: str) -> None:
    """Export the env ENV as an OCI image to DEST: oci:DIR[:TAG] (an image
    layout; an existing layout gets the tag added) or oci-archive:FILE[:TAG]
    (a tar of a layout). TAG defaults to latest."""
    result = export_env(refstore, env_ref, parse_destination(dest), fold=fold,
                        compression=compression)
    doc = {
        "env": result.env,
        "destination": result.destination,
        "manifest": result.manifest_digest,
        "config": result.config_digest,
        "layers": [{"source": x.source, "digest": x.digest, "size": x.size,
                    "diff_id": x.diff_id, "entries": x.stats.entries,
                    "file_bytes": x.stats.file_bytes, "hard_links": x.stats.hard_links,
                    "whiteouts": x.stats.whiteouts, "opaque_dirs": x.stats.opaque_dirs,
                    "skipped_sockets": x.stats.skipped_sockets} for x in result.layers],
    }

    def text() -> str:
        lines = [f"{result.env} -> {result.destination} {result.manifest_digest}"]
        for x in result.layers:
            sockets = x.stats.skipped_sockets
            skipped = f", {sockets} sockets skipped" if sockets else ""
            lines.append(f"  {x.digest[:19]} {human_bytes(x.size):>10}  {x.source}{skipped}")
        return "\n".join(lines)

    out.emit(doc, text)
