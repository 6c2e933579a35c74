"""Env commands: env create, env ls."""

from __future__ import annotations

import click

from layerfs.builder.env import create_env
from layerfs.names import Ref
from layerfs.refstore import ENVS, RefStore

from .common import (
    Output,
    exit_if_unreadable,
    report_unreadable,
    store_options,
    write_store_options,
)


@click.group()
def env() -> None:
    """Environments: ordered lists of layers, top first."""


@env.command("create")
@click.argument("ref")
@click.option("--layer", "layers", multiple=True, required=True, metavar="REF",
              help="A layer, top first (repeat: workspace, toolchain, base).")
@click.option("--on", "on", metavar="ENV",
              help="Put the layers on top of env ENV's layers and keep its image config.")
@write_store_options
def create(out: Output, refstore: RefStore, ref: str, layers: tuple[str, ...],
           on: str | None) -> None:
    """Create the env REF (name@version) from layers, top first (on top of ENV with --on)."""
    parsed = Ref.parse(ref)
    if parsed.digest:
        raise click.BadParameter("an env is created as name@version", param_hint="REF")
    assert parsed.name and parsed.version
    result = create_env(refstore, parsed.name, parsed.version, list(layers), on=on)
    doc = {"ref": result.ref, "digest": result.digest, "published": result.published,
           "layers": [layer.__dict__ for layer in result.manifest.layers]}
    state = "" if result.published else "  (unchanged: already published)"
    out.emit(doc, f"{result.ref} {result.digest}{state}")


@env.command("ls")
@click.argument("name", required=False)
@click.option("--all", "all_", is_flag=True,
              help="Also the chain index's envs (oci/chains/..., one per imported image layer).")
@store_options
def ls(out: Output, refstore: RefStore, name: str | None, all_: bool) -> None:
    """List envs (all, or the versions of NAME); one that cannot be read is
    named on an error line and skipped (exit 6 after the list). The chain
    index's envs are listed with --all, or by NAME."""
    from layerfs.builder.oci.chains import CHAIN_PREFIX

    rows = []
    envs, unreadable = refstore.read_refs(
        ENVS, name, refstore.env,
        keep=None if all_ or name else lambda n: not n.startswith(CHAIN_PREFIX))
    report_unreadable(unreadable)
    for entry, m in envs:
        rows.append({"ref": str(entry), "digest": entry.digest, "created": m.created,
                     "layers": [layer.ref for layer in m.layers]})
    out.emit(rows, lambda: "\n".join(
        f"{r['ref']:30} {' '.join(r['layers'])}" for r in rows) or "(no envs)")
    exit_if_unreadable(unreadable)
